"""The output location: its layout, the per-batch commit, and reading committed data back.

    OUTPUT_URI/
      outputs/<batch_id>.parquet   generated rows              (schemas.OutputRow)
      errors/<batch_id>.parquet    failed rows with reasons    (schemas.ErrorRow)
      stats/<batch_id>.parquet     one row per batch           (schemas.BatchStats)
      _commits/<batch_id>.json     commit marker, written last
      */part-<hash>.parquet        compacted batches, with _commits/part-<hash>.json
      _attempts/<batch_id>/...     how often a batch (or, in isolation, a row) was started
      _job.json                    job manifest                (schemas.JobManifest)

A batch's files count only once its commit marker exists, so a batch that died half-written
is invisible; batch ids are derived from the batch's input ids, so a retried batch replaces
its files instead of adding new ones.
"""

from __future__ import annotations

import hashlib
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import numpy as np
import pyarrow as pa

from pipeline.inputs import id_digests
from pipeline.storage import Storage

TABLE_DIRS = ("outputs", "errors", "stats")
COMMITS = "_commits"
ATTEMPTS = "_attempts"
MANIFEST = "_job.json"
PART_PREFIX = "part-"
# Reads of many small objects (markers, per-batch files) go out this many at a time: a resume
# of a job with 100k committed batches must not wait on 100k sequential round trips.
PARALLEL_READS = 16
T = TypeVar("T")


