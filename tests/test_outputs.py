"""The output location's commit protocol and compaction, on local files and on moto S3."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from pipeline.outputs import OutputLocation, batch_id_for
from pipeline.storage import Storage


def commit_batches(location: OutputLocation, n_batches: int, rows: int) -> list[str]:
    ids = []
    for b in range(n_batches):
        batch = [f"b{b}-{i}" for i in range(rows)]
        bid = batch_id_for(batch)
        location.commit(bid, {
            "outputs": pa.table({"id": batch[1:], "text": ["x"] * (rows - 1)}),
            "errors": pa.table({"id": batch[:1], "message": ["bad"]}),
            "stats": pa.table({"batch_id": [bid], "rows": [rows]}),
        })
        ids += batch
    return ids


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path, s3_endpoint):
    if request.param == "local":
        return OutputLocation(Storage(), str(tmp_path / "out"))
    return OutputLocation(Storage(endpoint_url=s3_endpoint), f"s3://specbatch/compact-{tmp_path.name}")


def visible_ids(location):
    return location.read_table("outputs").column("id").to_pylist() + location.read_table("errors").column("id").to_pylist()


def test_uncommitted_batch_is_invisible(location):
    commit_batches(location, 1, 4)
    location.storage.write_parquet(location.path("outputs", "half-written.parquet"), pa.table({"id": ["ghost"], "text": ["x"]}))
    assert "ghost" not in visible_ids(location)


def test_compaction_merges_files_and_keeps_every_row_once(location):
    ids = commit_batches(location, 7, 5)
    batches = location.committed_batches()
    assert location.compact(rows_per_file=12) == 3  # 7 batches of 5 rows -> parts of 2, 2, 2 (+1 left alone)
    assert Counter(visible_ids(location)) == Counter(ids)
    assert location.committed_batches() == batches
    assert len(location.storage.list_files(location.path("outputs"), ".parquet")) == 4
    assert sum(location.read_table("stats").column("rows").to_pylist()) == len(ids)
    assert location.compact(rows_per_file=12) == 0  # idempotent


def test_compaction_interrupted_after_its_marker_still_reads_once(location):
    ids = commit_batches(location, 4, 3)
    first = sorted(location.committed_batches())[0]
    leftover = location.read_table("outputs").filter(pa.compute.is_in(
        location.read_table("outputs").column("id"), value_set=pa.array([i for i in ids if i.startswith("b0-")])
    ))
    location.compact(rows_per_file=100)
    # As if the deletes had not happened: the batch's own file and marker are back.
    location.storage.write_parquet(location.path("outputs", f"{first}.parquet"), leftover)
    location.storage.write_json(location.path("_commits", f"{first}.json"), {"batch_id": first, "rows": {}})
    assert Counter(visible_ids(location)) == Counter(ids)
    # The next compaction finishes the deletes instead of merging the batch a second time.
    assert location.compact(rows_per_file=100) == 0
    assert Counter(visible_ids(location)) == Counter(ids)
    assert not location.storage.exists(location.path("outputs", f"{first}.parquet"))
    assert not location.storage.exists(location.path("_commits", f"{first}.json"))
