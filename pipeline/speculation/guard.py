"""The acceptance guard: a floor on acceptance while the job runs (`speculative.guard`).

The driver feeds it every unit-stats row as units commit. It keeps the last
`window_units` units that drafted (units without drafts say nothing about the drafter)
and, once the window is full, pools them (vLLM's acceptance by their draft tokens, tokens per
target pass by their tokens) and compares against the floors. Tokens per target pass counts
what a grammar cut from the drafts, which vLLM's acceptance counters leave out. It fires once
when the window falls below a floor, and again only after a full window has been back above it:
a drafter that stays poor gives one event, not one per unit.

At the end of every attempt `speculation_verdict` judges the job over the units that speculated.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from pipeline.config import GuardConfig, JobConfig
from pipeline.stages.stats import Acceptance
from pipeline.speculation.calibrations import JobCalibration
from schemas import GuardEvent, JobTotals, SpeculationVerdict, TrialVerdict, utc_timestamp


class AcceptanceTooLow(RuntimeError):
    """The guard's action is `fail` and acceptance fell below its floor."""


class AcceptanceGuard:
    def __init__(self, config: GuardConfig, attempt: int = 1):
        self.config, self.attempt = config, attempt
        self.window: deque[tuple[str, Acceptance, tuple[int, int]]] = deque(maxlen=config.window_units)
        self.tripped = False

    def observe(self, row: dict) -> Optional[GuardEvent]:
        """One unit-stats row (schemas.UnitStats as a dict); an event when the guard fires."""
        if not row["num_drafts"]:
            return None
        acceptance = Acceptance(
            row["num_drafts"], row["draft_tokens"], row["accepted_tokens"], row["accepted_per_position"]
        )
        tokens = (row.get("generated_tokens", 0), row.get("samples", 0))  # a row of a stats file before they were kept
        self.window.append((row["unit_id"], acceptance, tokens))
        if len(self.window) < self.config.window_units:
            return None
        breach = self._breach()
        if breach is None:
            self.tripped = False
            return None
        if self.tripped:
            return None
        self.tripped = True
        return self._event(*breach)

    def _breach(self) -> Optional[tuple[str, float, float]]:
        """(metric, value, floor) of the first floor the pooled window is below, if any."""
        pooled = sum((a for _, a, _ in self.window), Acceptance())
        generated, completions = (sum(t[i] for _, _, t in self.window) for i in (0, 1))
        floors = {
            "acceptance_rate": (pooled.acceptance_rate, self.config.min_acceptance_rate),
            "mean_acceptance_length": (pooled.mean_acceptance_length, self.config.min_mean_acceptance_length),
            "tokens_per_target_pass": (
                pooled.tokens_per_target_pass(generated, completions) if generated else None,
                self.config.min_tokens_per_target_pass,
            ),
        }
        for metric, (value, floor) in floors.items():
            if floor is not None and value is not None and value < floor:
                return metric, value, floor
        return None

    def _event(self, metric: str, value: float, floor: float) -> GuardEvent:
        action = self.config.action
        message = (
            f"{metric.replace('_', ' ')} {value:.3f} over the last {len(self.window)} units that drafted is below "
            f"speculative.guard.min_{metric} = {floor}; action: {action}"
        )
        return GuardEvent(
            time=utc_timestamp(),
            attempt=self.attempt,
            action=action,
            metric=metric,
            value=value,
            floor=floor,
            unit_ids=[unit_id for unit_id, _, _ in self.window],
            message=message,
        )


def speculation_turned_off(events: list[GuardEvent]) -> bool:
    """Whether the acceptance guard turned speculation off: for the rest of the job, resumes included."""
    return any(event.action == "disable-speculation" for event in events)


def depth_at(config: JobConfig, concurrency: int) -> int:
    """The depth the job drafts at with `concurrency` sequences running."""
    spec = config.speculative
    for lo, hi, k in spec.depth_schedule or []:
        if lo <= concurrency <= hi:
            return k
    return spec.num_speculative_tokens


def speculation_verdict(
    config: JobConfig,
    totals: JobTotals,
    events: list[GuardEvent],
    calibration: Optional[JobCalibration] = None,
    trial: Optional[TrialVerdict] = None,
) -> Optional[SpeculationVerdict]:
    """Did speculation pay over the committed units? None when the job did not speculate. Its
    figures are those of the units that speculated (JobTotals: not the trial's off arm, nor the
    units after the trial or the guard turned speculation off, which yield one token per pass by
    definition). What measured speculation against off decides whether it cost more than it
    saved, and is the verdict's `source`: the job's own trial, else its calibration
    (pipeline/speculation/calibrations.py) at its steady concurrency (the highest measured);
    only without either does a figure below a floor decide it. Each reason is a flag of its own."""
    spec = config.speculative
    if not spec.enabled:
        return None
    floor, tpp_floor = _floors(config)
    mal, tpp = totals.mean_acceptance_length, totals.tokens_per_target_pass
    measured = _measured(config, calibration, trial)
    flags = _below_floors(mal, tpp, floor, tpp_floor, decides=measured.speedup is None)
    below = bool(flags)
    flags += [f"the acceptance guard acted ({e.action}): {e.message}" for e in events]
    if measured.speedup is not None:
        cost, unknown = measured.speedup < 1, None
        flags += [measured.flag] if measured.flag else []
    else:
        cost, unknown = (True, None) if below else (None, measured.detail)
    if mal is None and totals.units:
        flags.append("speculation was on but nothing was drafted (a depth schedule with k=0 at the job's concurrency?)")
    return SpeculationVerdict(
        floor=floor,
        mean_acceptance_length=mal,
        tokens_per_target_floor=tpp_floor,
        tokens_per_target_pass=tpp,
        below_floor=below,
        cost_more_than_saved=cost,
        cost_unknown_because=unknown,
        flags=flags,
        source=measured.source,
        source_detail=measured.detail,
        calibration_uri=measured.uri,
    )


