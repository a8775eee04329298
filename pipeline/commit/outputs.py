"""The output location: its layout, the per-unit commit, and reading committed data back.

    OUTPUT_URI/
      outputs/<unit_id>.<token>.parquet   generated rows of a unit      (schemas.OutputRow)
      errors/<unit_id>.<token>.parquet    its failed rows, if any        (schemas.ErrorRow)
      _commits/<unit_id>.json             commit marker, written last    (schemas.CommitMarker)
      stats/attempt-<n>.parquet           one row per committed unit     (schemas.UnitStats)
      _attempts/<unit_id>/...             how often a unit was started, its suspects at its last engine death
      _events/engine-death-*.json         engine deaths the actors recorded before they exited
      _grouped/<token>/*.parquet          the input sorted by shared prompt prefix, when the units are planned over it
      _lease.json                         the run that owns the location (schemas.Lease)
      _job.json                           job manifest                   (schemas.JobManifest)

A unit is a fixed row range of one input file (or of the grouped copy, recorded in `_job.json`),
so the same input always gives the same units. Its files count only through its marker: a unit
that died half-written is invisible, and when the same unit is committed twice (a late actor, a
retried task) each commit writes files under its own token and the marker written last names the
one set that counts; never both. Resume lists `_commits/` and nothing else. `cleanup()` removes
files no marker names, in bulk.

Statistics live in each marker; the driver, which hears of every unit it commits, also writes
them as one `stats/attempt-<n>.parquet` per attempt, each committed unit in exactly one of
those files, so that totals and reports read a few files instead of one marker per unit.
"""

from __future__ import annotations

import json
import posixpath
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from pipeline.commit.fence import check_fence
from pipeline.inputs.units import GROUPED
from pipeline.storage import PreconditionFailed, Storage, json_bytes
from schemas import LAYOUT_VERSION, CommitMarker, Fence, JobManifest, UnitStats, arrow_schema

ROW_TABLES = ("outputs", "errors")
COMMITS = "_commits"
ATTEMPTS = "_attempts"
EVENTS = "_events"
STATS = "stats"
MANIFEST = "_job.json"
PROGRESS = "_progress.json"  # a running attempt's driver's last look (schemas.JobProgress)
# Reads of many small objects (markers) go out this many at a time.
PARALLEL_READS = 32
# An object store stamps a file with its own clock; cleanup allows the driver's clock this much error.
CLOCK_SKEW_SECONDS = 10.0
T = TypeVar("T")


class LayoutMismatch(ValueError):
    """The output location was written by another version of the output layout."""


class ManifestInvalid(ValueError):
    """`_job.json` does not match the job manifest contract."""


