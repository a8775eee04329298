"""What `specbatch status` says of a running job's liveness: the last commit's age against the
pace, and what the running driver's `_progress.json` says of its engines.

The driver rewrites `_progress.json` (schemas.JobProgress) every `cluster.WATCH_SECONDS` while
it generates, with each engine replica's last report: the requests it holds and when its engine
last yielded output. An engine that holds requests and has yielded nothing for
ENGINE_QUIET_SECONDS is named (the engine itself is taken for hung, and replaced, only at
`retries.engine_stall_seconds`); a `_progress.json` older than PROGRESS_STALE_SECONDS while the
driver holds the lease means the driver is not generating, or is stuck.
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

from pydantic import ValidationError

from pipeline.cluster import WATCH_SECONDS
from pipeline.commit.outputs import OutputLocation
from pipeline.job.watch import REPORT_STALE_SECONDS
from schemas import JobManifest, JobProgress
from schemas.status import EngineWithoutProgress

ENGINE_QUIET_SECONDS = 60.0
PROGRESS_STALE_SECONDS = 6 * WATCH_SECONDS
# No commit for this many times the usual gap between commits (and at least a minute) is said.
OVERDUE_FACTOR = 4.0


def iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="seconds")


def age(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def read_progress(location: OutputLocation, attempt: int) -> Optional[JobProgress]:
    """The running attempt's `_progress.json` (one GET); None when absent, unreadable or an earlier attempt's."""
    try:
        found = location.read_progress()
        progress = JobProgress.model_validate(found) if found is not None else None
    except (ValueError, ValidationError):
        return None
    return progress if progress is not None and progress.attempt == attempt else None


def engines_without_progress(progress: JobProgress, now: float) -> list[EngineWithoutProgress]:
    found = []
    for replica in progress.replicas:
        quiet = now - (replica.last_output_at if replica.last_output_at is not None else progress.generating_since)
        if replica.requests_in_flight > 0 and quiet >= ENGINE_QUIET_SECONDS:
            found.append(
                EngineWithoutProgress(
                    actor_id=replica.actor_id,
                    node_id=replica.node_id,
                    requests_in_flight=replica.requests_in_flight,
                    seconds_without_output=quiet,
                    report_age_seconds=max(0.0, now - replica.reported_at),
                )
            )
    return found


def engine_warning(engine: EngineWithoutProgress, stall_limit: Optional[float]) -> str:
    where = f"engine replica {engine.actor_id[:8]} on node {engine.node_id[:8]}"
    if engine.report_age_seconds >= REPORT_STALE_SECONDS:
        said = (
            f"{where} has not reported for {age(engine.report_age_seconds)}; it then held {engine.requests_in_flight} "
            f"requests and had yielded no token since {age(engine.seconds_without_output)} ago"
        )
    else:
        said = (
            f"{where} holds {engine.requests_in_flight} requests and has yielded no token for "
            f"{age(engine.seconds_without_output)}"
        )
    if not stall_limit:
        return said
    if engine.seconds_without_output > stall_limit:
        return (
            f"{said}: past retries.engine_stall_seconds ({stall_limit:.0f} s), the least its actor waits before it "
            "replaces a hung engine (20 times the engine's slowest step, if longer); else the actor is stuck too"
        )
    return f"{said} (at retries.engine_stall_seconds, {stall_limit:.0f} s, it is taken for hung and replaced)"


def progress_warnings(
    location: OutputLocation, manifest: JobManifest, now: float
) -> tuple[list[EngineWithoutProgress], list[str], Optional[float]]:
    """For a running job whose driver holds the lease: (engines without progress, warnings, when
    `_progress.json` was written). A stale `_progress.json` says nothing of the engines."""
    progress = read_progress(location, manifest.attempts[-1].number if manifest.attempts else 0)
    if progress is None:
        return [], [], None
    stale = now - progress.written_at
    if stale >= PROGRESS_STALE_SECONDS:
        return (
            [],
            [
                f"the driver last wrote _progress.json {age(stale)} ago (it rewrites it every {WATCH_SECONDS:.0f} s "
                "while it generates): it is not generating now, or it is stuck; what its engines do is not known"
            ],
            progress.written_at,
        )
    engines = engines_without_progress(progress, now)
    stall_limit = (manifest.config.get("retries") or {}).get("engine_stall_seconds")
    return engines, [engine_warning(e, stall_limit) for e in engines], progress.written_at


def overdue_warning(last_commit_age: Optional[float], seconds_per_unit: Optional[float]) -> Optional[str]:
    """No commit for OVERDUE_FACTOR times the usual gap between the attempt's commits (and a minute)."""
    if last_commit_age is None or not seconds_per_unit:
        return None
    if last_commit_age < max(60.0, OVERDUE_FACTOR * seconds_per_unit):
        return None
    return (
        f"no unit has committed for {age(last_commit_age)}, {last_commit_age / seconds_per_unit:.0f} times the usual "
        f"{seconds_per_unit:.0f} s between this attempt's commits"
    )
