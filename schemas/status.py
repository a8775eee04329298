"""Contract of what `specbatch status OUTPUT_URI --json` prints: where a job stands, read from
its output location alone (`_job.json`, `_lease.json`, `stats/`, the error files of units with
error rows; while it runs, one listing of `_commits/` and `_progress.json`)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from schemas.contracts import Contract, JobStatus


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


class EngineWithoutProgress(Contract):
    """An engine replica that, as the running driver's `_progress.json` says, holds requests and
    has yielded nothing for a while."""

    actor_id: str
    node_id: str
    requests_in_flight: int
    seconds_without_output: float = Field(
        description=(
            "Since its last output (since the attempt's generation began, if it has yielded none), when status looked."
        )
    )
    report_age_seconds: float = Field(description="Since the replica last reported to the driver, when status looked.")


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
    counts_from: Literal["manifest", "commits"] = Field(
        description=(
            "manifest: _job.json's totals, exact as of the last attempt's end (nothing ran since); commits: a running "
            "job: units and rows done from one listing of _commits/ (each unit's rows from the plan _job.json "
            "records), the rest from the stats/ files and the markers of the units committed since they were written."
        )
    )
    stats_as_of: Optional[str] = Field(
        None, description="UTC, ISO 8601: the last commit the stats files hold (counts_from commits); null: none yet."
    )
    markers_read: int = Field(
        0, description="Markers of units committed since the stats files were written, read for their stats."
    )
    units_unread: int = Field(
        0,
        description=(
            "Committed units whose stats status did not read (more than 1,000 committed since the stats files were "
            "written): in units_committed and rows_done, not in the split into output and error rows, tokens or "
            "acceptance."
        ),
    )
    input_rows: int
    rows_done: int = Field(description="Input rows of committed units: generated or with a final error row.")
    output_rows: int = Field(description="Input rows generated.")
    error_rows: int
    retryable_error_rows: int = Field(description="Error rows a rerun generates again.")
    units_planned: int = Field(description="Work units of the input (the last attempt's plan).")
    units_committed: int
    attempt_units_committed: Optional[int] = Field(
        None, description="Running: of them, units the running attempt committed."
    )
    last_commit_at: Optional[str] = Field(
        None,
        description="Running: UTC, ISO 8601: the newest commit marker's write time (the store's clock); null: none.",
    )
    last_commit_age_seconds: Optional[float] = Field(
        None, description="Running: seconds since last_commit_at, when status looked."
    )
    errors_by_kind: dict[str, int] = Field(description="error_kind -> error rows, over the error files read.")
    error_units: int = Field(description="Committed units with error rows.")
    error_units_read: int = Field(description="Of those, units whose error file was read for errors_by_kind.")
    errors_by_kind_complete: bool = Field(description="Every error unit was read: errors_by_kind sums to error_rows.")
    speculation_trial: Optional[str] = Field(
        None,
        description=(
            "The speculation trial's verdict as the console printed it (_job.json trial.reason); null: none yet."
        ),
    )
    speculation_verdict: Optional[str] = Field(
        None,
        description="Whether speculation paid and what says so, as the console's summary says it (_job.json "
        "speculation); null while the job runs, or when it did not speculate.",
    )
    generated_tokens: int
    prompt_tokens: int = Field(
        0, description="Prompt tokens of the committed units (once per request, whatever its samples)."
    )
    cached_prompt_tokens: int = Field(
        0, description="Of prompt_tokens, those vLLM served from its prefix cache; the rest were computed."
    )
    prefix_cache_hit_rate: Optional[float] = Field(
        None, description="cached_prompt_tokens / prompt_tokens; null without prompt tokens."
    )
    tokens_per_second: float = Field(description="Generated tokens / the attempts' wall time so far: wall-time speed.")
    engine_tokens_per_second: float = Field(
        0.0, description="Generated tokens / the engines' busy time: an engine's speed while it generates."
    )
    engine_busy_share: Optional[float] = Field(
        None,
        description=(
            "The engines' busy time / (replicas x wall time): the share of billed engine time spent generating."
        ),
    )
    acceptance_rate: Optional[float] = Field(description="accepted / draft tokens; null without drafts.")
    mean_acceptance_length: Optional[float] = Field(description="1 + accepted / drafts; null without drafts.")
    rows_per_second: Optional[float] = Field(
        None,
        description=(
            "Running: rows the running attempt committed per second over its last pace_units committed units (the "
            "markers' write times): the steady pace. Commits come in bursts (each engine's first units end together), "
            "so there is none before pace_units units have committed after the attempt's first."
        ),
    )
    pace_units: Optional[int] = Field(
        None,
        description="Running: the units the pace is measured over: replicas x units_in_flight, one per engine slot.",
    )
    units_before_pace: Optional[int] = Field(
        None, description="Running: units still to commit before there is a pace; 0: there is one."
    )
    eta_seconds: Optional[float] = Field(
        None,
        description="Running: rows left / rows_per_second, from the last commit; null when not running or no pace yet.",
    )
    eta_at: Optional[str] = Field(
        None, description="UTC, ISO 8601: last_commit_at + eta_seconds, while the driver is alive; null otherwise."
    )
    progress_written_at: Optional[str] = Field(
        None,
        description="Running: UTC, ISO 8601: when the running attempt's driver last wrote _progress.json; null: none.",
    )
    engines_without_progress: list[EngineWithoutProgress] = Field(
        default_factory=list,
        description="Running: replicas holding requests that have yielded nothing for 60 s or more.",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description=(
            "What looks wrong while the job runs, one sentence each: an engine holding requests without output, no "
            "commit for much longer than the pace says, a driver that stopped writing _progress.json."
        ),
    )
    notes: list[str] = Field(
        default_factory=list, description="What a reader must know, one sentence each (a gone driver comes first)."
    )