class OutputLocation:
    def __init__(self, storage: Storage, uri: str):
        self.storage = storage
        self.uri = uri.rstrip("/")
        self.holder: Optional[Callable[[], None]] = None  # raises once this run no longer holds the lease

    def write_only_while(self, holder: Callable[[], None]) -> None:
        """`_job.json` is written only while `holder()` returns (pipeline/commit/lease.OutputLease.still_ours)."""
        self.holder = holder

    def path(self, *parts: str) -> str:
        return self.storage.join(self.uri, *parts)

    @staticmethod
    def read_all(read: Callable[[Any], T], uris: list) -> list[T]:
        """`read` of each, PARALLEL_READS at a time (object stores answer small reads slowly, in parallel well)."""
        if len(uris) < 2:
            return [read(uri) for uri in uris]
        with ThreadPoolExecutor(PARALLEL_READS) as pool:
            return list(pool.map(read, uris))

    # ------------------------------------------------------------------ commit

    def write_files(
        self, unit_id: str, tables: dict[str, pa.Table], stats: UnitStats, generation: int = 0
    ) -> CommitMarker:
        """First half of a commit: the unit's files under a fresh token that begins with the
        writer's lease generation (what cleanup tells its own dead commits by). Nothing is visible yet."""
        token = f"g{generation}-{uuid.uuid4().hex[:12]}"
        files, rows = {}, {}
        for name in ROW_TABLES:
            table = tables.get(name)
            if table is not None and table.num_rows:
                files[name] = f"{name}/{unit_id}.{token}.parquet"
                rows[name] = table.num_rows
                self.storage.write_parquet(self.path(files[name]), table)
        stats = stats.model_copy(update={"commit_token": token})
        return CommitMarker(unit_id=unit_id, token=token, files=files, rows=rows, stats=stats)

    def publish(self, marker: CommitMarker) -> None:
        """Second half: the marker makes exactly its files visible (an object PUT is atomic)."""
        self.storage.write_json(self.path(COMMITS, f"{marker.unit_id}.json"), marker.model_dump(mode="json"))

    def commit(
        self, unit_id: str, tables: dict[str, pa.Table], stats: UnitStats, fence: Optional[Fence] = None
    ) -> CommitMarker:
        """The unit committed: its files, then, under a run's lease, the fence checked (a run that
        lost the location commits nothing more), then the marker that makes the files visible,
        and the unit's attempt finished."""
        stats = stats.model_copy(update={"lease_owner": fence.owner if fence else ""})
        marker = self.write_files(unit_id, tables, stats, fence.generation if fence else 0)
        if fence is not None:
            check_fence(self.storage, self.uri, fence)
        self.publish(marker)
        self.finish_attempt(unit_id)
        return marker

    # ------------------------------------------------------------------ reading

    def committed_units(self) -> set[str]:
        """Ids of every committed unit, from one listing of `_commits/` (what a resume reads)."""
        return {
            posixpath.basename(uri)[: -len(".json")] for uri in self.storage.list_files(self.path(COMMITS), ".json")
        }

    def markers(self, unit_ids: Optional[Iterable[str]] = None) -> dict[str, CommitMarker]:
        units = sorted(self.committed_units() if unit_ids is None else unit_ids)
        docs = self.read_all(self.storage.read_json, [self.path(COMMITS, f"{u}.json") for u in units])
        return {u: CommitMarker.model_validate(doc) for u, doc in zip(units, docs)}

    def read_table(self, name: str, columns: Optional[list[str]] = None) -> pa.Table:
        """All committed rows of outputs or errors (the files the markers name), or the stats
        of every committed unit; an empty table if none."""
        if name == STATS:
            return self.stats_table()
        tables = self.read_all(lambda uri: self.storage.read_parquet(uri, columns), self.committed_files(name))
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def committed_files(self, name: str) -> list[str]:
        """The files of outputs or errors that commit markers name, in unit order: a unit's
        files that no marker names (a run that died before its commit) are not among them."""
        return [self.path(m.files[name]) for m in self.markers().values() if name in m.files]

    def stats_files(
        self, columns: Optional[Sequence[str]] = None, skip_file: Optional[str] = None
    ) -> dict[str, pa.Table]:
        """Each attempt's stats file (attempt-NNNN -> its rows, oldest attempt first), of `columns`
        only (all: None); a column a file of an older specbatch lacks is nulls."""
        full = arrow_schema(UnitStats)
        schema = pa.schema([full.field(name) for name in columns]) if columns else full
        files = {
            posixpath.basename(u)[: -len(".parquet")]: u for u in self.storage.list_files(self.path(STATS), ".parquet")
        }
        files = {name: uri for name, uri in files.items() if name != skip_file}

        def read(uri: str) -> pa.Table:
            parquet = pq.ParquetFile(pa.BufferReader(self.storage.read_bytes(uri)))
            present = set(parquet.schema_arrow.names)
            table = parquet.read(
                columns=[f.name for f in schema if f.name in present], use_threads=False
            )  # as Storage.read_parquet
            return pa.table(
                {f.name: table.column(f.name) if f.name in present else pa.nulls(table.num_rows) for f in schema}
            ).cast(schema)

        return dict(zip(files, self.read_all(read, list(files.values()))))

    def _rolled_stats(self, committed: set[str], skip_file: Optional[str] = None) -> pa.Table:
        """Rows of the stats files for committed units; a unit in two files counts once."""
        rolled = latest_per_unit(list(self.stats_files(skip_file=skip_file).values()), arrow_schema(UnitStats))
        keep = [i for i, unit in enumerate(rolled.column("unit_id").to_pylist()) if unit in committed]
        return rolled.take(pa.array(keep, type=pa.int64()))

    def _marker_stats(self, units: set[str]) -> pa.Table:
        rows = [m.stats.model_dump() for m in self.markers(units).values()]
        return pa.Table.from_pylist(rows, schema=arrow_schema(UnitStats))

    def stats_table(self, committed: Optional[set[str]] = None) -> pa.Table:
        """One stats row per committed unit: the attempts' stats files, plus the markers of
        committed units no file holds (committed by an attempt killed before its file)."""
        committed = self.committed_units() if committed is None else committed
        rolled = self._rolled_stats(committed)
        missing = committed - set(rolled.column("unit_id").to_pylist())
        return pa.concat_tables([rolled, self._marker_stats(missing)]) if missing else rolled

    def write_stats(self, attempt: int, heard: list[dict], committed: Optional[set[str]] = None) -> pa.Table:
        """An attempt's stats file. While it runs (`committed` None): the units it heard of.
        At its end: those, and every committed unit that no other attempt's file holds (from
        their markers), so that the files hold every committed unit, each once unless an
        attempt ran it again (its latest file counts); then returns the stats of every
        committed unit."""
        name = f"attempt-{attempt:04d}"
        schema = arrow_schema(UnitStats)
        if committed is None:
            self.storage.write_parquet(self.path(STATS, f"{name}.parquet"), pa.Table.from_pylist(heard, schema=schema))
            return pa.Table.from_pylist(heard, schema=schema)
        own = [r for r in heard if r["unit_id"] in committed]
        mine = {r["unit_id"] for r in own}  # this attempt's rows win: a unit it ran again has new stats
        others = self._rolled_stats(committed - mine, skip_file=name)
        stragglers = committed - mine - set(others.column("unit_id").to_pylist())
        table = pa.concat_tables([pa.Table.from_pylist(own, schema=schema), self._marker_stats(stragglers)])
        self.storage.write_parquet(self.path(STATS, f"{name}.parquet"), table)
        return pa.concat_tables([others, table])

    # ------------------------------------------------------------------ cleanup

    def cleanup(
        self, committed: Optional[set[str]] = None, since: Optional[float] = None, generation: Optional[int] = None
    ) -> int:
        """Delete files no marker names: a commit that died before its marker, or the files of
        an earlier commit of a unit committed again. Listings tell almost all of it: a unit
        with a marker and files of one token is clean (a commit writes its files before its
        marker, and every unit has at least one row), so only units with files of several
        tokens need their marker read. Run only while the lease is held and no engine of this
        run commits (the end of an attempt). With `since` (the attempt's start) a file no
        marker names is deleted only if it was written before then, or under this run's lease
        `generation` (its engines have stopped): a run that lost the lease may still be about
        to publish a marker naming a newer file, and a later attempt deletes it. Returns how
        many files were deleted, in bulk."""
        committed = self.committed_units() if committed is None else committed
        tokens: dict[str, dict[str, list[tuple[str, float]]]] = {}
        for name in ROW_TABLES:
            for uri, modified in self.storage.list_modified(self.path(name), ".parquet").items():
                unit, _, rest = posixpath.basename(uri).partition(".")
                tokens.setdefault(unit, {}).setdefault(rest[: -len(".parquet")], []).append((uri, modified))
        ambiguous = [u for u, by_token in tokens.items() if u in committed and len(by_token) > 1]
        visible = {u: m.token for u, m in self.markers(ambiguous).items()}

        def dead(token: str, modified: float) -> bool:
            return since is None or modified < since - CLOCK_SKEW_SECONDS or token.startswith(f"g{generation}-")

        doomed = [
            uri
            for unit, by_token in tokens.items()
            for token, files in by_token.items()
            if unit not in committed or (unit in visible and token != visible[unit])
            for uri, modified in files
            if dead(token, modified)
        ]
        attempts = [
            uri
            for uri in self.storage.list_files(self.path(ATTEMPTS))
            if uri[len(self.path(ATTEMPTS)) + 1 :].split("/", 1)[0] in committed
        ]
        self.storage.delete_many(doomed + attempts)
        return len(doomed)

    # ------------------------------------------------------------------ attempts of a unit

    def start_attempt(self, unit_id: str) -> int:
        """Record that a unit is being started; returns how many earlier starts never finished
        (an engine death ends its actor mid-unit and leaves the count behind)."""
        uri = self.path(ATTEMPTS, unit_id, "unit.json")
        before = self.storage.read_json(uri)["started"] if self.storage.exists(uri) else 0
        self.storage.write_json(uri, {"started": before + 1})
        return before

    def finish_attempt(self, unit_id: str) -> None:
        self.storage.delete(self.path(ATTEMPTS, unit_id, "unit.json"))

    def record_suspects(self, unit_id: str, rows: list[int], alone: bool) -> None:
        """The unit's rows that were in the engine, unfinished, when it died; `alone`: one row
        with nothing else in the engine."""
        self.storage.write_json(self.path(ATTEMPTS, unit_id, "suspects.json"), {"rows": rows, "alone": alone})

    def read_suspects(self, unit_id: str) -> Optional[dict]:
        uri = self.path(ATTEMPTS, unit_id, "suspects.json")
        return self.storage.read_json(uri) if self.storage.exists(uri) else None

    def record_engine_death(self, event: dict) -> None:
        kind = "hung" if event.get("kind") == "hung" else "death"
        self.storage.write_json(
            self.path(EVENTS, f"engine-{kind}-{time.time():.3f}-{event['actor_id'][:12]}.json"), event
        )

    def engine_death_files(self, since: float = 0.0) -> dict[str, float]:
        """The files of engine deaths and hangs recorded after `since` (Unix time): one listing; uri -> when."""
        times = {
            u: float(u.rsplit("/", 1)[1].split("-")[2]) for u in self.storage.list_files(self.path(EVENTS), ".json")
        }
        return {uri: at for uri, at in times.items() if at >= since}

    def engine_deaths(self, since: float = 0.0) -> list[dict]:
        """Engine deaths and hangs recorded by the actors, oldest first; those after `since` (Unix time)."""
        return self.read_all(self.storage.read_json, list(self.engine_death_files(since)))

    def write_progress(self, progress: dict) -> None:
        """`_progress.json`, while this run holds the lease."""
        if self.holder is not None:
            self.holder()
        self.storage.write_json(self.path(PROGRESS), progress)

    def clear_progress(self) -> None:
        """A finished job's `_progress.json` goes: it said what a running attempt's engines were doing."""
        self.storage.delete(self.path(PROGRESS))

    def read_progress(self) -> Optional[dict]:
        """`_progress.json` (one GET), or None when there is none."""
        try:
            return self.storage.read_json(self.path(PROGRESS))
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------ the location as a whole

    def clear(self) -> None:
        """Start over: remove everything a previous job wrote here (bulk deletes)."""
        for name in (*ROW_TABLES, STATS, COMMITS, ATTEMPTS, EVENTS, GROUPED, "report"):
            self.storage.delete(self.path(name), recursive=True)
        self.storage.delete(self.path(MANIFEST))
        self.storage.delete(self.path(PROGRESS))

    def has_manifest(self) -> bool:
        return self.storage.exists(self.path(MANIFEST))

    def write_manifest(self, manifest: dict) -> None:
        """`_job.json`, as written by the run that holds the lease. A run that lost the location
        to this one may have recorded its own attempt as `fenced` since: that record stays, and
        goes into `manifest`. Written only while the lease is this run's: a run that lost it
        cannot replace the owner's."""

        def merged(current: Optional[dict]) -> dict:
            attempts = current.get("attempts", []) if current else []
            fenced = {a["number"]: a for a in attempts if a.get("status") == "fenced"}
            if self.holder is not None:
                self.holder()
            manifest["attempts"] = [fenced.get(a["number"], a) for a in manifest.get("attempts", [])]
            return manifest

        self._update_manifest(merged)

    def record_fenced_attempt(self, attempt: dict) -> None:
        """A run that lost the location: its own attempt's record into `_job.json`, the rest as
        the owner wrote it. Nothing when the new owner started over (--restart)."""

        def merged(current: Optional[dict]) -> Optional[dict]:
            if current is None:
                return None
            others = [a for a in current.get("attempts", []) if a["number"] != attempt["number"]]
            return {**current, "attempts": sorted([*others, attempt], key=lambda a: a["number"])}

        self._update_manifest(merged)

    def _update_manifest(self, update: Callable[[Optional[dict]], Optional[dict]]) -> None:
        """`_job.json` replaced by `update(what it holds now)` (None: not there; returning None:
        nothing to write), a compare-and-swap on the version read, read again if a write came between."""
        while True:
            try:
                data, version = self.storage.read_versioned(self.path(MANIFEST))
                current = json.loads(data)
            except FileNotFoundError:
                version, current = None, None
            doc = update(current)
            if doc is None:
                return
            try:
                self.storage.write_if(self.path(MANIFEST), json_bytes(doc), version)
                return
            except PreconditionFailed:
                continue

    def read_manifest(self) -> dict:
        return self.storage.read_json(self.path(MANIFEST))

    def job_manifest(self, same_layout: bool = True) -> Optional[JobManifest]:
        """`_job.json` as the contract reads it; None when no job has written one here.
        `same_layout`: refuse a location of another output layout (a run, status); a report
        reads the manifest's figures whatever the layout."""
        try:
            doc = self.read_manifest()
        except FileNotFoundError:
            return None
        layout = doc.get("layout_version", 1) if isinstance(doc, dict) else None
        if same_layout and layout != LAYOUT_VERSION:
            raise LayoutMismatch(
                f"{self.uri} was written by output layout {layout}; this specbatch writes layout {LAYOUT_VERSION} "
                "and never mixes the two. Use a new output_uri, or rerun with --restart to start over."
            )
        try:
            return JobManifest.model_validate(doc)
        except ValidationError as exc:
            fields = ", ".join(".".join(str(p) for p in e["loc"]) + f" ({e['msg']})" for e in exc.errors()[:5])
            raise ManifestInvalid(f"{self.uri}: _job.json does not match the job manifest contract: {fields}") from None


def latest_per_unit(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    """Stats files' rows, oldest file first, with each unit once: a unit in two files (a later
    attempt ran it again) counts from the later one."""
    rolled = pa.concat_tables(tables) if tables else schema.empty_table()
    if len(tables) < 2:
        return rolled
    latest = {unit: i for i, unit in enumerate(rolled.column("unit_id").to_pylist())}
    return rolled.take(pa.array(sorted(latest.values()), type=pa.int64()))
