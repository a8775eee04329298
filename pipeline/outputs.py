"""The output location: its layout, the per-batch commit, and reading committed data back.

    OUTPUT_URI/
      outputs/<batch_id>.parquet   generated rows              (schemas.OutputRow)
      errors/<batch_id>.parquet    failed rows with reasons    (schemas.ErrorRow)
      stats/<batch_id>.parquet     one row per batch           (schemas.BatchStats)
      _commits/<batch_id>.json     commit marker, written last
      _job.json                    job manifest                (schemas.JobManifest)

A batch's files count only once its commit marker exists, so a batch that died half-written
is invisible; batch ids are derived from the batch's input ids, so a retried batch replaces
its files instead of adding new ones.
"""

from __future__ import annotations

import hashlib
import posixpath
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage import Storage

TABLE_DIRS = ("outputs", "errors", "stats")
COMMITS = "_commits"
MANIFEST = "_job.json"


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

    def commit(self, batch_id: str, tables: dict[str, pa.Table]) -> None:
        """Write a batch's tables, then its marker: visible together or not at all."""
        written = {}
        for name in TABLE_DIRS:
            table = tables.get(name)
            if table is not None and table.num_rows:
                self.storage.write_parquet(self.path(name, f"{batch_id}.parquet"), table)
                written[name] = table.num_rows
        self.storage.write_json(self.path(COMMITS, f"{batch_id}.json"), {"batch_id": batch_id, "rows": written})

    def committed_batches(self) -> set[str]:
        return {posixpath.basename(p)[: -len(".json")] for p in self.storage.list_files(self.path(COMMITS), ".json")}

    def read_table(self, name: str) -> pa.Table:
        """All committed rows of outputs, errors or stats (an empty table if none)."""
        committed = self.committed_batches()
        tables = []
        for uri in self.storage.list_files(self.path(name), ".parquet"):
            if posixpath.basename(uri)[: -len(".parquet")] in committed:
                fs, path = self.storage.fs(uri)
                with fs.open(path, "rb") as f:
                    tables.append(pq.read_table(f))
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def write_manifest(self, manifest: dict) -> None:
        self.storage.write_json(self.path(MANIFEST), manifest)

    def read_manifest(self) -> dict:
        return self.storage.read_json(self.path(MANIFEST))
