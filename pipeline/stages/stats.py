"""Acceptance statistics from vLLM's per-request speculative-decoding metrics.

vLLM reports, per finished request, a histogram over verify steps of how many draft tokens
were accepted (index j = j tokens accepted). Acceptance is a prefix, so draft position i
(0-based) was accepted in every step that accepted more than i tokens.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import JobConfig
from schemas import JobTotals


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

    def tokens_per_target_pass(self, generated: int, completions: int) -> Optional[float]:
        """Generated tokens per target decode pass: what speculation saved, counting every step.
        A decode pass yields its accepted drafts plus one token, and a completion's first token
        comes from its prefill, so passes = generated - accepted - completions; vLLM counts drafts
        accepted past max_tokens as accepted, so that count is a floor, and so is `num_drafts`
        (each drafting step is a pass): the larger one is taken. vLLM's acceptance counters leave
        out the draft tokens a grammar cut and the steps it cut to nothing; this does not. Null
        without a decode pass."""
        passes = max(generated - self.accepted_tokens - completions, self.num_drafts)
        return (generated - completions) / passes if passes > 0 else None

    def summary(self) -> dict:
        """The acceptance fields that batch stats, job totals, reports and calibration share."""
        return dict(
            num_drafts=self.num_drafts,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
        )


class EngineBusyTime:
    """Engine-busy seconds summed over engines, kept as units are heard: units overlap inside
    one engine, so each engine's time is the union of its [started_at, started_at +
    engine_seconds] intervals. Each engine's merged spans stay sorted, so adding a unit costs a
    binary search and the spans it joins, not a new union over every unit heard (a progress
    line per unit of a 100k-unit job)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._starts: dict[str, list[float]] = defaultdict(list)
        self._ends: dict[str, list[float]] = defaultdict(list)

    def add(self, actor: str, start: float, seconds: float) -> None:
        starts, ends, end = self._starts[actor], self._ends[actor], start + seconds
        first = bisect.bisect_left(ends, start)  # the first span that ends at or after this one starts
        last = bisect.bisect_right(starts, end)  # spans from `first` up to here overlap or touch it
        if first < last:
            start, end = min(start, starts[first]), max(end, ends[last - 1])
            self.seconds -= sum(e - s for s, e in zip(starts[first:last], ends[first:last]))
        starts[first:last], ends[first:last] = [start], [end]
        self.seconds += end - start


def busy_seconds(intervals: Iterable[tuple[str, float, float]]) -> float:
    """Engine-busy seconds of (actor_id, started_at, engine_seconds) units (EngineBusyTime)."""
    busy = EngineBusyTime()
    for actor, start, seconds in intervals:
        busy.add(actor, start, seconds)
    return busy.seconds


def speculated(speculative: Optional[bool], num_drafts: int, depth_schedule: Optional[str]) -> bool:
    """Did a unit (its stats row's fields) speculate? Its engine had the drafter: `speculative`
    is false in the trial's off arm and after the trial or the guard turned speculation off, where
    every target pass yields one token by definition. Under a depth schedule it must also have
    drafted (else it ran at k=0); at a fixed depth a unit without drafts counts: a grammar cut them all."""
    return bool(speculative) and ((num_drafts or 0) > 0 or not depth_schedule)


def speculated_units(stats: pa.Table) -> pa.Table:
    """The rows of the units that speculated (`speculated`); a column an older file lacks is null."""
    columns = [
        stats.column(c).to_pylist() if c in stats.column_names else [None] * stats.num_rows
        for c in ("speculative", "num_drafts", "depth_schedule")
    ]
    return stats.filter(pa.array([speculated(*unit) for unit in zip(*columns)], type=pa.bool_()))


def prefix_cache_hit_rate(cached: int, prompt: int) -> Optional[float]:
    """Share of prompt tokens vLLM served from its prefix cache; None without prompt tokens."""
    return cached / prompt if prompt else None


