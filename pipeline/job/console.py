"""What a run prints on the console: `[specbatch]` lines while it runs, a progress line per
committed unit, and a readable summary at the end (the figures themselves are in `_job.json`).

Speeds say what they count: `engine` is generated tokens per second of engine time (while an
engine generated), `wall` per second of the attempt's wall time, which starts when generation
begins (engine start included) and is the wall time of the summary and of `_job.json`. The
ETA runs from the rows committed per second over the last window of units (`Pace`), never from
the start-up, and waits for a whole window.
"""

from __future__ import annotations

import sys
from collections import deque
from itertools import islice
from typing import Optional

from pipeline.speculation.policy import verdict_text
from schemas import JobManifest, StartCost

# A steady pace needs commits this far apart: units that finish together say nothing of it.
STEADY_MIN_SECONDS = 1.0


def say(progress: bool, message: str) -> None:
    """The message on the console when the run shows its progress."""
    if progress:
        print_line(message)


def print_line(message: str) -> None:
    print(f"[specbatch] {message}", file=sys.stderr, flush=True)


class Pace:
    """Rows committed per second of generation over the last `window` committed units: the
    ETA's rate. Commits come in bursts (an engine's units in flight end close together), so a
    rate needs a window of one unit per engine slot (replicas x units_in_flight), which spans
    about a unit's time on every slot whatever the bursts; until that many units have committed
    after the first, there is none. Its time is the part of the window's span that some unit of
    the window spent in an engine: a pause in which no engine held a unit (the speculation trial
    restarting its engine, an engine replaced) would otherwise weigh on the rate for a whole
    window, and the ETA assumes the engines keep generating as they did."""

    def __init__(self, window: int):
        self.window = max(1, window)
        self.units: deque[tuple[float, int, float, float]] = deque(
            maxlen=self.window + 1
        )  # (committed, rows, in engine from, to)
        self.units_taken = 0

    def add(self, committed_at: float, rows: int, engine_from: float, engine_to: float) -> None:
        self.units.append((committed_at, rows, engine_from, engine_to))

    def take(self, unit_stats: dict[str, dict]) -> None:
        """The units of `unit_stats` (stats rows by unit, in the order first heard) added since the last call."""
        new, self.units_taken = len(unit_stats) - self.units_taken, len(unit_stats)
        for row in reversed(list(islice(reversed(unit_stats.values()), min(new, self.window + 1)))):
            start = row["started_at"]
            self.add(
                start + max(row["wall_seconds"], row["engine_seconds"]),
                row["rows"],
                start,
                start + row["engine_seconds"],
            )

    def units_to_go(self) -> int:
        """Units still to commit before there is a pace."""
        return self.window + 1 - len(self.units)

    def _span(self) -> tuple[int, float]:
        """(rows, seconds of generation) of the window: rows of the units after the first, over
        the union of their engine time within their span of commits."""
        since, *_ = min(self.units)
        later = sorted(self.units)[1:]
        until = later[-1][0]
        seconds, reached = 0.0, since
        for begin, end in sorted((u[2], min(u[3], until)) for u in later):
            begin = max(begin, reached)
            if end > begin:
                seconds, reached = seconds + end - begin, end
        return sum(u[1] for u in later), seconds

    def rows_per_second(self) -> Optional[float]:
        if self.units_to_go() > 0:
            return None
        rows, seconds = self._span()
        return rows / seconds if seconds >= STEADY_MIN_SECONDS and rows else None

    def seconds_per_unit(self) -> Optional[float]:
        """Seconds of generation per committed unit over the window: how often a unit commits now."""
        if self.units_to_go() > 0:
            return None
        return self._span()[1] / self.window

    def eta(self, rows_left: int) -> Optional[float]:
        if rows_left <= 0:
            return 0.0
        rate = self.rows_per_second()
        return rows_left / rate if rate else None

    def eta_text(self, rows_left: int, units_left: int) -> str:
        eta = self.eta(rows_left)
        if eta is not None:
            return f"ETA {eta:,.0f}s"
        to_go = max(1, self.units_to_go())
        if units_left < to_go:  # fewer than a window: every unit left is in an engine slot already
            return (
                "no ETA: the last unit is running"
                if units_left == 1
                else f"no ETA: the last {units_left} units are running"
            )
        return "ETA after the next unit" if to_go == 1 else f"ETA after {to_go} more units"


def commit_window(replicas: int, units_in_flight: int) -> int:
    """The units a pace is measured over: one in every slot of every engine."""
    return max(1, replicas) * max(1, units_in_flight)


