"""What `specbatch status` says of a job's driver and its lease (`_lease.json`): whether the
driver is alive, gone or starting, the notes that name the command that resumes it, and the
report of a run that holds the lease before its first `_job.json`."""

from __future__ import annotations

from typing import Optional

from pipeline.commit.lease import heartbeat_age, is_stale
from pipeline.tools.status_progress import age, iso
from schemas import Attempt, JobManifest, Lease
from schemas.status import LeaseState, StatusReport


def driver_state(manifest: JobManifest, last: Optional[Attempt], lease: Optional[Lease], now: float) -> str:
    fresh = lease is not None and not is_stale(lease, now)
    if manifest.status == "running":
        return ("starting" if last and lease.attempt > last.number else "alive") if fresh else "gone"
    return "starting" if fresh else "none"


def lease_notes(
    manifest: JobManifest, last: Optional[Attempt], lease: Optional[Lease], driver: str, now: float, run_command: str
) -> list[str]:
    notes, lease_age = [], heartbeat_age(lease, now) if lease else None
    if manifest.status == "running" and driver == "gone":
        if lease is not None:
            notes.append(
                f"no heartbeat for {age(lease_age)}: the driver is probably gone; `{run_command}` takes over and "
                "resumes"
            )
        else:
            notes.append(
                f"_job.json says running but no run holds the lease: the driver is gone; resume with `{run_command}`"
            )
    elif driver == "starting":
        notes.append(
            f"a new attempt ({lease.attempt}) is starting: run {lease.owner} holds the lease, heartbeat "
            f"{age(lease_age)} ago"
        )
    elif lease is not None and is_stale(lease, now):
        notes.append(
            f"a stale lease of attempt {lease.attempt} is left (no heartbeat for {age(lease_age)}): its run died "
            f"without releasing it; the next `{run_command}` takes it over"
        )
    if manifest.status in ("failed", "interrupted") and last is not None and last.error:
        notes.append(
            f"attempt {last.number} {manifest.status}: {last.error.splitlines()[0][:300]}; `{run_command}` resumes it"
        )
    return notes


def lease_state(lease: Lease, now: float) -> LeaseState:
    return LeaseState(
        owner=lease.owner,
        attempt=lease.attempt,
        acquired_at=lease.acquired_at,
        heartbeat_at=lease.heartbeat_at,
        heartbeat_age_seconds=heartbeat_age(lease, now),
        stale_after_seconds=lease.stale_after_seconds,
        stale=is_stale(lease, now),
    )


def first_attempt_starting(uri: str, lease: Lease, now: float, run_command: str) -> StatusReport:
    """A run holds the location but has not written `_job.json` yet: it is checking its inputs
    and starting Ray (the manifest comes just before its engines start)."""
    beat = heartbeat_age(lease, now)
    fresh = not is_stale(lease, now)
    if fresh:
        note = (
            f"the first attempt of job {lease.job_id} is starting (input check, plan, Ray): run {lease.owner} holds "
            f"the lease, heartbeat {age(beat)} ago; no _job.json yet, so no counts yet"
        )
    else:
        note = (
            f"a stale lease of job {lease.job_id} is left (no heartbeat for {age(beat)}) and no _job.json: its run "
            f"died before it wrote one; the next `{run_command}` takes it over"
        )
    return StatusReport(
        output_uri=uri,
        checked_at=iso(now),
        job_id=lease.job_id,
        status="running",
        driver="starting" if fresh else "gone",
        attempts=0,
        lease=lease_state(lease, now),
        counts_from="manifest",
        input_rows=0,
        rows_done=0,
        output_rows=0,
        error_rows=0,
        retryable_error_rows=0,
        units_planned=0,
        units_committed=0,
        errors_by_kind={},
        error_units=0,
        error_units_read=0,
        errors_by_kind_complete=True,
        generated_tokens=0,
        tokens_per_second=0.0,
        acceptance_rate=None,
        mean_acceptance_length=None,
        notes=[note],
    )