def batch_id_for(ids: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for value in sorted(ids):
        digest.update(value.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:24]


class OutputLocation:
    def __init__(self, storage: Storage, uri: str):
        self.storage = storage
        self.uri = uri.rstrip("/")

    def path(self, *parts: str) -> str:
        return self.storage.join(self.uri, *parts)

    @staticmethod
    def _read_all(read: Callable[[str], T], uris: list[str]) -> list[T]:
        if len(uris) < 2:
            return [read(uri) for uri in uris]
        with ThreadPoolExecutor(PARALLEL_READS) as pool:
            return list(pool.map(read, uris))

    def commit(self, batch_id: str, tables: dict[str, pa.Table]) -> None:
        """Write a batch's tables, then its marker: visible together or not at all."""
        written = {}
        for name in TABLE_DIRS:
            table = tables.get(name)
            if table is not None and table.num_rows:
                self.storage.write_parquet(self.path(name, f"{batch_id}.parquet"), table)
                written[name] = table.num_rows
        self.storage.write_json(self.path(COMMITS, f"{batch_id}.json"), {"batch_id": batch_id, "rows": written})

    def _markers(self) -> tuple[set[str], dict[str, list[str]]]:
        """(committed batch ids with their own files, part id -> batch ids it holds)."""
        batches, part_uris = set(), {}
        for uri in self.storage.list_files(self.path(COMMITS), ".json"):
            name = posixpath.basename(uri)[: -len(".json")]
            if name.startswith(PART_PREFIX):
                part_uris[name] = uri
            else:
                batches.add(name)
        markers = self._read_all(self.storage.read_json, list(part_uris.values()))
        return batches, {name: marker["batches"] for name, marker in zip(part_uris, markers)}

    def committed_batches(self) -> set[str]:
        batches, parts = self._markers()
        return batches.union(*parts.values())

    def _visible_files(self, name: str, markers=None) -> list[str]:
        """Files of a table that count: committed parts, and committed batch files that no
        part holds yet (compaction may have stopped between its marker and its deletes)."""
        batches, parts = markers or self._markers()
        in_parts = set().union(*parts.values())
        visible = (set(parts) | batches) - in_parts
        return [
            uri for uri in self.storage.list_files(self.path(name), ".parquet")
            if posixpath.basename(uri)[: -len(".parquet")] in visible
        ]

    def read_table(self, name: str, columns: list[str] | None = None, markers=None) -> pa.Table:
        """All committed rows of outputs, errors or stats (an empty table if none); `markers`
        from `_markers()` when the caller reads several tables of one state."""
        tables = self._read_all(lambda uri: self.storage.read_parquet(uri, columns), self._visible_files(name, markers))
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def compact(self, rows_per_file: int) -> int:
        """Merge committed per-batch files into parts of about `rows_per_file` output rows.
        Parts are written, then their marker, then the batch files are deleted; a reader
        sees every row exactly once at each step. Returns how many parts were written."""
        batches, parts = self._markers()
        held = batches.intersection(set().union(*parts.values()))
        for bid in held:  # an earlier compaction stopped before deleting these: finish it
            self._delete_batch(bid, TABLE_DIRS)
        batches -= held
        # A marker lists the tables its batch wrote (empty ones are not written): no
        # existence checks, one request fewer per table and batch on an object store.
        ordered = sorted(batches)
        markers = self._read_all(self.storage.read_json, [self.path(COMMITS, f"{bid}.json") for bid in ordered])
        written_tables = {bid: marker["rows"] for bid, marker in zip(ordered, markers)}
        groups, group, rows = [], [], 0
        for bid, tables in written_tables.items():
            n = sum(tables.values())
            if group and rows + n > rows_per_file:
                groups.append(group)
                group, rows = [], 0
            group.append(bid)
            rows += n
        groups.append(group)
        written = 0
        for group in (g for g in groups if len(g) > 1):
            part = PART_PREFIX + batch_id_for(group)
            counts = {}
            for name in TABLE_DIRS:
                tables = self._read_all(
                    self.storage.read_parquet, [self.path(name, f"{bid}.parquet") for bid in group if name in written_tables[bid]]
                )
                if tables:
                    merged = pa.concat_tables(tables, promote_options="permissive")
                    self.storage.write_parquet(self.path(name, f"{part}.parquet"), merged)
                    counts[name] = merged.num_rows
            self.storage.write_json(self.path(COMMITS, f"{part}.json"), {"batches": group, "rows": counts})
            for bid in group:
                self._delete_batch(bid, written_tables[bid])
            written += 1
        return written

    def _delete_batch(self, batch_id: str, tables: Iterable[str]) -> None:
        """A compacted batch's own files, its marker last."""
        for name in tables:
            self.storage.delete(self.path(name, f"{batch_id}.parquet"))
        self.storage.delete(self.path(COMMITS, f"{batch_id}.json"))

    def committed_id_digests(self) -> np.ndarray:
        """Sorted digests of every id already in outputs/ or errors/: what a resumed job skips."""
        ids, markers = [], self._markers()
        for name in ("outputs", "errors"):
            table = self.read_table(name, columns=["id"], markers=markers)
            if table.num_rows:
                ids += table.column("id").to_pylist()
        return np.sort(id_digests(ids)) if ids else np.array([], dtype="S16")

    def start_attempt(self, batch_id: str, row: str | None = None) -> int:
        """Record that a batch (or one row of it) is being started; returns how many earlier
        starts never finished (a process that died mid-batch leaves its count behind)."""
        uri = self.path(ATTEMPTS, batch_id, f"{row or 'batch'}.json")
        before = self.storage.read_json(uri)["started"] if self.storage.exists(uri) else 0
        self.storage.write_json(uri, {"started": before + 1})
        return before

    def finish_attempt(self, batch_id: str, row: str | None = None) -> None:
        self.storage.delete(self.path(ATTEMPTS, batch_id, f"{row or 'batch'}.json"))

    def clear(self) -> None:
        """Start over: remove everything a previous job wrote here."""
        for name in (*TABLE_DIRS, COMMITS, ATTEMPTS, "report"):
            self.storage.delete(self.path(name), recursive=True)
        self.storage.delete(self.path(MANIFEST))

    def has_manifest(self) -> bool:
        return self.storage.exists(self.path(MANIFEST))

    def write_manifest(self, manifest: dict) -> None:
        self.storage.write_json(self.path(MANIFEST), manifest)

    def read_manifest(self) -> dict:
        return self.storage.read_json(self.path(MANIFEST))
