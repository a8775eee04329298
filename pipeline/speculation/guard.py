"""The acceptance guard: a floor on acceptance while the job runs (`speculative.guard`).

The driver feeds it every unit-stats row as units commit. It keeps the last
`window_units` units that drafted (units without drafts say nothing about the drafter)
and, once the window is full, pools them (vLLM's acceptance by their draft tokens, tokens per
target pass by their tokens) and compares against the floors. Tokens per target pass counts
what a grammar cut from the drafts, which vLLM's acceptance counters leave out. It fires once
when the window falls below a floor, and again only after a full window has been back above it:
a drafter that stays poor gives one event, not one per unit.

Whether speculation paid is the speculation policy's (pipeline/speculation/policy.py), which
reads the guard's events.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from pipeline.config import GuardConfig
from pipeline.stages.stats import Acceptance
from schemas import GuardEvent, utc_timestamp


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
