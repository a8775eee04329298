"""Acceptance statistics from vLLM's per-request speculative-decoding metrics.

vLLM reports, per finished request, a histogram over verify steps of how many draft tokens
were accepted (index j = j tokens accepted). Acceptance is a prefix, so draft position i
(0-based) was accepted in every step that accepted more than i tokens.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass
class Acceptance:
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def from_request(cls, metrics) -> "Acceptance":
        """From `CompletionOutput.spec_decode_metrics` (None without speculation)."""
        if metrics is None:
            return cls()
        histogram = list(metrics.histogram)
        return cls(
            num_drafts=sum(histogram),
            draft_tokens=metrics.num_draft_tokens,
            accepted_tokens=sum(j * n for j, n in enumerate(histogram)),
            accepted_per_position=[sum(histogram[i + 1 :]) for i in range(len(histogram) - 1)],
        )

    def __add__(self, other: "Acceptance") -> "Acceptance":
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda v: v + [0] * (width - len(v))  # noqa: E731
        return Acceptance(
            self.num_drafts + other.num_drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
            [a + b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))],
        )

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def rate_per_position(self) -> list[float]:
        """Share of drafts whose i-th token was accepted."""
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else None

    def summary(self) -> dict:
        """The acceptance fields that batch stats, job totals, reports and calibration share."""
        return dict(
            num_drafts=self.num_drafts,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
        )


def busy_seconds(intervals: Iterable[tuple[str, float, float]]) -> float:
    """Engine-busy seconds summed over engines, from (actor_id, started_at, engine_seconds) of
    each unit. Units overlap inside one engine, so each engine's time is the union of its
    [started_at, started_at + engine_seconds] intervals."""
    by_actor: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for actor, start, seconds in intervals:
        by_actor[actor].append((start, start + seconds))
    total = 0.0
    for spans in by_actor.values():
        spans.sort()
        start, end = spans[0]
        for s, e in spans[1:]:
            if s > end:
                total += end - start
                start, end = s, e
            else:
                end = max(end, e)
        total += end - start
    return total
