"""The output location's commit protocol, on local files and on moto S3: a marker decides
what is visible, a unit committed twice (late, from another process, or with fewer tables)
is visible once, cleanup removes what no marker names, stats count each unit once, and a
resume reads no output file."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from collections import Counter

import pyarrow as pa
import pytest

from pipeline.commit.outputs import CLOCK_SKEW_SECONDS, OutputLocation
from pipeline.stages.stats import error_units
from pipeline.storage import Storage
from schemas import UnitStats
from tests.conftest import record_s3_requests


def stats(unit_id: str, rows: int, outputs: int) -> UnitStats:
    return UnitStats(
        unit_id=unit_id,
        source="in.parquet",
        first_row=0,
        actor_id="a",
        node_id="n",
        rows=rows,
        output_rows=outputs,
        error_rows=rows - outputs,
        prompt_tokens=rows,
        generated_tokens=outputs,
        started_at=0.0,
        wall_seconds=1.0,
        engine_seconds=1.0,
        tokens_per_second=1.0,
        speculative=False,
        num_speculative_tokens=0,
        num_drafts=0,
        draft_tokens=0,
        accepted_tokens=0,
        acceptance_rate=None,
        mean_acceptance_length=None,
        accepted_per_position=[],
    )


def tables(ids: list[str], failed: set[str] = frozenset()) -> dict[str, pa.Table]:
    ok = [i for i in ids if i not in failed]
    bad = [i for i in ids if i in failed]
    return {
        "outputs": pa.table({"id": ok, "text": ["x"] * len(ok)}),
        "errors": pa.table({"id": bad, "message": ["bad"] * len(bad)}),
    }


def commit_unit(location: OutputLocation, unit: str, ids: list[str], failed: set[str] = frozenset()):
    return location.commit(unit, tables(ids, failed), stats(unit, len(ids), len(ids) - len(failed)))


def visible_ids(location):
    landed = []
    for name in ("outputs", "errors"):
        table = location.read_table(name)
        landed += table.column("id").to_pylist() if table.num_rows else []
    return Counter(landed)


def files(location) -> list[str]:
    return location.storage.list_files(location.path("outputs")) + location.storage.list_files(location.path("errors"))


def test_a_unit_without_its_marker_is_invisible_and_cleaned_up(location):
    commit_unit(location, "u1", ["a", "b"])
    location.write_files("u2", tables(["c", "d"]), stats("u2", 2, 2))  # died before its marker
    assert visible_ids(location) == Counter(["a", "b"])
    assert location.committed_units() == {"u1"}
    assert location.cleanup() == 1
    assert len(files(location)) == 1 and visible_ids(location) == Counter(["a", "b"])


def test_cleanup_keeps_what_a_fenced_writer_wrote_during_the_attempt(location):
    """At the end of the attempt of lease generation 3: a file no marker names written before
    the attempt started is a dead commit, and one of generation 3 is this run's own (its
    engines have stopped), so both go; one of generation 2 written after the start may be a
    fenced run's, about to publish its marker, so it stays until a later attempt's cleanup.
    The store's own clock stamps the files (moto: whole seconds), hence the 2 s between."""
    commit_unit(location, "u1", ["a"])
    location.write_files("u2", tables(["b"]), stats("u2", 1, 1), generation=1)  # died before this attempt
    time.sleep(2.1)
    started = time.time() - 1 + CLOCK_SKEW_SECONDS  # cleanup allows the store's clock that much error
    location.write_files("u3", tables(["c"]), stats("u3", 1, 1), generation=3)  # this run's, died
    fenced = location.write_files("u4", tables(["d"]), stats("u4", 1, 1), generation=2).files["outputs"]
    committed = [location.path(location.markers()["u1"].files["outputs"])]
    assert location.cleanup(since=started, generation=3) == 2
    assert files(location) == sorted(committed + [location.path(fenced)])
    assert location.cleanup(since=time.time() + CLOCK_SKEW_SECONDS + 2, generation=4) == 1  # a later attempt's
    assert files(location) == committed


def test_a_retry_with_fewer_tables_leaves_no_id_visible_twice(location):
    ids = ["a", "b", "c"]
    first = commit_unit(location, "u1", ids, failed={"c"})  # attempt 1: c failed
    second = commit_unit(location, "u1", ids)  # attempt 2: everything generated, no errors/ file
    assert set(first.files) == {"outputs", "errors"} and set(second.files) == {"outputs"}
    assert visible_ids(location) == Counter(ids)
    assert location.cleanup() == 2  # attempt 1's outputs and errors files
    assert [f.rsplit("/", 1)[1] for f in files(location)] == [second.files["outputs"].rsplit("/", 1)[1]]
    assert visible_ids(location) == Counter(ids)


def _commit_in_process(storage: Storage, uri: str, unit: str, ids: list[str], failed: list[str], wrote, go, published):
    """In its own process: write the unit's files, wait for `go`, then publish its marker."""
    location = OutputLocation(storage, uri)
    marker = location.write_files(unit, tables(ids, set(failed)), stats(unit, len(ids), len(ids) - len(failed)))
    wrote.set()
    go.wait(60)
    location.publish(marker)
    published.set()


