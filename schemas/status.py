"""Contract of what `specbatch status OUTPUT_URI --json` prints: where a job stands, read from
its output location alone (`_job.json`, `_lease.json`, `stats/`, and the error files of units
with error rows)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from schemas import Contract, JobStatus


class LeaseState(Contract):
    """_lease.json as status found it."""

    owner: str
    attempt: int
    acquired_at: str
    heartbeat_at: float = Field(description="Unix time of the last renewal.")
    heartbeat_age_seconds: float = Field(description="Seconds since the last renewal, when status looked.")
    stale_after_seconds: float
    stale: bool = Field(description="No heartbeat for stale_after_seconds: its run is dead; a run may take over.")


class AttemptState(Contract):
    """The job's last attempt, from _job.json."""

    number: int
    status: JobStatus
    started_at: str
    ended_at: Optional[str] = None
    error: Optional[str] = None


class StatusReport(Contract):
    """One job at one output location, when status looked."""

    output_uri: str
    checked_at: str = Field(description="UTC, ISO 8601: when status looked.")
    job_id: str
    status: JobStatus = Field(description="_job.json's status: `running` also when its driver is gone (see driver).")
    driver: Literal["alive", "gone", "starting", "none"] = Field(
        description=(
            "alive: running, its lease renewed; gone: _job.json says running but no fresh lease backs it (the driver "
            "was killed; resume with --take-over); starting: a fresh lease over a finished job, or over no _job.json "
            "yet (a new or first attempt is planning); none: finished, no run holds the location."
        )
    )
    attempts: int = Field(description="Attempts _job.json records; 0: a first attempt has not written it yet.")
    last_attempt: Optional[AttemptState] = None
    lease: Optional[LeaseState] = None
    counts_from: Literal["manifest", "stats"] = Field(
        description=(
            "manifest: _job.json's totals, exact as of the last attempt's end (nothing ran since); stats: the "
            "stats/ files of a running attempt, which its driver rewrites about every minute (as of stats_as_of)."
        )
    )
    stats_as_of: Optional[str] = Field(
        None, description="UTC, ISO 8601: the last commit the stats files hold (counts_from stats); null: none yet."
    )
    input_rows: int
    rows_done: int = Field(description="Input rows of committed units: generated or with a final error row.")
    output_rows: int = Field(description="Input rows generated.")
    error_rows: int
    retryable_error_rows: int = Field(description="Error rows a rerun generates again.")
    units_planned: int = Field(description="Work units of the input (the last attempt's plan).")
    units_committed: int
    errors_by_kind: dict[str, int] = Field(description="error_kind -> error rows, over the error files read.")
    error_units: int = Field(description="Committed units with error rows.")
    error_units_read: int = Field(description="Of those, units whose error file was read for errors_by_kind.")
    errors_by_kind_complete: bool = Field(description="Every error unit was read: errors_by_kind sums to error_rows.")
    speculation_trial: Optional[str] = Field(
        None, description="The speculation trial's verdict as the console printed it (_job.json trial.reason); null: none yet."
    )
    generated_tokens: int
    tokens_per_second: float = Field(description="Generated tokens / the attempts' wall time so far: wall-time speed.")
    engine_tokens_per_second: float = Field(
        0.0, description="Generated tokens / the engines' busy time: an engine's speed while it generates."
    )
    engine_busy_share: Optional[float] = Field(
        None, description="The engines' busy time / (replicas x wall time): the share of billed engine time spent generating."
    )
    acceptance_rate: Optional[float] = Field(description="accepted / draft tokens; null without drafts.")
    mean_acceptance_length: Optional[float] = Field(description="1 + accepted / drafts; null without drafts.")
    rows_per_second: Optional[float] = Field(
        None, description=(
            "Running: rows the last attempt committed per second since its first committed unit (its stats file): the "
            "steady pace, without the start-up; since the attempt started when its units so far committed within a "
            "second of each other (pace_since)."
        )
    )
    pace_since: Optional[Literal["first_commit", "attempt_start"]] = Field(
        None, description="Where rows_per_second counts from; null when there is no pace."
    )
    eta_seconds: Optional[float] = Field(
        None, description="Running: rows left / rows_per_second, from stats_as_of; null when not running or no pace yet."
    )
    eta_at: Optional[str] = Field(
        None, description="UTC, ISO 8601: stats_as_of + eta_seconds, while the driver is alive; null otherwise."
    )
    notes: list[str] = Field(
        default_factory=list, description="What a reader must know, one sentence each (a gone driver comes first)."
    )
