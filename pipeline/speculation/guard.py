"""The acceptance guard: a floor on acceptance while the job runs (`speculative.guard`).

The driver feeds it every unit-stats row as units commit. It keeps the last
`window_units` units that drafted (units without drafts say nothing about the drafter)
and, once the window is full, pools them (vLLM's acceptance by their draft tokens, tokens per
target pass by their tokens) and compares against the floors. Tokens per target pass counts
what a grammar cut from the drafts, which vLLM's acceptance counters leave out. It fires once when the window falls below a floor, and again only after a full
window has been back above it: a drafter that stays poor gives one event, not one per unit.

At the end of every attempt `speculation_verdict` judges the job over the units that speculated.
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from typing import Optional

from pipeline.config import GuardConfig, JobConfig
from pipeline.stages.stats import Acceptance
from schemas import GuardEvent, JobTotals, SpeculationVerdict, TrialVerdict
from schemas.report import CalibrationReport


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
        acceptance = Acceptance(row["num_drafts"], row["draft_tokens"], row["accepted_tokens"], row["accepted_per_position"])
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
            time=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            attempt=self.attempt,
            action=action,
            metric=metric,
            value=value,
            floor=floor,
            unit_ids=[unit_id for unit_id, _, _ in self.window],
            message=message,
        )


def depth_at(config: JobConfig, concurrency: int) -> int:
    """The depth the job drafts at with `concurrency` sequences running."""
    spec = config.speculative
    for lo, hi, k in spec.depth_schedule or []:
        if lo <= concurrency <= hi:
            return k
    return spec.num_speculative_tokens


def speculation_verdict(
    config: JobConfig, totals: JobTotals, events: list[GuardEvent], calibration: Optional[CalibrationReport] = None,
    trial: Optional[TrialVerdict] = None,
) -> Optional[SpeculationVerdict]:
    """Did speculation pay over the committed units? None when the job did not speculate. Its
    figures are those of the units that speculated (JobTotals: not the trial's off arm, nor the
    units after the trial or the guard turned speculation off, which yield one token per pass by
    definition). What measured speculation against off decides whether it cost more than it
    saved: the job's own trial, else a calibration of the job (OUTPUT_URI/calibration) at its
    steady concurrency (the highest measured); only without either does a figure below a floor
    decide it. Each reason is a flag of its own."""
    spec = config.speculative
    if not spec.enabled:
        return None
    guard = spec.guard
    floor = guard.min_mean_acceptance_length if guard and guard.min_mean_acceptance_length else spec.probe.min_mean_acceptance_length
    tpp_floor = guard.min_tokens_per_target_pass if guard and guard.min_tokens_per_target_pass else spec.probe.min_tokens_per_target_pass
    mal, tpp = totals.mean_acceptance_length, totals.tokens_per_target_pass
    measured = _measured(config, calibration, trial)
    flags = _below_floors(mal, tpp, floor, tpp_floor, decides=measured is None)
    below = bool(flags)
    flags += [f"the acceptance guard acted ({e.action}): {e.message}" for e in events]
    if measured:
        (speedup, reason), unknown = measured, None
        cost = speedup < 1
        flags += [reason] if reason else []
    else:
        cost, unknown = (True, None) if below else (None, _unknown_because(trial))
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
    )


def _below_floors(mal: Optional[float], tpp: Optional[float], floor: float, tpp_floor: float, decides: bool) -> list[str]:
    """The flag of the first floor the units that speculated are below; it says speculation cost
    more than it saved only when it `decides` that (nothing measured speculation against off)."""
    cost = ": speculation cost more than it saved" if decides else ""
    if mal is not None and mal < floor:
        return [f"mean acceptance length {mal:.2f} over the units that speculated is below the floor {floor}{cost} "
                "(a drafter trained for another base model looks like this)"]
    if mal is not None and tpp is not None and tpp < tpp_floor:
        return [f"{tpp:.2f} tokens per target pass over the units that speculated, below the floor {tpp_floor}, while "
                f"vLLM's mean acceptance length reads {mal:.2f}{cost} (a grammar that cuts the drafts looks like this: "
                "vLLM's counters leave the cut drafts out)"]
    return []


def _measured(config: JobConfig, calibration: Optional[CalibrationReport],
              trial: Optional[TrialVerdict]) -> Optional[tuple[float, Optional[str]]]:
    """What measured speculation against off, as (its speed over off's, the flag it raises or
    None): the job's own trial, else a calibration at the job's steady concurrency."""
    if trial is not None and trial.speedup_vs_off is not None:
        if trial.speedup_vs_off < 1:
            slower = f"the speculation trial measured it slower than off: it cost more than it saved ({trial.reason})"
            return trial.speedup_vs_off, slower
        return trial.speedup_vs_off, trial.reason if trial.outcome == "turned-off" else None
    if not calibration:
        return None
    top = max(calibration.concurrencies)
    depth = depth_at(config, top)
    row = next((r for r in calibration.rows if r.concurrency == top and r.depth == depth), None)
    if row is None or row.speedup_vs_off is None:
        return None
    flag = (f"the job's calibration measured depth {depth} at {top} sequences at once at {row.speedup_vs_off:.2f}x "
            "the speed of speculation off: it cost more than it saved (apply the calibrated schedule)")
    return row.speedup_vs_off, flag if row.speedup_vs_off < 1 else None


def _unknown_because(trial: Optional[TrialVerdict]) -> str:
    why = trial.reason if trial is not None else "the job ran no speculation trial"
    return f"{why}; the output location has no calibration (specbatch calibrate measures one)"
