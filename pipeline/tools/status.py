"""`specbatch status OUTPUT_URI [--json]`: where a job stands, read from its output location
alone (local path or s3://...): its state, attempts and lease from `_job.json` and
`_lease.json`; rows and units done, acceptance and tok/s; error rows by kind from the error
files of the units that have some; while it runs, its last commit's age, its pace and ETA, and
engines that hold requests without yielding. A `running` job whose lease is stale (or gone) is
said to have lost its driver, with the command that resumes it.

Where the figures come from:

- A finished job (succeeded, completed_with_errors, failed): `_job.json`'s totals, which the
  driver wrote at the attempt's end over every committed unit; nothing has run since.
- A running job: units and rows done from one listing of `_commits/` (a unit is done when its
  marker is there; its rows from the plan `_job.json` records), with each marker's write time:
  the last commit's age, and the running attempt's pace over its last replicas x
  units_in_flight commits. Generated and error rows, tokens and acceptance from the
  `stats/attempt-<n>.parquet` files (the driver rewrites its own about every minute) plus the
  markers of the units committed since (pipeline/tools/status_counts.py). The engines, from the
  running driver's `_progress.json` (pipeline/tools/status_progress.py).
- Errors by kind: the `errors/<unit>.<commit_token>.parquet` file of each committed unit with
  error rows, named by its stats row (no listing); a stats row naming a superseded commit
  falls back to the unit's marker. Exact up to `--error-files` units (default 1,000); past
  that, an even sample of that many, said to be partial (`--error-files 0` reads them all).

What status costs at 10M prompts in 100k units, counted and measured: docs/scale.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from typing import Any, Optional

from pipeline.commit.fence import read_lease
from pipeline.commit.outputs import LayoutMismatch, ManifestInvalid, OutputLocation
from pipeline.speculation.policy import verdict_text
from pipeline.storage import Storage
from pipeline.tools.status_counts import ERROR_COLUMNS, error_kinds, read_stats, running_counts
from pipeline.tools.status_lease import driver_state, first_attempt_starting, lease_notes, lease_state
from pipeline.tools.status_progress import iso, overdue_warning, progress_warnings
from pipeline.tools.status_render import render
from schemas import Attempt, JobManifest, JobTotals
from schemas.status import AttemptState, StatusReport

DEFAULT_ERROR_FILES = 1000
EXAMPLE = """example:
  specbatch status --config jobs/daily.yaml     (its output_uri, with its storage settings)
  specbatch status s3://bucket/jobs/daily --json"""


class StatusError(ValueError):
    """The output location holds something status cannot read as a job."""


def read_manifest(location: OutputLocation) -> Optional[JobManifest]:
    try:
        return location.job_manifest()
    except (LayoutMismatch, ManifestInvalid) as exc:
        raise StatusError(str(exc)) from None


def job_status(
    storage: Storage,
    uri: str,
    error_files: int = DEFAULT_ERROR_FILES,
    run_command: str = "specbatch run CONFIG",
) -> Optional[StatusReport]:
    """Where the job at `uri` stands; None when no job has run there. `run_command` is how the
    notes name the command that resumes it."""
    location = OutputLocation(storage, uri)
    uri, now = location.uri, time.time()
    manifest = read_manifest(location)
    lease = read_lease(location.storage, location.uri)
    if manifest is None:
        return first_attempt_starting(uri, lease, now, run_command) if lease else None
    last = manifest.attempts[-1] if manifest.attempts else None
    driver = driver_state(manifest, last, lease, now)
    notes = lease_notes(manifest, last, lease, driver, now, run_command)
    input_rows = sum(f.rows for f in manifest.input_files) or manifest.totals.input_rows
    if manifest.status == "running":
        figures, stats = _running_figures(location, manifest, input_rows, driver, now)
        notes += figures.pop("notes")
    else:
        stats = read_stats(location, ERROR_COLUMNS).table if manifest.totals.error_rows else None
        figures = dict(
            counts_from="manifest",
            totals=manifest.totals,
            rows_done=manifest.totals.output_rows + manifest.totals.error_rows,
            units_committed=manifest.totals.units,
        )
    totals: JobTotals = figures.pop("totals")
    errors = _error_figures(location, stats, totals, error_files, notes)
    return StatusReport(
        output_uri=uri,
        checked_at=iso(now),
        job_id=manifest.job_id,
        status=manifest.status,
        driver=driver,
        attempts=len(manifest.attempts),
        last_attempt=_attempt_state(last),
        lease=lease_state(lease, now) if lease else None,
        input_rows=input_rows,
        output_rows=totals.output_rows,
        error_rows=totals.error_rows,
        retryable_error_rows=totals.retryable_error_rows,
        units_planned=last.units_planned if last else 0,
        speculation_trial=manifest.trial.reason if manifest.trial else None,
        speculation_verdict=verdict_text(manifest.speculation)
        if manifest.speculation and manifest.status != "running"
        else None,
        generated_tokens=totals.generated_tokens,
        prompt_tokens=totals.prompt_tokens,
        cached_prompt_tokens=totals.cached_prompt_tokens,
        prefix_cache_hit_rate=totals.prefix_cache_hit_rate,
        tokens_per_second=totals.tokens_per_second,
        engine_tokens_per_second=totals.engine_tokens_per_second,
        engine_busy_share=totals.engine_busy_share,
        acceptance_rate=totals.acceptance_rate,
        mean_acceptance_length=totals.mean_acceptance_length,
        notes=notes,
        **figures,
        **errors,
    )


