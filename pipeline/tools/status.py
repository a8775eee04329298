"""`specbatch status OUTPUT_URI [--json]`: where a job stands, read from its output location
alone (local path or s3://...): its state, attempts and lease from `_job.json` and
`_lease.json`; rows and units done, acceptance and tok/s from the job's own aggregates; error
rows by kind from the error files of the units that have some; while it runs, its pace and ETA.
A `running` job whose lease is stale (or gone) is said to have lost its driver, with the command
that resumes it.

Where the figures come from:

- A finished job (succeeded, completed_with_errors, failed): `_job.json`'s totals, which the
  driver wrote at the attempt's end over every committed unit; nothing has run since.
- A running job: the `stats/attempt-<n>.parquet` files (one per attempt, one row per committed
  unit; a unit in two files counts once, from the later one). The running attempt's driver
  rewrites its file every `graph_run.STATS_FLUSH_SECONDS` (60 s) while units commit, so the
  counts lag the commits by up to about a minute; `stats_as_of` says how much. `_commits/` is
  not listed: at 100k units that is 100 LIST pages (about 60 s on moto, docs/scale.md) for
  that last minute.
- Errors by kind: the `errors/<unit>.<commit_token>.parquet` file of each committed unit with
  error rows, named by its stats row (no listing); a stats row naming a superseded commit
  falls back to the unit's marker. Exact up to `--error-files` units (default 1,000); past
  that, an even sample of that many, said to be partial (`--error-files 0` reads them all).

What status costs at 10M prompts in 100k units, counted and measured: docs/scale.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.commit.lease import heartbeat_age, is_stale, read_lease
from pipeline.commit.outputs import LayoutMismatch, ManifestInvalid, OutputLocation, latest_per_unit
from pipeline.job.console import STEADY_MIN_SECONDS
from pipeline.job.graph_run import STATS_FLUSH_SECONDS
from pipeline.stages.stats import totals_from_stats
from pipeline.storage import Storage
from schemas import JobManifest, Lease, UnitStats, arrow_schema
from schemas.status import AttemptState, LeaseState, StatusReport

DEFAULT_ERROR_FILES = 1000
# The stats columns status reads (of 33): where each unit's error file is; while the job runs,
# also what totals_from_stats sums and when each unit committed.
ERROR_COLUMNS = ("unit_id", "commit_token", "error_rows")
STATS_COLUMNS = (
    *ERROR_COLUMNS, "rows", "output_rows", "samples", "retryable_error_rows", "clipped_rows", "prompt_tokens",
    "generated_tokens", "num_drafts", "draft_tokens", "accepted_tokens", "started_at", "wall_seconds", "actor_id",
    "engine_seconds",
)
EXAMPLE = """example:
  specbatch status --config jobs/daily.yaml     (its output_uri, with its storage settings)
  specbatch status s3://bucket/jobs/daily --json"""


class StatusError(ValueError):
    """The output location holds something status cannot read as a job."""


@dataclass
class RolledStats:
    table: pa.Table  # one row per committed unit (the later file wins), of the columns read
    attempt_rows: Optional[int]  # rows the given attempt's own file holds; None: it has no file
    as_of: Optional[float]  # Unix time of the last commit in that file
    steady: Optional[tuple[float, int]] = None  # (the file's first commit, rows committed after it)


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat(timespec="seconds")


def read_stats(location: OutputLocation, attempt: int, columns: tuple[str, ...] = STATS_COLUMNS) -> RolledStats:
    """The stats files' rows of every unit (the later attempt's file wins), of `columns`
    only; and with STATS_COLUMNS, the given attempt's committed rows and last commit time,
    from its own file."""
    files = location.stats_files(columns)
    own = files.get(f"attempt-{attempt:04d}")
    attempt_rows = as_of = steady = None
    if own is not None and "started_at" in columns:
        attempt_rows = int(pc.sum(own.column("rows")).as_py() or 0)
        if own.num_rows:
            committed = pc.add(own.column("started_at"), own.column("wall_seconds"))
            as_of = pc.max(committed).as_py()
            first = pc.index(committed, pc.min(committed)).as_py()
            steady = (pc.min(committed).as_py(), attempt_rows - own.column("rows")[first].as_py())
    schema = pa.schema([arrow_schema(UnitStats).field(name) for name in columns])
    return RolledStats(latest_per_unit(list(files.values()), schema), attempt_rows, as_of, steady)