def _floors(config: JobConfig) -> tuple[float, Optional[float]]:
    """The mean acceptance length and tokens per target pass a job is held to: the guard's, else the probe's."""
    spec = config.speculative
    guard, probe = spec.guard, spec.probe
    floor = (
        guard.min_mean_acceptance_length
        if guard and guard.min_mean_acceptance_length
        else probe.min_mean_acceptance_length
    )
    tpp_floor = (
        guard.min_tokens_per_target_pass
        if guard and guard.min_tokens_per_target_pass
        else probe.min_tokens_per_target_pass
    )
    return floor, tpp_floor


def _below_floors(
    mal: Optional[float], tpp: Optional[float], floor: float, tpp_floor: float, decides: bool
) -> list[str]:
    """The flag of the first floor the units that speculated are below; it says speculation cost
    more than it saved only when it `decides` that (nothing measured speculation against off)."""
    cost = ": speculation cost more than it saved" if decides else ""
    if mal is not None and mal < floor:
        return [
            f"mean acceptance length {mal:.2f} over the units that speculated is below the floor {floor}{cost} "
            "(a drafter trained for another base model looks like this)"
        ]
    if mal is not None and tpp is not None and tpp < tpp_floor:
        return [
            f"{tpp:.2f} tokens per target pass over the units that speculated, below the floor {tpp_floor}, while "
            f"vLLM's mean acceptance length reads {mal:.2f}{cost} (a grammar that cuts the drafts looks like this: "
            "vLLM's counters leave the cut drafts out)"
        ]
    return []


class Measured:
    """What measured speculation against off: its `source`, the speed over off's (None: not
    measured), the flag it raises and `detail`, which names it or says why there is none."""

    def __init__(
        self,
        source: str,
        detail: str,
        speedup: Optional[float] = None,
        flag: Optional[str] = None,
        uri: Optional[str] = None,
    ):
        self.source, self.detail, self.speedup, self.flag, self.uri = source, detail, speedup, flag, uri


def _measured(config: JobConfig, calibration: Optional[JobCalibration], trial: Optional[TrialVerdict]) -> Measured:
    if trial is not None and trial.speedup_vs_off is not None:
        if trial.speedup_vs_off < 1:
            slower = f"the speculation trial measured it slower than off: it cost more than it saved ({trial.reason})"
            return Measured("trial", trial.reason, trial.speedup_vs_off, slower)
        return Measured(
            "trial", trial.reason, trial.speedup_vs_off, trial.reason if trial.outcome == "turned-off" else None
        )
    no_trial = trial.reason if trial is not None else "the job ran no speculation trial"
    how = (
        "`specbatch calibrate` on this job's config measures one for every later job of these models and settings, "
        "or `specbatch pilot`"
    )
    if calibration is None or calibration.report is None:
        where = calibration.where if calibration is not None else "no calibration was looked for"
        return Measured("none", f"{no_trial}; {where}: {how}")
    report = calibration.report
    top = max(report.concurrencies)
    depth = depth_at(config, top)
    row = next((r for r in report.rows if r.concurrency == top and r.depth == depth), None)
    if row is None or row.speedup_vs_off is None:
        return Measured(
            "none",
            f"{no_trial}; {calibration.where} did not measure depth {depth} at {top} sequences against off: {how}",
        )
    detail = (
        f"{calibration.where} measured depth {depth} at {top} sequences at once at {row.speedup_vs_off:.2f}x "
        "the speed of speculation off"
    )
    flag = f"{detail}: it cost more than it saved (apply the calibrated depth: speculative.depth_from: calibration)"
    return Measured(
        "calibration", detail, row.speedup_vs_off, flag if row.speedup_vs_off < 1 else None, calibration.uri
    )


def verdict_text(verdict: SpeculationVerdict) -> str:
    """The verdict in one sentence, with what it rests on: the console's summary, `specbatch
    status` and the report say it in these words."""
    if verdict.cost_more_than_saved is None:
        return f"whether speculation paid is not known: {verdict.cost_unknown_because or verdict.source_detail}"
    said = "cost more than it saved" if verdict.cost_more_than_saved else "paid"
    if verdict.source in ("trial", "calibration"):
        by = "this job's trial" if verdict.source == "trial" else "a calibration"
        return f"speculation {said}, by {by}: {verdict.source_detail}"
    return (
        f"speculation {said}: "
        f"{verdict.flags[0] if verdict.flags else 'acceptance above the floors, nothing measured it against off'}"
    )