def _running_figures(location: OutputLocation, manifest: JobManifest, input_rows: int, driver: str, now: float):
    """A running job's figures (StatusReport fields) from the `_commits/` listing, the stats and
    `_progress.json`; and the stats rows of its units, for errors by kind."""
    counts = running_counts(location, manifest, input_rows)
    pace, notes, warnings = counts.pace, [], []
    rate = pace.rows_per_second()
    eta = pace.eta(input_rows - counts.rows_done) if rate else None
    commit_age = max(0.0, now - counts.last_commit_at) if counts.last_commit_at is not None else None
    engines, written_at = [], None
    if driver == "alive":
        engines, warnings, written_at = progress_warnings(location, manifest, now)
        overdue = overdue_warning(commit_age, pace.seconds_per_unit())
        warnings += [overdue] if overdue else []
        if overdue and eta is not None:  # the pace of commits that stopped says nothing of when the job ends
            eta = None
            notes.append("no ETA while no unit commits")
    if counts.units_unread:
        notes.append(
            f"{counts.units_unread:,} units committed since stats/ was written are counted in rows and units done but "
            f"not in generated and error rows, tokens or acceptance (status reads at most {counts.markers_read:,} "
            "markers)"
        )
    figures: dict[str, Any] = dict(
        counts_from="commits",
        totals=counts.totals,
        rows_done=counts.rows_done,
        units_committed=counts.units,
        attempt_units_committed=counts.attempt_units,
        markers_read=counts.markers_read,
        units_unread=counts.units_unread,
        stats_as_of=iso(counts.stats_as_of) if counts.stats_as_of is not None else None,
        last_commit_at=iso(counts.last_commit_at) if counts.last_commit_at is not None else None,
        last_commit_age_seconds=commit_age,
        rows_per_second=rate,
        pace_units=pace.window,
        units_before_pace=pace.units_to_go(),
        eta_seconds=eta,
        eta_at=iso(counts.last_commit_at + eta) if eta is not None and driver == "alive" else None,
        progress_written_at=iso(written_at) if written_at is not None else None,
        engines_without_progress=engines,
        warnings=warnings,
        notes=notes,
    )
    return figures, counts.table


def _error_figures(
    location: OutputLocation, stats, totals: JobTotals, error_files: int, notes: list[str]
) -> dict[str, Any]:
    """Errors by kind from the error files (StatusReport fields); a partial count adds a note."""
    kinds, error_units, error_units_read = Counter(), 0, 0
    if stats is not None and totals.error_rows:
        kinds, error_units, error_units_read = error_kinds(location, stats, error_files)
        if error_units_read < error_units:
            sampled = error_files and error_units > error_files
            why = "--error-files 0 reads them all" if sampled else "the others' error files were not found"
            notes.append(
                f"errors by kind from {error_units_read:,} of the {error_units:,} units with error rows"
                f" ({sum(kinds.values()):,} of {totals.error_rows:,} error rows); {why}"
            )
    return dict(
        errors_by_kind=dict(kinds.most_common()),
        error_units=error_units,
        error_units_read=error_units_read,
        errors_by_kind_complete=error_units_read == error_units,
    )


def _attempt_state(last: Optional[Attempt]) -> Optional[AttemptState]:
    if last is None:
        return None
    return AttemptState(
        number=last.number, status=last.status, started_at=last.started_at, ended_at=last.ended_at, error=last.error
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch status",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "output_uri", nargs="?", metavar="OUTPUT_URI", help="the job's output location (local or s3://...)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (schemas.StatusReport)")
    parser.add_argument(
        "--config", metavar="JOB.yaml", help="take the storage settings (and OUTPUT_URI if not given) from a job config"
    )
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (default: the environment's, or the config's)")
    parser.add_argument("--region")
    parser.add_argument(
        "--error-files",
        type=int,
        default=DEFAULT_ERROR_FILES,
        metavar="N",
        help=f"read at most N units' error files for errors by kind (default {DEFAULT_ERROR_FILES}; 0: all)",
    )
    args = parser.parse_args(argv)
    storage, uri, run_command = (
        Storage(endpoint_url=args.endpoint_url, region=args.region),
        args.output_uri,
        "specbatch run CONFIG",
    )
    if args.config:
        from pipeline.config import ConfigError, load_config

        try:
            config = load_config(args.config)
        except (ConfigError, FileNotFoundError) as exc:
            print(f"specbatch status: {exc}", file=sys.stderr)
            return 2
        settings = config.storage
        storage = dataclasses.replace(
            Storage.from_config(settings),
            endpoint_url=args.endpoint_url or settings.endpoint_url,
            region=args.region or settings.region,
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
