"""The messages the driver, the job board (pipeline/cluster/job_board.py) and the engine actors
trade: each is built (and so validated) by its sender, and crosses a process as this model."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from schemas.contracts import Contract, EngineStart, TrialVerdict
from schemas.drafter import ProbeResult
from schemas.report import SpeculationCosts


class ProbeClaim(Contract):
    """The drafter probe's rows, handed to the engine that measures them."""

    rows: list[dict[str, Any]] = Field(description="Prepared rows, as the engine stage receives them.")
    near_limit_rows: int = Field(description="Rows of the probe whose prompt and max_tokens nearly fill max_model_len.")


class ProbeVerdict(Contract):
    """What the engine that measured the probe posts; without a result when no probe ran."""

    result: Optional[ProbeResult] = None
    refusal: Optional[str] = Field(None, description="The refusal's message when the probe refused the drafter.")
    started_at: Optional[float] = Field(None, description="Unix time the probe's measuring began.")
    actor_id: Optional[str] = None


# The verdict of a graph where no probe runs (off, judged by an earlier graph or attempt, no rows).
NO_PROBE = ProbeVerdict()


class TrialPlan(Contract):
    """What the engines of a graph that runs the speculation trial are told."""

    rows: int = Field(description="The job's rows left.")
    engines: int = Field(description="The job's replicas.")
    unit_rows: int = Field(description="Rows of the units the arms measure (the head units', when the job has them).")
    max_units: Optional[int] = Field(
        None, description="Units an arm takes at most (half the head units); null: no cap."
    )
    costs: Optional[SpeculationCosts] = Field(
        None,
        description=(
            "A calibration's step costs at the job's concurrency: with them the trial is a prediction from the probe's "
            "acceptance, decided before any unit, and no arm is timed."
        ),
    )


class BoardReading(Contract):
    """What the driver records of a graph's board: every engine start, the probe's verdict and
    the trial's, once they are in."""

    starts: list[EngineStart]
    verdict: Optional[ProbeVerdict] = None
    trial: Optional[TrialVerdict] = None