def error_kinds(location: OutputLocation, stats: pa.Table, limit: int) -> tuple[Counter, int, int]:
    """error_kind -> rows over the error files of the units with error rows, at most `limit`
    of them (0: all), evenly spread over the units; returns (kinds, units with errors, read)."""
    with_errors = pc.filter(stats.select(["unit_id", "commit_token"]), pc.greater(pc.fill_null(stats.column("error_rows"), 0), 0))
    count = with_errors.num_rows
    if limit and count > limit:
        with_errors = with_errors.take(pa.array([i * count // limit for i in range(limit)], type=pa.int64()))
    units = list(zip(with_errors.column("unit_id").to_pylist(), with_errors.column("commit_token").to_pylist()))

    def kinds_of(path: str) -> list[str]:
        return location.storage.read_parquet(location.path(path), columns=["error_kind"]).column("error_kind").to_pylist()

    def read(unit: tuple[str, Optional[str]]) -> Optional[list[str]]:
        unit_id, token = unit
        try:
            if token:
                try:
                    return kinds_of(f"errors/{unit_id}.{token}.parquet")
                except FileNotFoundError:
                    pass
            # the stats row names no commit, or one superseded since: the unit's marker names the visible files
            path = location.markers([unit_id])[unit_id].files.get("errors")
            return kinds_of(path) if path else None
        except FileNotFoundError:
            return None

    kinds, read_units = Counter(), 0
    for found in location.read_all(read, units):
        if found is not None:
            kinds.update(found)
            read_units += 1
    return kinds, count, read_units


def _age(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min"


def read_manifest(location: OutputLocation) -> Optional[JobManifest]:
    try:
        return location.job_manifest()
    except (LayoutMismatch, ManifestInvalid) as exc:
        raise StatusError(str(exc)) from None


def job_status(
    storage: Storage, uri: str, error_files: int = DEFAULT_ERROR_FILES, run_command: str = "specbatch run CONFIG",
) -> Optional[StatusReport]:
    """Where the job at `uri` stands; None when no job has run there. `run_command` is how the
    notes name the command that resumes it."""
    location = OutputLocation(storage, uri)
    uri, now = location.uri, time.time()
    manifest = read_manifest(location)
    lease = read_lease(location)
    if manifest is None:
        return _first_attempt_starting(uri, lease, now, run_command) if lease else None
    last = manifest.attempts[-1] if manifest.attempts else None
    running = manifest.status == "running"
    age = heartbeat_age(lease, now) if lease else None
    fresh = lease is not None and not is_stale(lease, now)
    if running:
        driver = ("starting" if last and lease.attempt > last.number else "alive") if fresh else "gone"
    else:
        driver = "starting" if fresh else "none"
    notes = []
    if running and driver == "gone":
        if lease is not None:
            notes.append(f"no heartbeat for {_age(age)}: the driver is probably gone; `{run_command}` takes over and resumes")
        else:
            notes.append(f"_job.json says running but no run holds the lease: the driver is gone; resume with `{run_command}`")
    elif driver == "starting":
        notes.append(f"a new attempt ({lease.attempt}) is starting: run {lease.owner} holds the lease, heartbeat {_age(age)} ago")
    elif lease is not None and not fresh:
        notes.append(
            f"a stale lease of attempt {lease.attempt} is left (no heartbeat for {_age(age)}): its run died without "
            f"releasing it; the next `{run_command}` takes it over"
        )
    if manifest.status in ("failed", "interrupted") and last is not None and last.error:
        notes.append(f"attempt {last.number} {manifest.status}: {last.error.splitlines()[0][:300]}; `{run_command}` resumes it")

    input_rows = sum(f.rows for f in manifest.input_files) or manifest.totals.input_rows
    rows_per_second = eta = eta_at = as_of = pace_since = None
    stats = None
    if running:
        stats = read_stats(location, last.number if last else 0)
        started = dt.datetime.fromisoformat(last.started_at).timestamp() if last else now
        as_of = stats.as_of
        elapsed = as_of - started if as_of is not None else 0.0
        wall = sum(a.wall_seconds for a in manifest.attempts[:-1]) + max(0.0, elapsed)
        totals = totals_from_stats(stats.table, input_rows, wall, _replicas(manifest))
        if as_of is None:
            notes.append(
                f"the running attempt has written no stats yet (its driver writes stats/ about every "
                f"{STATS_FLUSH_SECONDS:.0f} s while units commit): no pace or ETA yet"
            )
        else:
            notes.append(
                f"counts as of the last commit in stats/, {_iso(as_of)} ({_age(max(0.0, now - as_of))} ago): the driver "
                f"rewrites stats/ about every {STATS_FLUSH_SECONDS:.0f} s, units committed since are not counted yet"
            )
            since, rows_after = stats.steady or (as_of, 0)
            if as_of - since >= STEADY_MIN_SECONDS and rows_after:  # the pace since the first commit, not the start-up
                rows_per_second, pace_since = rows_after / (as_of - since), "first_commit"
            elif elapsed > 0 and stats.attempt_rows:  # units that committed together: since the attempt began
                rows_per_second, pace_since = stats.attempt_rows / elapsed, "attempt_start"
            if rows_per_second:
                eta = max(0, input_rows - totals.output_rows - totals.error_rows) / rows_per_second
                eta_at = _iso(as_of + eta) if driver == "alive" else None
    else:
        totals = manifest.totals
        if totals.error_rows:
            stats = read_stats(location, 0, ERROR_COLUMNS)

    kinds, error_units, error_units_read = Counter(), 0, 0
    if stats is not None and totals.error_rows:
        kinds, error_units, error_units_read = error_kinds(location, stats.table, error_files)
        if error_units_read < error_units:
            sampled = error_files and error_units > error_files
            why = "--error-files 0 reads them all" if sampled else "the others' error files were not found"
            notes.append(
                f"errors by kind from {error_units_read:,} of the {error_units:,} units with error rows"
                f" ({sum(kinds.values()):,} of {totals.error_rows:,} error rows); {why}"
            )
    return StatusReport(
        output_uri=uri,
        checked_at=_iso(now),
        job_id=manifest.job_id,
        status=manifest.status,
        driver=driver,
        attempts=len(manifest.attempts),
        last_attempt=AttemptState(
            number=last.number, status=last.status, started_at=last.started_at, ended_at=last.ended_at, error=last.error
        ) if last else None,
        lease=_lease_state(lease, now) if lease else None,
        counts_from="stats" if running else "manifest",
        stats_as_of=_iso(as_of) if as_of is not None else None,
        input_rows=input_rows,
        rows_done=totals.output_rows + totals.error_rows,
        output_rows=totals.output_rows,
        error_rows=totals.error_rows,
        retryable_error_rows=totals.retryable_error_rows,
        units_planned=last.units_planned if last else 0,
        units_committed=totals.units,
        errors_by_kind=dict(kinds.most_common()),
        error_units=error_units,
        error_units_read=error_units_read,
        errors_by_kind_complete=error_units_read == error_units,
        speculation_trial=manifest.trial.reason if manifest.trial else None,
        generated_tokens=totals.generated_tokens,
        tokens_per_second=totals.tokens_per_second,
        engine_tokens_per_second=totals.engine_tokens_per_second,
        engine_busy_share=totals.engine_busy_share,
        acceptance_rate=totals.acceptance_rate,
        mean_acceptance_length=totals.mean_acceptance_length,
        rows_per_second=rows_per_second,
        pace_since=pace_since,
        eta_seconds=eta,
        eta_at=eta_at,
        notes=notes,
    )


def _lease_state(lease: Lease, now: float) -> LeaseState:
    return LeaseState(
        owner=lease.owner, attempt=lease.attempt, acquired_at=lease.acquired_at, heartbeat_at=lease.heartbeat_at,
        heartbeat_age_seconds=heartbeat_age(lease, now), stale_after_seconds=lease.stale_after_seconds, stale=is_stale(lease, now),
    )


def _first_attempt_starting(uri: str, lease: Lease, now: float, run_command: str) -> StatusReport:
    """A run holds the location but has not written `_job.json` yet: it is checking its inputs
    and starting Ray (the manifest comes just before its engines start)."""
    age = heartbeat_age(lease, now)
    fresh = not is_stale(lease, now)
    if fresh:
        note = (f"the first attempt of job {lease.job_id} is starting (input check, plan, Ray): run {lease.owner} holds "
                f"the lease, heartbeat {_age(age)} ago; no _job.json yet, so no counts yet")
    else:
        note = (f"a stale lease of job {lease.job_id} is left (no heartbeat for {_age(age)}) and no _job.json: its run "
                f"died before it wrote one; the next `{run_command}` takes it over")
    return StatusReport(
        output_uri=uri, checked_at=_iso(now), job_id=lease.job_id, status="running", driver="starting" if fresh else "gone",
        attempts=0, lease=_lease_state(lease, now), counts_from="manifest", input_rows=0, rows_done=0, output_rows=0, error_rows=0, retryable_error_rows=0,
        units_planned=0, units_committed=0, errors_by_kind={}, error_units=0, error_units_read=0,
        errors_by_kind_complete=True, generated_tokens=0, tokens_per_second=0.0, acceptance_rate=None,
        mean_acceptance_length=None, notes=[note],
    )


def _replicas(manifest: JobManifest) -> int:
    """The engines billed: the pool's size (an autoscaling pool: its maximum)."""
    replicas = manifest.config.get("resources", {}).get("replicas", 1)
    return replicas["max"] if isinstance(replicas, dict) else int(replicas)


def render(report: StatusReport) -> str:
    """The report for a terminal: the same figures as --json."""
    r = report
    driver = {"alive": "its driver is alive", "gone": "its driver is GONE", "starting": "a new attempt is starting",
              "none": "no run holds it"}[r.driver]
    lines = [f"job {r.job_id} at {r.output_uri}: {r.status} ({driver})"]
    if r.last_attempt:
        a = r.last_attempt
        ended = f", ended {a.ended_at}" if a.ended_at else ""
        error = f": {a.error.splitlines()[0][:200]}" if a.error else ""
        lines.append(f"  attempts:  {r.attempts}; the last, {a.number}: started {a.started_at}{ended}, {a.status}{error}")
    if r.lease:
        lease = r.lease
        state = "STALE" if lease.stale else "fresh"
        lines.append(
            f"  lease:     {lease.owner} (attempt {lease.attempt}), heartbeat {_age(lease.heartbeat_age_seconds)} ago, "
            f"{state} (stale after {lease.stale_after_seconds:.0f} s)"
        )
    else:
        lines.append("  lease:     none")
    if r.attempts == 0:  # no _job.json yet: nothing to count
        return "\n".join([*lines, *(f"note: {note}" for note in r.notes)])
    share = f" ({r.rows_done / r.input_rows:.0%})" if r.input_rows else ""
    lines.append(
        f"  rows:      {r.rows_done:,} of {r.input_rows:,} done{share}: {r.output_rows:,} generated, {r.error_rows:,} errors"
        + (f" ({r.retryable_error_rows:,} retryable)" if r.retryable_error_rows else "")
    )
    lines.append(f"  units:     {r.units_committed:,} of {r.units_planned:,} committed")
    if r.error_rows:
        kinds = ", ".join(f"{kind} {n:,}" for kind, n in r.errors_by_kind.items()) or "none read"
        partial = "" if r.errors_by_kind_complete else f" (from {r.error_units_read:,} of {r.error_units:,} units with errors)"
        lines.append(f"  errors:    {kinds}{partial}")
    if r.acceptance_rate is not None:
        lines.append(f"  acceptance: rate {r.acceptance_rate:.3f}, mean acceptance length {r.mean_acceptance_length:.2f}")
    else:
        lines.append("  acceptance: none (no drafts)")
    if r.speculation_trial:
        lines.append(f"  trial:     {r.speculation_trial}")
    lines.append(f"  generated: {r.generated_tokens:,} tokens, {r.tokens_per_second:,.1f} tok/s of wall time")
    if r.engine_tokens_per_second:
        busy = f", engines busy {r.engine_busy_share:.0%} of the billed time" if r.engine_busy_share is not None else ""
        lines.append(f"  engines:   {r.engine_tokens_per_second:,.1f} tok/s of engine time{busy}")
    if r.eta_seconds is not None:
        when = f" (about {r.eta_at})" if r.eta_at else " once resumed"
        since = "the attempt's first committed unit" if r.pace_since == "first_commit" else "the attempt started"
        lines.append(f"  ETA:       {_duration(r.eta_seconds)}{when}, at {r.rows_per_second:,.1f} rows/s since {since}")
    lines += [f"{'WARNING' if i == 0 and r.driver == 'gone' else 'note'}: {note}" for i, note in enumerate(r.notes)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch status",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("output_uri", nargs="?", metavar="OUTPUT_URI", help="the job's output location (local or s3://...)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (schemas.StatusReport)")
    parser.add_argument("--config", metavar="JOB.yaml", help="take the storage settings (and OUTPUT_URI if not given) from a job config")
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (default: the environment's, or the config's)")
    parser.add_argument("--region")
    parser.add_argument(
        "--error-files", type=int, default=DEFAULT_ERROR_FILES, metavar="N",
        help=f"read at most N units' error files for errors by kind (default {DEFAULT_ERROR_FILES}; 0: all)",
    )
    args = parser.parse_args(argv)
    storage, uri, run_command = Storage(endpoint_url=args.endpoint_url, region=args.region), args.output_uri, "specbatch run CONFIG"
    if args.config:
        from pipeline.config import ConfigError, load_config

        try:
            config = load_config(args.config)
        except (ConfigError, FileNotFoundError) as exc:
            print(f"specbatch status: {exc}", file=sys.stderr)
            return 2
        settings = config.storage
        storage = Storage(
            endpoint_url=args.endpoint_url or settings.endpoint_url, region=args.region or settings.region,
            retry_seconds=settings.retry_seconds,
        )
        uri = uri or config.output_uri
        run_command = f"specbatch run {args.config}"
        if uri.rstrip("/") != config.output_uri.rstrip("/"):
            run_command += f" --output-uri {uri}"
    if not uri:
        parser.error("OUTPUT_URI is required (or --config with the job's output_uri)")
    try:
        report = job_status(storage, uri, args.error_files, run_command)
    except StatusError as exc:
        print(f"specbatch status: {exc}", file=sys.stderr)
        return 2
    if report is None:
        print(f"specbatch status: no job has run at {uri}", file=sys.stderr)
        return 2
    print(report.model_dump_json(indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
