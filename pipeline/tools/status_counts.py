"""What `specbatch status` reads of an output location to count a job: the stats files, the
error files of units with error rows, and for a running job one listing of `_commits/`.

A running job's units and rows done come from that listing, never from the stats files, which
its driver rewrites only about every minute (and not at all when it is stuck): a unit is done
when its marker is there. A unit's rows come from the plan `_job.json` records (its input files'
identities and `resources.rows_per_unit` give every unit id and its rows, `plan_units`), so no
marker is read for a count. The split into generated and error rows, the tokens and the
acceptance come from the stats files, plus the markers of the units committed since they were
written (at most MARKERS_READ_LIMIT; any others are counted as done and said to be unread).
The listing's write times give the last commit's age and the pace of the running attempt.
"""

from __future__ import annotations

import datetime as dt
import heapq
import posixpath
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.commit.outputs import COMMITS, OutputLocation, latest_per_unit
from pipeline.inputs.units import plan_units
from pipeline.config.resources import ResourcesConfig
from pipeline.job.console import Pace, commit_window
from pipeline.stages.stats import DRAFTING_COLUMNS, SUMMED_COLUMNS, totals_from_stats
from schemas import CommitMarker, JobManifest, JobTotals, UnitStats, arrow_schema

# The stats columns status reads (of 33): where each unit's error file is; while the job runs,
# also what totals_from_stats sums and when each unit committed.
ERROR_COLUMNS = ("unit_id", "commit_token", "error_rows")
TIMING_COLUMNS = ("started_at", "wall_seconds", "actor_id", "engine_seconds", "speculative", "depth_schedule")
STATS_COLUMNS = tuple(dict.fromkeys((*ERROR_COLUMNS, *SUMMED_COLUMNS, *DRAFTING_COLUMNS, *TIMING_COLUMNS)))
# Markers of units committed since the stats files were written, read for their stats: about a
# minute of commits (the driver rewrites its file every minute); 1,000 are 3 MB, 32 at a time.
MARKERS_READ_LIMIT = 1000


@dataclass
class RolledStats:
    table: pa.Table  # one row per unit (the later file wins), of the columns read
    as_of: Optional[float]  # Unix time of the last commit the files hold; None: none, or not read


@dataclass
class RunningCounts:
    """A running job's counts: units and rows from the `_commits/` listing, the rest from stats."""

    totals: JobTotals  # over the units whose stats were read (stats files and markers)
    table: pa.Table  # those stats rows, of STATS_COLUMNS
    units: int  # committed, from the listing
    rows_done: int  # their input rows, from the plan
    attempt_units: int  # of them, committed since the running attempt began
    units_unread: int  # committed units whose stats were not read: in `units` and `rows_done` only
    markers_read: int
    stats_as_of: Optional[float]
    last_commit_at: Optional[float]  # the newest marker's write time (the store's clock)
    pace: Pace  # over the running attempt's commits


def read_stats(location: OutputLocation, columns: tuple[str, ...] = STATS_COLUMNS) -> RolledStats:
    """The stats files' rows of every unit (the later attempt's file wins), of `columns` only."""
    files = location.stats_files(columns)
    schema = pa.schema([arrow_schema(UnitStats).field(name) for name in columns])
    table = latest_per_unit(list(files.values()), schema)
    as_of = None
    if "started_at" in columns and table.num_rows:
        as_of = pc.max(pc.add(table.column("started_at"), table.column("wall_seconds"))).as_py()
    return RolledStats(table, as_of)