@pytest.mark.parametrize("late_fails", [True, False])
def test_the_same_unit_committed_from_two_processes_one_late(location, late_fails):
    """Process A writes its files first and publishes last (a late actor); process B commits
    in between. Their results differ (one of them failed a row): whichever marker is last,
    each id is visible exactly once, from that commit alone, and cleanup keeps its files."""
    ids = [f"id-{i}" for i in range(6)]
    ctx = multiprocessing.get_context("spawn")
    events = [ctx.Event() for _ in range(6)]
    a_wrote, a_go, a_done, b_wrote, b_go, b_done = events
    a = ctx.Process(
        target=_commit_in_process,
        args=(location.storage, location.uri, "u1", ids, ["id-2"] if late_fails else [], a_wrote, a_go, a_done),
    )
    b = ctx.Process(
        target=_commit_in_process,
        args=(location.storage, location.uri, "u1", ids, [] if late_fails else ["id-2"], b_wrote, b_go, b_done),
    )
    a.start()
    assert a_wrote.wait(120)
    b.start()
    assert b_wrote.wait(120)
    b_go.set()
    assert b_done.wait(60)
    a_go.set()  # A's marker lands last
    assert a_done.wait(60)
    a.join(), b.join()
    assert a.exitcode == b.exitcode == 0
    assert visible_ids(location) == Counter(ids)
    errors = location.read_table("errors")
    assert (errors.column("id").to_pylist() if errors.num_rows else []) == (["id-2"] if late_fails else [])
    location.cleanup()
    (marker,) = location.markers().values()
    assert sorted(files(location)) == sorted(location.path(f) for f in marker.files.values())
    assert visible_ids(location) == Counter(ids)


def test_stats_count_each_committed_unit_once(location):
    commit_unit(location, "u1", ["a", "b"])
    commit_unit(location, "u2", ["c"])
    heard = [m.stats.model_dump() for m in location.markers().values()]
    location.write_stats(1, heard[:1])  # written while attempt 1 ran; then it was killed
    commit_unit(location, "u3", ["d", "e", "f"])  # committed by a late actor, heard by nobody
    table = location.write_stats(2, [], location.committed_units())  # attempt 2 finishes
    assert sorted(table.column("unit_id").to_pylist()) == ["u1", "u2", "u3"]
    assert sum(table.column("rows").to_pylist()) == 6
    # the files on their own hold each committed unit exactly once
    units = []
    for uri in location.storage.list_files(location.path("stats"), ".parquet"):
        units += location.storage.read_parquet(uri).column("unit_id").to_pylist()
    assert Counter(units) == Counter(["u1", "u2", "u3"])
    assert sorted(location.stats_table().column("unit_id").to_pylist()) == ["u1", "u2", "u3"]


def test_planning_a_resume_reads_no_output_file(s3_endpoint, monkeypatch):
    """What a resume reads of the output location: listings of _commits/, nothing else.
    Every S3 request s3fs sends is recorded (its one entry point, _call_s3)."""
    location = OutputLocation(Storage(endpoint_url=s3_endpoint), "s3://specbatch/resume-reads")
    for u in range(30):
        commit_unit(location, f"u{u:03d}", [f"{u}-{i}" for i in range(4)], failed={f"{u}-0"})
    calls = record_s3_requests(monkeypatch)
    assert len(location.committed_units()) == 30
    reads = [(m, k) for m, k in calls if m in ("get_object", "head_object")]
    assert not [k for _, k in reads if "/outputs/" in k or "/errors/" in k or k.endswith(".parquet")], reads
    assert {m for m, _ in calls} <= {"list_objects_v2", "head_object"}, calls


def test_units_with_errors_to_run_again_come_from_the_stats_not_the_output_files(location):
    """A rerun runs again the units with retryable error rows; --retry-errors, every unit with
    error rows. Both are found in the stats (files and markers), without opening errors/."""
    commit_unit(location, "clean", ["a", "b"])
    commit_unit(location, "final", ["c", "d"], failed={"d"})
    retryable = stats("retry", 2, 1).model_copy(update={"retryable_error_rows": 1})
    location.commit("retry", tables(["e", "f"], {"f"}), retryable)
    committed = location.committed_units()
    assert error_units(location.stats_table(committed), retryable_only=True) == {"retry"}  # as plan_job reads them
    assert error_units(location.stats_table(committed), retryable_only=False) == {"final", "retry"}


def test_a_small_read_on_s3_is_one_get(s3_endpoint, monkeypatch):
    """Markers, manifests and leases are read whole: one GET each, no size check first."""
    storage = Storage(endpoint_url=s3_endpoint)
    uri = "s3://specbatch/one-get/_job.json"
    storage.write_json(uri, {"status": "running"})
    calls = record_s3_requests(monkeypatch)
    assert json.loads(storage.read_bytes(uri)) == {"status": "running"}
    assert [m for m, _ in calls] == ["get_object"]


def test_reading_an_output_location_starts_no_arrow_thread(tmp_path):
    """What status, report and export read decodes on the calling thread: a process that has
    started Arrow's thread pool now and then aborts at exit after its work is done
    (SIGABRT, "terminate called without an active exception"; apache/arrow issue 34314).
    A fresh process, so that no earlier test has started that pool."""
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    for n in range(3):
        commit_unit(location, f"u{n}", [f"{n}-{i}" for i in range(2000)], failed={f"{n}-7"})
    location.write_stats(1, [], location.committed_units())
    script = f"""
import json, os
from pipeline.commit.outputs import OutputLocation
from pipeline.storage import Storage
threads = lambda: len(os.listdir("/proc/self/task"))
location = OutputLocation(Storage(), {location.uri!r})
before = threads()
rows = [location.read_table(name).num_rows for name in ("outputs", "errors", "stats")]
print(json.dumps({{"rows": rows, "threads_started": threads() - before}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == {"rows": [5997, 3, 3], "threads_started": 0}, done.stdout
