"""`specbatch status` for a terminal: its report (schemas.StatusReport) as lines of text, the
same figures as `--json`."""

from __future__ import annotations

from pipeline.job.console import prefill_text
from pipeline.tools.status_progress import age
from schemas.status import StatusReport


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min"


def render(report: StatusReport) -> str:
    """The report for a terminal: the same figures as --json."""
    r = report
    lines = _state_lines(r)
    if r.attempts == 0:  # no _job.json yet: nothing to count
        return "\n".join([*lines, *(f"note: {note}" for note in r.notes)])
    lines += _count_lines(r) + _speed_lines(r)
    lines += [f"{'WARNING' if i == 0 and r.driver == 'gone' else 'note'}: {note}" for i, note in enumerate(r.notes)]
    lines += [f"WARNING: {warning}" for warning in r.warnings]
    return "\n".join(lines)


def _state_lines(r: StatusReport) -> list[str]:
    driver = {
        "alive": "its driver is alive",
        "gone": "its driver is GONE",
        "starting": "a new attempt is starting",
        "none": "no run holds it",
    }[r.driver]
    lines = [f"job {r.job_id} at {r.output_uri}: {r.status} ({driver})"]
    if r.last_attempt:
        a = r.last_attempt
        ended = f", ended {a.ended_at}" if a.ended_at else ""
        error = f": {a.error.splitlines()[0][:200]}" if a.error else ""
        lines.append(
            f"  attempts:  {r.attempts}; the last, {a.number}: started {a.started_at}{ended}, {a.status}{error}"
        )
    if r.lease:
        lease = r.lease
        state = "STALE" if lease.stale else "fresh"
        lines.append(
            f"  lease:     {lease.owner} (attempt {lease.attempt}), heartbeat {age(lease.heartbeat_age_seconds)} ago, "
            f"{state} (stale after {lease.stale_after_seconds:.0f} s)"
        )
    else:
        lines.append("  lease:     none")
    return lines


def _count_lines(r: StatusReport) -> list[str]:
    share = f" ({r.rows_done / r.input_rows:.0%})" if r.input_rows else ""
    unread = f", {r.rows_done - r.output_rows - r.error_rows:,} in units not read yet" if r.units_unread else ""
    lines = [
        f"  rows:      {r.rows_done:,} of {r.input_rows:,} done{share}: {r.output_rows:,} generated, "
        f"{r.error_rows:,} errors"
        + (f" ({r.retryable_error_rows:,} retryable)" if r.retryable_error_rows else "")
        + unread,
        f"  units:     {r.units_committed:,} of {r.units_planned:,} committed" + _commit_clause(r),
    ]
    if r.error_rows:
        kinds = ", ".join(f"{kind} {n:,}" for kind, n in r.errors_by_kind.items()) or "none read"
        partial = (
            ""
            if r.errors_by_kind_complete
            else f" (from {r.error_units_read:,} of {r.error_units:,} units with errors)"
        )
        lines.append(f"  errors:    {kinds}{partial}")
    return lines


def _commit_clause(r: StatusReport) -> str:
    """A running job's commits: how many this attempt, and the last one's age."""
    if r.counts_from != "commits":
        return ""
    ours = f" ({r.attempt_units_committed:,} by attempt {r.last_attempt.number})" if r.last_attempt else ""
    if r.last_commit_age_seconds is None:
        return f"{ours}; none yet"
    return f"{ours}; the last {age(r.last_commit_age_seconds)} ago, at {r.last_commit_at}"


def _speed_lines(r: StatusReport) -> list[str]:
    lines = []
    if r.acceptance_rate is not None:
        lines.append(
            f"  acceptance: rate {r.acceptance_rate:.3f}, mean acceptance length {r.mean_acceptance_length:.2f}"
        )
    else:
        lines.append("  acceptance: none (no drafts)")
    if r.speculation_trial:
        lines.append(f"  trial:     {r.speculation_trial}")
    if r.speculation_verdict:
        lines.append(f"  verdict:   {r.speculation_verdict}")
    lines.append(f"  generated: {r.generated_tokens:,} tokens, {r.tokens_per_second:,.1f} tok/s of wall time")
    if r.prompt_tokens:
        lines.append(
            f"  prefill:   {r.prompt_tokens:,} prompt tokens ({prefill_text(r.prompt_tokens, r.cached_prompt_tokens)})"
        )
    if r.engine_tokens_per_second:
        busy = f", engines busy {r.engine_busy_share:.0%} of the billed time" if r.engine_busy_share is not None else ""
        lines.append(f"  engines:   {r.engine_tokens_per_second:,.1f} tok/s of engine time{busy}")
    if r.eta_seconds is not None:
        when = f" (about {r.eta_at})" if r.eta_at else " once resumed"
        lines.append(
            f"  ETA:       {_duration(r.eta_seconds)}{when}, at {r.rows_per_second:,.1f} rows/s over the last "
            f"{r.pace_units:,} units committed"
        )
    elif r.units_before_pace and r.units_planned - r.units_committed < r.units_before_pace:
        left = r.units_planned - r.units_committed
        running = "the last unit is running" if left == 1 else f"the last {left:,} units are running"
        lines.append(
            f"  ETA:       none: {running} (the pace is measured over {r.pace_units:,} units, one per engine slot)"
        )
    elif r.units_before_pace:
        more = "the next unit commits" if r.units_before_pace == 1 else f"{r.units_before_pace:,} more units commit"
        lines.append(
            f"  ETA:       after {more} (the pace is measured over {r.pace_units:,} units, one per engine slot)"
        )
    return lines