def error_kinds(location: OutputLocation, stats: pa.Table, limit: int) -> tuple[Counter, int, int]:
    """error_kind -> rows over the error files of the units with error rows, at most `limit`
    of them (0: all), evenly spread over the units; returns (kinds, units with errors, read)."""
    with_errors = pc.filter(
        stats.select(["unit_id", "commit_token"]), pc.greater(pc.fill_null(stats.column("error_rows"), 0), 0)
    )
    count = with_errors.num_rows
    if limit and count > limit:
        with_errors = with_errors.take(pa.array([i * count // limit for i in range(limit)], type=pa.int64()))
    units = list(zip(with_errors.column("unit_id").to_pylist(), with_errors.column("commit_token").to_pylist()))

    def kinds_of(path: str) -> list[str]:
        return (
            location.storage.read_parquet(location.path(path), columns=["error_kind"]).column("error_kind").to_pylist()
        )

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


def list_commits(location: OutputLocation) -> dict[str, float]:
    """Committed unit -> its marker's last write (Unix time, the store's clock): one listing."""
    listed = location.storage.list_modified(location.path(COMMITS), ".json")
    return {posixpath.basename(uri)[: -len(".json")]: modified for uri, modified in listed.items()}


def resource(manifest: JobManifest, name: str) -> int:
    """A `resources` setting the job ran with (the default where `_job.json` has none); the
    replicas of an autoscaling pool: its maximum, the engines billed."""
    value = (manifest.config.get("resources") or {}).get(name, ResourcesConfig.model_fields[name].default)
    return int(value["max"] if isinstance(value, dict) else value)


def planned_rows(manifest: JobManifest) -> dict[str, int]:
    """Unit id -> its input rows, from the plan the recorded input files give."""
    return {
        u.unit_id: u.rows
        for u in plan_units(manifest.unit_files, resource(manifest, "rows_per_unit"), manifest.head_units)
    }


def running_counts(location: OutputLocation, manifest: JobManifest, input_rows: int) -> RunningCounts:
    """A running job's counts, as of one listing of `_commits/` (see the module's docstring)."""
    commits = list_commits(location)
    table, stats_as_of, markers_read = committed_stats(location, commits)
    rows = planned_rows(manifest)
    rows.update(
        {u: n for u, n in zip(table.column("unit_id").to_pylist(), table.column("rows").to_pylist()) if u not in rows}
    )
    last = manifest.attempts[-1] if manifest.attempts else None
    started = dt.datetime.fromisoformat(last.started_at).timestamp() if last else 0.0
    ours = {unit for unit, at in commits.items() if at >= started}  # the running attempt's commits
    wall = (
        sum(a.wall_seconds for a in manifest.attempts[:-1]) + max((commits[u] for u in ours), default=started) - started
    )
    replicas = resource(manifest, "replicas")
    return RunningCounts(
        totals=totals_from_stats(table, input_rows, wall, replicas),
        table=table,
        units=len(commits),
        rows_done=sum(rows.get(u, 0) for u in commits),
        attempt_units=len(ours),
        units_unread=len(commits) - table.num_rows,
        markers_read=markers_read,
        stats_as_of=stats_as_of,
        last_commit_at=max(commits.values(), default=None),
        pace=attempt_pace(table, commits, ours, commit_window(replicas, resource(manifest, "units_in_flight"))),
    )


def committed_stats(location: OutputLocation, commits: dict[str, float]) -> tuple[pa.Table, Optional[float], int]:
    """The stats rows of the committed units: the stats files', and the markers' of the newest
    units they lack, at most MARKERS_READ_LIMIT; (rows, the files' last commit, markers read)."""
    stats = read_stats(location)
    in_stats = stats.table.filter(pc.is_in(stats.table.column("unit_id"), pa.array(list(commits), pa.string())))
    seen = set(in_stats.column("unit_id").to_pylist())
    newest_first = sorted((u for u in commits if u not in seen), key=commits.get, reverse=True)
    from_markers = marker_stats(location, newest_first[:MARKERS_READ_LIMIT])  # the pace's units among them
    return pa.concat_tables([in_stats, from_markers]), stats.as_of, from_markers.num_rows


def marker_stats(location: OutputLocation, units: list[str]) -> pa.Table:
    """The stats rows the markers of `units` hold (a marker gone since the listing is skipped)."""

    def read(unit: str) -> Optional[dict]:
        try:
            return CommitMarker.model_validate(
                location.storage.read_json(location.path(COMMITS, f"{unit}.json"))
            ).stats.model_dump()
        except FileNotFoundError:
            return None

    found = [row for row in location.read_all(read, units) if row is not None]
    schema = pa.schema([arrow_schema(UnitStats).field(name) for name in STATS_COLUMNS])
    return pa.Table.from_pylist([{name: row.get(name) for name in STATS_COLUMNS} for row in found], schema=schema)


def attempt_pace(stats: pa.Table, commits: dict[str, float], units: set[str], window: int) -> Pace:
    """The pace over the last window of `units` (the running attempt's) that `stats` holds. The
    newest twice a window by the listing's write times (whole seconds on S3), then in the order
    the units' own stats say they committed."""
    newest = heapq.nlargest(2 * (window + 1), units, key=commits.get)
    ours = stats.filter(pc.is_in(stats.column("unit_id"), pa.array(newest, pa.string())))
    columns = ("started_at", "wall_seconds", "engine_seconds", "rows")
    timed = sorted(
        (start + max(wall, engine), rows, start, start + engine)
        for start, wall, engine, rows in zip(*(ours.column(c).to_pylist() for c in columns))
    )
    pace = Pace(window)
    for unit in timed[-(window + 1) :]:
        pace.add(*unit)
    return pace
