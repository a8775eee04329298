"""What a run prints on the console: `[specbatch]` lines while it runs, a progress line per
committed unit, and a readable summary at the end (the figures themselves are in `_job.json`).

Speeds say what they count: `engine` is generated tokens per second of engine time (while an
engine generated), `wall` per second of the attempt's wall time, engine start included. The
ETA runs from the steady rate since the first committed unit, never from the start-up.
"""

from __future__ import annotations

import sys
from typing import Optional

from schemas import JobManifest

# A steady pace needs commits this far apart: units that finish together say nothing of it.
STEADY_MIN_SECONDS = 1.0


def say(progress: bool, message: str) -> None:
    if progress:
        print(f"[specbatch] {message}", file=sys.stderr, flush=True)


def progress_line(done: int, total: int, engine_rate: float, wall_rate: float, acceptance: Optional[float],
                  eta: Optional[float]) -> str:
    accepting = f", acceptance {acceptance:.2f}" if acceptance is not None else ""
    eta_text = f"ETA {eta:,.0f}s" if eta is not None else "ETA after the next unit"
    share = f"{done / total:.0%}" if total else "-"
    return (f"{done:,}/{total:,} rows ({share}), {engine_rate:,.0f} tok/s engine, {wall_rate:,.0f} tok/s wall"
            f"{accepting}, {eta_text}")


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
    lines.append(f"  rows      {t.output_rows + t.error_rows:,} of {t.input_rows:,} done: {t.output_rows:,} generated, "
                 f"{t.error_rows:,} failed")
    lines.append(f"  tokens    {t.generated_tokens:,} generated from {t.prompt_tokens:,} prompt tokens, in {t.units:,} units")
    if t.generated_tokens:
        share = f"; engines busy {t.engine_busy_share:.0%} of the billed time" if t.engine_busy_share is not None else ""
        lines.append(f"  speed     {t.engine_tokens_per_second:,.0f} tok/s of engine time, {t.tokens_per_second:,.0f} tok/s of "
                     f"wall time ({t.wall_seconds:,.1f} s){share}")
    start = attempt.start if attempt else None
    if start and start.to_first_commit_seconds is not None:
        longest = max(start.phases, key=lambda p: p.seconds, default=None)
        most = f"; longest phase: {longest.name} {longest.seconds:.1f} s" if longest else ""
        starts = len(start.engine_starts)
        lines.append(f"  start     first unit committed at {start.to_first_commit_seconds:.1f} s; {starts} engine "
                     f"start{'s' if starts != 1 else ''}{most}")
    if t.mean_acceptance_length is not None:
        per_pass = f", {t.tokens_per_target_pass:.2f} tokens per target pass" if t.tokens_per_target_pass else ""
        lines.append(f"  drafts    acceptance rate {t.acceptance_rate:.3f}, mean acceptance length {t.mean_acceptance_length:.2f}"
                     f"{per_pass}")
    if manifest.probe:
        p = manifest.probe
        measured = f"{p.mean_acceptance_length:.2f}" if p.mean_acceptance_length is not None else "none"
        lines.append(f"  probe     {'passed' if p.passed else 'refused'}: mean acceptance length {measured} on {p.rows} rows "
                     f"(floor {p.floor})")
    return lines