def _position_sums(stats: pa.Table) -> list[int]:
    """accepted_per_position summed position by position, without a Python list per unit."""
    if not stats.num_rows or "accepted_per_position" not in stats.column_names:
        return []
    lists = stats.column("accepted_per_position").combine_chunks()
    counts = pc.list_flatten(lists).to_numpy(zero_copy_only=False)
    if not len(counts):
        return []
    parents = pc.list_parent_indices(lists).to_numpy()
    offsets = lists.offsets.to_numpy()
    positions = np.arange(len(counts)) - offsets[parents]
    return [int(n) for n in np.bincount(positions, weights=counts)]


def _sums(stats: pa.Table, names: Iterable[str]) -> dict[str, int]:
    return {name: int(pc.sum(stats.column(name)).as_py() or 0) if stats.num_rows else 0 for name in names}


# The stats columns the job's totals sum, over every unit and over the units that speculated.
SUMMED_COLUMNS = (
    "rows",
    "output_rows",
    "error_rows",
    "samples",
    "retryable_error_rows",
    "clipped_rows",
    "prompt_tokens",
    "cached_prompt_tokens",
    "generated_tokens",
)
DRAFTING_COLUMNS = ("samples", "generated_tokens", "num_drafts", "draft_tokens", "accepted_tokens")


def totals_from_stats(stats: pa.Table, input_rows: int, wall_seconds: float, replicas: int = 1) -> JobTotals:
    """Totals over every committed unit (one stats row each), summed column by column: a
    job of 100k units is not turned into 100k Python dicts. Acceptance and tokens per target
    pass are those of the units that speculated (`speculated`). `replicas`: the engines billed
    for `wall_seconds`, for the busy share."""
    total = _sums(stats, SUMMED_COLUMNS)
    speculating = speculated_units(stats)
    drafting = _sums(speculating, DRAFTING_COLUMNS)
    acceptance = Acceptance(
        drafting["num_drafts"], drafting["draft_tokens"], drafting["accepted_tokens"], _position_sums(speculating)
    )
    generated = total["generated_tokens"]
    timed = stats.num_rows and {"actor_id", "started_at", "engine_seconds"} <= set(stats.column_names)
    busy = (
        busy_seconds(zip(*(stats.column(c).to_pylist() for c in ("actor_id", "started_at", "engine_seconds"))))
        if timed
        else 0.0
    )
    return JobTotals(
        input_rows=input_rows,
        output_rows=total["output_rows"],
        error_rows=total["error_rows"],
        samples=total["samples"],
        retryable_error_rows=total["retryable_error_rows"],
        clipped_rows=total["clipped_rows"],
        units=stats.num_rows,
        prompt_tokens=total["prompt_tokens"],
        cached_prompt_tokens=total["cached_prompt_tokens"],
        prefix_cache_hit_rate=prefix_cache_hit_rate(total["cached_prompt_tokens"], total["prompt_tokens"]),
        generated_tokens=generated,
        **acceptance.summary(),
        accepted_per_position=acceptance.accepted_per_position,
        tokens_per_target_pass=acceptance.tokens_per_target_pass(drafting["generated_tokens"], drafting["samples"]),
        wall_seconds=wall_seconds,
        tokens_per_second=generated / wall_seconds if wall_seconds else 0.0,
        engine_busy_seconds=busy,
        engine_tokens_per_second=generated / busy if busy else 0.0,
        engine_busy_share=min(1.0, busy / (replicas * wall_seconds)) if busy and wall_seconds else None,
    )


def billed_replicas(config: JobConfig, stats: pa.Table) -> int:
    """Engines billed for the job's wall time: the pool's size, or for an autoscaling pool the
    engines that ran, between its minimum and maximum."""
    resources = config.resources
    if resources.min_replicas == resources.max_replicas or "actor_id" not in stats.column_names:
        return resources.max_replicas
    ran = len(set(stats.column("actor_id").to_pylist()))
    return max(resources.min_replicas, min(resources.max_replicas, ran))


def error_units(stats: pa.Table, retryable_only: bool) -> set[str]:
    """Units of a stats table with error rows (with `retryable_only`, retryable ones)."""
    column = "retryable_error_rows" if retryable_only else "error_rows"
    return {u for u, n in zip(stats.column("unit_id").to_pylist(), stats.column(column).to_pylist()) if n}
