"""The speculation trial: does the configured speculation pay on this job's own traffic?

Acceptance says how many draft tokens the target kept, not whether the job went faster: at
high concurrency a verify pass over k+1 tokens per sequence can cost more than the tokens it
saves (docs/speculation.md measures both sides on one machine). So the first engine with work
measures the job's first units twice, on its own engine at the job's concurrency:

    `units` units with the configured depth (the engine as started; the probe ran on it),
       more until they spent `min_seconds` in the engine (at most a quarter of the job's rows)
    -> drain, restart the engine without the drafter -> as many units off, by the same rule
    -> keep off, or restart with the drafter when the speculation policy says it paid
       (pipeline/speculation/policy.py `trial_decision`) and the rest of the job pays back that start

Each arm's units run back to back with the engine otherwise idle, so an arm's rate is its
tokens over the engine time its units spanned (the union of their intervals in the engine: one
ramp-up and one drain each, and no gap between units, which the pipeline's dispatch would add
to whichever arm had more of them). Every unit of the trial is committed like any other (greedy
output is the same either way). The other engines keep the configured setting until the verdict is
in, then follow it. This module measures; the policy decides; pipeline/graph/engine_trial.py runs
the engine's part. A job with a calibration runs no timed trial: the policy predicts from the
calibration's step costs and the probe's acceptance instead (`early_decision`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from pipeline.config import JobConfig
from pipeline.speculation.policy import rest_seconds, setting_text, trial_concurrency
from pipeline.stages.stats import EngineBusyTime
from schemas import HeadUnits, TrialArm, TrialVerdict

# A job with fewer units than this many times trial.units skips the trial: its two arms
# would be half of it or more.
MIN_UNITS_PER_TRIAL_UNIT = 4


def skipped(config: JobConfig, reason: str, **figures) -> TrialVerdict:
    return TrialVerdict(
        outcome="skipped",
        reason=f"speculation {setting_text(config)}: trial skipped: {reason}",
        setting=setting_text(config),
        concurrency=trial_concurrency(config),
        **figures,
    )


def head_units(config: JobConfig, job_rows: int) -> Optional[HeadUnits]:
    """The units a new job begins with when its trial would measure units larger than its
    sequences at once: its first rows in units of that many rows, enough for the trial
    (MIN_UNITS_PER_TRIAL_UNIT x trial.units of them), so that the arms measure slices of the job
    at its concurrency, in engine seconds, whatever resources.rows_per_unit (4,096 by default).
    None for a job of fewer rows than that: it could not have its trial anyway."""
    spec = config.speculative
    if not (spec.enabled and spec.drafter and spec.trial):
        return None
    rows = trial_concurrency(config)
    head = HeadUnits(rows=MIN_UNITS_PER_TRIAL_UNIT * spec.trial.units * rows, rows_per_unit=rows)
    return head if config.resources.rows_per_unit > rows and job_rows >= head.rows else None


def too_few_units(
    config: JobConfig, todo_units: int, todo_rows: int, head: Optional[HeadUnits]
) -> Optional[TrialVerdict]:
    """The driver's check before any engine: a trial of 2 x trial.units units in a job of a few
    units. The skip says how many rows a trial needs: MIN_UNITS_PER_TRIAL_UNIT x trial.units units
    of the job's first units (its head units, when it has them)."""
    trial = config.speculative.trial
    need = MIN_UNITS_PER_TRIAL_UNIT * trial.units
    if todo_units >= need:
        return None
    # without head units (a job of fewer rows than they need), a job of more rows would have them
    unit_rows = head.rows_per_unit if head else min(config.resources.rows_per_unit, trial_concurrency(config))
    return skipped(
        config,
        f"{todo_rows:,} rows to run in {todo_units} unit{'s' if todo_units != 1 else ''}, "
        f"fewer than the {need} units a trial of 2 x {trial.units} "
        f"units needs to pay back its engine start: at least {need * unit_rows:,} rows, in units of {unit_rows:,} rows "
        "(speculative.trial.units)",
    )


@dataclasses.dataclass
class ArmClock:
    """One arm's units as they finish: (entered the engine, engine seconds, rows, generated tokens)."""

    setting: str
    units: list[tuple[float, float, int, int]] = dataclasses.field(default_factory=list)
    busy: EngineBusyTime = dataclasses.field(default_factory=EngineBusyTime)

    def add(self, started: float, engine_seconds: float, rows: int, tokens: int) -> None:
        self.units.append((started, engine_seconds, rows, tokens))
        self.busy.add("", started, engine_seconds)

    def seconds(self) -> float:
        """Engine time of the units that left: the union of their intervals."""
        return self.busy.seconds

    def figures(self) -> TrialArm:
        seconds = max(self.seconds(), 1e-9)
        tokens = sum(u[3] for u in self.units)
        return TrialArm(
            setting=self.setting,
            units=len(self.units),
            rows=sum(u[2] for u in self.units),
            generated_tokens=tokens,
            seconds=round(seconds, 3),
            tokens_per_second=round(tokens / seconds, 1),
            unit_tokens_per_second=[round(u[3] / u[1], 1) if u[1] > 0 else 0.0 for u in self.units],
        )


def arm_wants_more(
    config: JobConfig, entered: int, clock: ArmClock, job_rows: int, unit_rows: int, max_units: Optional[int] = None
) -> bool:
    """Whether the next unit joins the arm being measured: until it has trial.units units, then
    until its units spent trial.min_seconds in the engine, but never past a quarter of the job's
    rows: a few short units measure noise, not the setting (docs/measurements.md)."""
    trial = config.speculative.trial
    if entered < trial.units:
        return True
    if max_units is not None and entered >= max_units:  # half the head units each: a unit after them is another size
        return False
    return clock.seconds() < trial.min_seconds and entered * unit_rows < job_rows / MIN_UNITS_PER_TRIAL_UNIT


def worth_a_trial(
    config: JobConfig, probed_tokens_per_second: float, rows_left: int, engines: int, start_seconds: float
) -> Optional[TrialVerdict]:
    """Before the trial, from the drafter probe's rate (its rows at once, with the drafter) and
    rows x max_tokens (at most what is left to generate): the skipped verdict when even that
    cannot pay back an engine start, so that a small job skips the trial without measuring."""
    if probed_tokens_per_second <= 0:
        return None
    rest = rows_left * config.sampling.max_tokens / probed_tokens_per_second / max(engines, 1)
    return _too_short(config, rest, start_seconds)


def worth_measuring_off(
    config: JobConfig, on: TrialArm, rows_left: int, engines: int, start_seconds: float
) -> Optional[TrialVerdict]:
    """After the speculation arm: None when the off arm is worth an engine start, else the
    skipped verdict saying why. `rows_left`: the job's rows after this arm and an off arm like it."""
    return _too_short(config, rest_seconds(on, rows_left, engines), start_seconds, speculation=on)


def _too_short(config: JobConfig, rest: float, start_seconds: float, **figures) -> Optional[TrialVerdict]:
    payback = config.speculative.trial.payback_starts
    if rest >= payback * start_seconds:
        return None
    return skipped(
        config,
        f"the rest of the job is about {rest:.0f} s of generation per engine, too short to pay back an engine start of "
        f"{start_seconds:.0f} s ({payback:g} starts at least: speculative.trial.payback_starts)",
        engine_start_seconds=round(start_seconds, 3),
        **figures,
    )