def progress_line(
    done: int, total: int, engine_rate: float, wall_rate: float, acceptance: Optional[float], eta_text: str
) -> str:
    accepting = f", acceptance {acceptance:.2f}" if acceptance is not None else ""
    share = f"{done / total:.0%}" if total else "-"
    return (
        f"{done:,}/{total:,} rows ({share}), {engine_rate:,.0f} tok/s engine, {wall_rate:,.0f} tok/s wall"
        f"{accepting}, {eta_text}"
    )


def print_progress(line: str, finished: bool) -> None:
    """One line per committed unit; on a terminal the line is rewritten in place."""
    if sys.stderr.isatty():
        print(f"\r[specbatch] {line}", end="\n" if finished else "", file=sys.stderr, flush=True)
    else:
        print(f"[specbatch] {line}", file=sys.stderr, flush=True)


def summary(manifest: JobManifest) -> list[str]:
    """The job's end, as lines a person reads."""
    t, attempt = manifest.totals, manifest.attempts[-1] if manifest.attempts else None
    lines = [f"job {manifest.job_id} {manifest.status}"]
    lines.append(
        f"  rows      {t.output_rows + t.error_rows:,} of {t.input_rows:,} done: {t.output_rows:,} generated, "
        f"{t.error_rows:,} failed"
    )
    prefill = f" ({prefill_text(t.prompt_tokens, t.cached_prompt_tokens)})" if t.prompt_tokens else ""
    lines.append(
        f"  tokens    {t.generated_tokens:,} generated from {t.prompt_tokens:,} prompt tokens{prefill}, in {t.units:,} "
        "units"
    )
    if t.generated_tokens:
        share = (
            f"; engines busy {t.engine_busy_share:.0%} of the billed time" if t.engine_busy_share is not None else ""
        )
        attempts = f" in {len(manifest.attempts)} attempts" if len(manifest.attempts) > 1 else ""
        lines.append(
            f"  speed     {t.engine_tokens_per_second:,.0f} tok/s of engine time, {t.tokens_per_second:,.0f} tok/s of "
            f"wall time ({t.wall_seconds:,.1f} s of generation{attempts}){share}"
        )
    if attempt and attempt.added and attempt.number > 1:
        a = attempt.added
        lines.append(
            f"  this run  added {a.rows:,} rows ({a.output_rows:,} generated, {a.error_rows:,} failed) in {a.units:,} "
            f"units, {a.generated_tokens:,} tokens generated from {a.prompt_tokens:,} prompt tokens; "
            f"{a.new_input_files:,} new input file{'s' if a.new_input_files != 1 else ''}"
        )
    start = attempt.start if attempt else None
    if start and start.to_first_commit_seconds is not None:
        lines.append(f"  start     {start_line(start)}")
    if t.mean_acceptance_length is not None:
        per_pass = f", {t.tokens_per_target_pass:.2f} tokens per target pass" if t.tokens_per_target_pass else ""
        lines.append(
            f"  drafts    acceptance rate {t.acceptance_rate:.3f}, mean acceptance length "
            f"{t.mean_acceptance_length:.2f}{per_pass}"
        )
    if manifest.probe:
        p = manifest.probe
        measured = f"{p.mean_acceptance_length:.2f}" if p.mean_acceptance_length is not None else "none"
        lines.append(
            f"  probe     {'passed' if p.passed else 'refused'}: mean acceptance length {measured} on {p.rows} rows "
            f"(floor {p.floor})"
        )
    if manifest.speculation:
        lines.append(f"  verdict   {verdict_text(manifest.speculation)}")
    return lines


def prefill_text(prompt_tokens: int, cached_prompt_tokens: int) -> str:
    """The prompt tokens vLLM's prefix cache served and those the engines computed in prefill,
    e.g. "1,200 from the prefix cache, 40%; 1,800 computed"."""
    return (
        f"{cached_prompt_tokens:,} from the prefix cache, {cached_prompt_tokens / prompt_tokens:.0%}; "
        f"{prompt_tokens - cached_prompt_tokens:,} computed"
    )


def start_line(start: StartCost) -> str:
    """The first commit on the one time line of the summary: the wall time counts from the
    start of generation, the start-up phases from the driver's process start."""
    first = start.to_first_commit_seconds
    began = start.generation_started_s
    when = (
        f"first unit committed {first - began:.1f} s into generation ({first:.1f} s after the process started, "
        f"generation at {began:.1f} s)"
        if began is not None
        else f"first unit committed {first:.1f} s after the process started"
    )
    starts = len(start.engine_starts)
    longest = max(start.phases, key=lambda p: p.seconds, default=None)
    most = f"; longest phase: {longest.name} {longest.seconds:.1f} s" if longest else ""
    return f"{when}; {starts} engine start{'s' if starts != 1 else ''}{most}"
