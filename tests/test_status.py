"""`specbatch status`: one small real job (local Ray, the random kit, a few bad rows; the
session's `random_kit_job`, which test_guard.py reads too), read back
finished, as a running job whose driver is gone or alive (the state such a job leaves, made
from the finished one with the project's own manifest and lease code), from moto S3, and where
no job has run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import s3fs
from fsspec.asyn import sync_wrapper

from pipeline.cli import main as cli_main
from pipeline.commit.lease import OutputLease
from pipeline.commit.outputs import OutputLocation
from pipeline.config import LeaseConfig
from pipeline.job.console import prefill_text, summary
from pipeline.storage import Storage
from pipeline.tools.status import job_status, main
from schemas import JobManifest
from schemas.status import StatusReport
from tests.conftest import RANDOM_JOB_BAD as BAD
from tests.conftest import RANDOM_JOB_BLOCK_SIZE
from tests.conftest import RANDOM_JOB_ERRORS as EXPECTED_KINDS
from tests.conftest import RANDOM_JOB_ROWS as ROWS
from tests.conftest import record_s3_requests


@pytest.fixture(scope="module")
def job(random_kit_job):
    """The session's small job on the random kit (tests/conftest.py): 28 rows in 4 units, 4 of
    them bad, one in each unit."""
    root, manifest, _ = random_kit_job
    return root, manifest


# the session's Ray forwards its workers' log lines to this stdout whenever they come, each
# line prefixed with its process: "\x1b[36m(MapWorker(MapBatches(EngineStage)) pid=21530)\x1b[0m ..."
RAY_FORWARDED = re.compile(r"^(?:\x1b\[[0-9;]*m)?\((?:.*? )?pid=\d+\)")


def status_out(capsys) -> str:
    return "".join(line for line in capsys.readouterr().out.splitlines(keepends=True) if not RAY_FORWARDED.match(line))


def status_json(capsys, *argv: str) -> StatusReport:
    assert main([*argv, "--json"]) == 0
    return StatusReport.model_validate_json(status_out(capsys))


def status_text(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return status_out(capsys)


def assert_text_agrees(text: str, r: StatusReport) -> None:
    assert f"job {r.job_id} at {r.output_uri}: {r.status}" in text
    assert f"attempts:  {r.attempts}; the last, {r.last_attempt.number}: started {r.last_attempt.started_at}" in text
    assert f"rows:      {r.rows_done:,} of {r.input_rows:,} done" in text
    assert f"{r.output_rows:,} generated, {r.error_rows:,} errors" in text
    assert f"units:     {r.units_committed:,} of {r.units_planned:,} committed" in text
    assert "errors:    " + ", ".join(f"{k} {n:,}" for k, n in r.errors_by_kind.items()) in text
    assert f"acceptance: rate {r.acceptance_rate:.3f}, mean acceptance length {r.mean_acceptance_length:.2f}" in text
    assert f"generated: {r.generated_tokens:,} tokens, {r.tokens_per_second:,.1f} tok/s of wall time" in text
    assert (
        f"prefill:   {r.prompt_tokens:,} prompt tokens ({prefill_text(r.prompt_tokens, r.cached_prompt_tokens)})"
        in text
    )
    assert r.engine_tokens_per_second > r.tokens_per_second  # the engine's own speed, start-up excluded
    assert f"engines:   {r.engine_tokens_per_second:,.1f} tok/s of engine time" in text
    assert r.engine_busy_share is not None and 0 < r.engine_busy_share <= 1
    assert f"engines busy {r.engine_busy_share:.0%} of the billed time" in text
    for note in r.notes:  # an age ("0 s ago") is read off the clock at each call: the text's may be a tick later
        assert re.search(any_age(note), text), (note, text)


def any_age(note: str) -> str:
    """`note` as a pattern in which each age ("0 s ago", "for 15 min") may be any number."""
    parts = re.split(r"(\d+(?= (?:s|min)\b))", note)
    return "".join(r"\d+" if i % 2 else re.escape(part) for i, part in enumerate(parts))


@pytest.mark.engine
def test_a_finished_job_as_its_manifest_and_outputs_say(job, capsys):
    root, manifest = job
    out = str(root / "out")
    location = OutputLocation(Storage(), out)
    doc = JobManifest.model_validate(location.read_manifest())
    r = status_json(capsys, out)
    assert (r.job_id, r.status, r.driver, r.attempts, r.lease) == (doc.job_id, "succeeded", "none", 1, None)
    assert r.last_attempt.model_dump() == doc.attempts[0].model_dump(
        include={"number", "status", "started_at", "ended_at", "error"}
    )
    outputs, errors = location.read_table("outputs"), location.read_table("errors")
    assert r.input_rows == r.rows_done == ROWS == doc.totals.input_rows
    assert r.output_rows == len(set(outputs.column("id").to_pylist())) == doc.totals.output_rows == ROWS - len(BAD)
    assert r.error_rows == errors.num_rows == len(BAD)
    assert r.errors_by_kind == dict(Counter(errors.column("error_kind").to_pylist())) == EXPECTED_KINDS
    assert r.errors_by_kind_complete and r.error_units == r.error_units_read == 4
    assert r.units_committed == r.units_planned == len(location.committed_units()) == 4
    assert (
        r.acceptance_rate is not None and r.acceptance_rate == doc.totals.acceptance_rate
    )  # the random drafter drafts
    assert r.mean_acceptance_length == doc.totals.mean_acceptance_length
    assert r.generated_tokens == doc.totals.generated_tokens > 0 and r.tokens_per_second == doc.totals.tokens_per_second
    assert r.counts_from == "manifest" and r.eta_seconds is None and r.notes == []
    assert_prefix_cache_counted(location, doc)
    assert (r.prompt_tokens, r.cached_prompt_tokens) == (doc.totals.prompt_tokens, doc.totals.cached_prompt_tokens)
    assert r.prefix_cache_hit_rate == doc.totals.prefix_cache_hit_rate
    text = status_text(capsys, out)
    assert_text_agrees(text, r)
    assert "lease:     none" in text and "ETA" not in text and "WARNING" not in text

    partial = job_status(Storage(), out, error_files=1)  # one error file of three: said so, not scaled
    assert (partial.error_units, partial.error_units_read, partial.errors_by_kind_complete) == (4, 1, False)
    assert sum(partial.errors_by_kind.values()) == 1 and "from 1 of the 4 units with error rows" in partial.notes[0]


def assert_prefix_cache_counted(location: OutputLocation, doc: JobManifest) -> None:
    """The good rows share a long header: units that came after its first prefill found it in
    vLLM's prefix cache, in whole blocks; the totals, the console's summary say so."""
    stats = location.read_table("stats").to_pylist()
    assert all(0 <= u["cached_prompt_tokens"] <= u["prompt_tokens"] for u in stats)
    assert all(
        u["cached_prompt_tokens"] % RANDOM_JOB_BLOCK_SIZE == 0 for u in stats
    )  # each request's hit is whole blocks
    t = doc.totals
    assert t.prompt_tokens == sum(u["prompt_tokens"] for u in stats)
    assert t.cached_prompt_tokens == sum(u["cached_prompt_tokens"] for u in stats) > 0
    assert 0 < t.prefix_cache_hit_rate == t.cached_prompt_tokens / t.prompt_tokens < 1
    computed = t.prompt_tokens - t.cached_prompt_tokens
    assert (
        f"from {t.prompt_tokens:,} prompt tokens ({t.cached_prompt_tokens:,} from the prefix cache, "
        f"{t.prefix_cache_hit_rate:.0%}; {computed:,} computed)"
    ) in summary(doc)[2]


def running_copy(job, dest: Path, heartbeat_age: float) -> tuple[OutputLocation, JobManifest]:
    """What a running job leaves: the job's output copied (the markers keep their write times),
    its manifest back to running, the last two units not committed yet (their marker, files and
    stats row gone), no `_progress.json` (a live driver's would be seconds old), a lease whose last
    heartbeat was `heartbeat_age` seconds ago."""
    root, _ = job
    shutil.copytree(root / "out", dest)
    location = OutputLocation(Storage(), str(dest))
    manifest = JobManifest.model_validate(location.read_manifest())
    attempt = manifest.attempts[-1]
    manifest.status, manifest.ended_at = "running", None
    attempt.status, attempt.ended_at, attempt.wall_seconds = "running", None, 0.0
    location.write_manifest(manifest.model_dump(mode="json"))
    (dest / "_progress.json").unlink(missing_ok=True)

    stats_uri = location.path("stats", "attempt-0001.parquet")
    stats = location.storage.read_parquet(stats_uri).sort_by("unit_id")
    kept, dropped = stats.slice(0, 2), stats.slice(2)
    location.storage.write_parquet(stats_uri, kept)
    markers = location.markers(dropped.column("unit_id").to_pylist())
    for unit, marker in markers.items():
        for path in marker.files.values():
            location.storage.delete(location.path(path))
        location.storage.delete(location.path("_commits", f"{unit}.json"))

    lease = OutputLease(
        location, LeaseConfig(heartbeat_seconds=30, stale_after_seconds=180), manifest.job_id, attempt.number
    )
    beat = lease.lease.model_copy(update={"heartbeat_at": time.time() - heartbeat_age})
    location.storage.write_json(lease.uri, beat.model_dump(mode="json"))
    return location, manifest


@pytest.mark.engine
def test_a_running_job_whose_driver_is_gone(job, tmp_path, capsys):
    root, _ = job
    location, manifest = running_copy(job, tmp_path / "out", heartbeat_age=15 * 60)
    r = status_json(capsys, location.uri)
    assert (r.status, r.driver, r.counts_from) == ("running", "gone", "commits")
    assert r.lease.stale and r.lease.heartbeat_age_seconds == pytest.approx(15 * 60, abs=30)
    assert (
        r.notes[0]
        == "no heartbeat for 15 min: the driver is probably gone; `specbatch run CONFIG` takes over and resumes"
    )
    assert (r.units_committed, r.units_planned, r.input_rows) == (2, 4, ROWS)
    errors = location.read_table("errors")  # the errors of the units still committed
    assert r.rows_done == 16 and r.error_rows == errors.num_rows
    assert r.errors_by_kind == dict(Counter(errors.column("error_kind").to_pylist()))
    # two units of a window of 2 (one replica, 2 units in flight): the pace needs one more
    assert (r.rows_per_second, r.eta_seconds, r.eta_at, r.pace_units, r.units_before_pace) == (None, None, None, 2, 1)
    assert r.acceptance_rate is not None and r.stats_as_of and r.markers_read == 0
    assert r.last_commit_at and r.warnings == []  # a gone driver's engines are not looked at

    text = status_text(capsys, location.uri)
    assert_text_agrees(text, r)
    assert (
        "WARNING: no heartbeat for 15 min: the driver is probably gone; `specbatch run CONFIG` takes over and resumes"
        in text
    )
    assert "ETA:       after the next unit commits" in text and "STALE" in text  # 2 of 4 units left

    # with the job's config, the resume command names it (the output location is not the config's: it says so)
    config = str(root / "job.yaml")
    r = status_json(capsys, location.uri, "--config", config)
    assert r.notes[0].endswith(f"`specbatch run {config} --output-uri {location.uri}` takes over and resumes")


@pytest.mark.engine
def test_a_running_job_whose_driver_is_alive(job, tmp_path, capsys):
    location, _ = running_copy(job, tmp_path / "out", heartbeat_age=5)
    r = status_json(capsys, location.uri)
    assert (r.status, r.driver) == ("running", "alive") and not r.lease.stale
    assert (r.units_committed, r.rows_done, r.attempt_units_committed, r.eta_seconds) == (2, 16, 2, None)
    assert not [n for n in r.notes if "heartbeat" in n] and r.warnings == []
    text = status_text(capsys, location.uri)
    assert "units:     2 of 4 committed (2 by attempt 1); the last " in text
    assert "WARNING" not in text and "fresh" in text


def test_no_job(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"specbatch status: no job has run at {tmp_path / 'nothing'}"
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--json"]) == 2
    assert "no job has run at" in capsys.readouterr().err


def test_a_first_attempt_before_its_manifest_is_seen_by_its_lease(tmp_path, capsys):
    """What a new run leaves while it checks inputs and starts Ray: its lease, no _job.json yet
    (issue 28: status said "no job has run" while a second run was refused as leased)."""
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    lease = OutputLease(location, LeaseConfig(heartbeat_seconds=30, stale_after_seconds=180), "daily-1", 1)
    lease.acquire()
    r = status_json(capsys, location.uri)
    assert (r.job_id, r.status, r.driver, r.attempts, r.lease.owner, r.lease.stale) == (
        "daily-1",
        "running",
        "starting",
        0,
        lease.lease.owner,
        False,
    )
    assert r.notes == [
        f"the first attempt of job daily-1 is starting (input check, plan, Ray): run {lease.lease.owner} "
        f"holds the lease, heartbeat {r.lease.heartbeat_age_seconds:.0f} s ago; no _job.json yet, so no counts yet"
    ]
    text = status_text(capsys, location.uri)
    assert text.startswith(f"job daily-1 at {location.uri}: running (a new attempt is starting)")
    assert "rows:" not in text and "fresh" in text

    old = lease.lease.model_copy(update={"heartbeat_at": time.time() - 15 * 60})  # its run died before the manifest
    location.storage.write_json(lease.uri, old.model_dump(mode="json"))
    r = status_json(capsys, location.uri)
    assert (r.driver, r.lease.stale) == ("gone", True)
    assert r.notes[0].endswith("died before it wrote one; the next `specbatch run CONFIG` takes it over")
    lease.release()


def test_help_ends_with_an_example(capsys):
    with pytest.raises(SystemExit) as exit:
        cli_main(["status", "--help"])
    assert exit.value.code == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-3] == "example:" and lines[-1].strip() == "specbatch status s3://bucket/jobs/daily --json"


@pytest.fixture(scope="module")
def s3_job(job, s3_endpoint):
    """The job's output copied to moto S3, as it is."""
    root, _ = job
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.put(str(root / "out") + "/", "specbatch/status-job/", recursive=True)
    return "s3://specbatch/status-job"


@pytest.mark.engine
def test_status_on_s3_reads_the_aggregates_only(job, s3_job, s3_endpoint, capsys, monkeypatch):
    root, _ = job
    local = status_json(capsys, str(root / "out"))
    calls = record_s3_requests(monkeypatch)
    remote = status_json(capsys, s3_job, "--endpoint-url", s3_endpoint)
    different = {"output_uri", "checked_at"}
    assert remote.model_dump(exclude=different) == local.model_dump(exclude=different)
    keys = [(method, key.split("status-job/", 1)[-1]) for method, key in calls]
    read = sorted(key for method, key in keys if method == "get_object")
    errors = [key for key in read if key.startswith("errors/")]
    # one GET each; the lease's is answered "no such key" (no run holds the location)
    assert read == sorted(["_job.json", "_lease.json", "stats/attempt-0001.parquet", *errors]), keys
    assert len(errors) == 4  # one per unit with error rows, named by its stats row
    assert {key for _, key in keys} == set(read) and "head_object" not in {method for method, _ in keys}, keys


@pytest.mark.engine
def test_status_on_s3_takes_the_endpoint_from_the_environment(job, s3_job, s3_endpoint):
    """The command line in a process of its own (a fresh s3fs), the endpoint in AWS_ENDPOINT_URL_S3."""
    import os

    env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3_endpoint}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "status", s3_job, "--json"],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    r = StatusReport.model_validate(json.loads(done.stdout))
    assert (r.status, r.rows_done, r.errors_by_kind) == ("succeeded", ROWS, EXPECTED_KINDS)
    missing = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "status", "s3://specbatch/no-such-job"],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=120,
    )
    assert missing.returncode == 2 and "no job has run at s3://specbatch/no-such-job" in missing.stderr


@pytest.mark.engine
def test_a_dry_rerun_over_the_finished_job_has_nothing_left(job, capsys):
    """The finished job's dry rerun: every unit committed, nothing to run, the engine's own
    prompt token count is the dry run's exact count, and the location is untouched."""
    from tests.test_dry_run import dry_run_json, files_of

    root, manifest = job
    config = str(root / "job.yaml")
    before = files_of(root / "out")
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    assert plan.units.rerun_of == manifest.job_id
    assert (plan.units.units, plan.units.committed, plan.units.left, plan.units.rows_left) == (4, 4, 0, 0)
    assert plan.inputs.footers_read == 0  # the files _job.json recorded are not read again
    assert plan.tokens.exact and plan.tokens.prompt_tokens == manifest.totals.prompt_tokens
    assert plan.tokens.prompt_tokens_left == plan.tokens.output_tokens_upper_bound_left == 0
    statuses = {c.name: c.status for c in plan.checks}
    assert statuses == {
        "preflight": "skipped",
        "drafter": "skipped",
        "drafter_probe": "skipped",
        "lease": "pass",
        "cluster": "skipped",
    }
    assert files_of(root / "out") == before

    assert cli_main(["run", config, "--dry-run"]) == 0
    assert f"rerun of job {manifest.job_id}: 4 committed, 0 left to run" in capsys.readouterr().out


# ---------------------------------------------------------------- a running job, without an engine
# Output locations a running job leaves, made by hand with the project's own commit, stats, lease
# and progress code: units committed (each marker's write time set to when it committed, on local
# files), a stats file the driver wrote before the last commits, `_progress.json`.

RUNNING_INPUT = {"a.parquet": 40, "b.parquet": 24}  # rows per file; units of 16: 3 + 2 units, 64 rows
STALL_LIMIT = 300.0


def running_job(root: Path, started: float, replicas: int = 1, in_flight: int = 2):
    """A running attempt 1 over RUNNING_INPUT, its driver alive (a fresh lease); returns the
    location and the plan's units."""
    from pipeline.inputs.units import plan_units
    from pipeline.job.manifest import versions
    from schemas import LAYOUT_VERSION, Attempt, InputFile, JobTotals, ModelFingerprint

    files = [
        InputFile(uri=str(root / "in" / name), size=1000, version="v1", rows=rows, text_column="prompt")
        for name, rows in RUNNING_INPUT.items()
    ]
    units = plan_units(files, 16)
    at = dt_iso(started)
    manifest = JobManifest(
        layout_version=LAYOUT_VERSION,
        job_id="daily-7",
        status="running",
        started_at=at,
        versions=versions(),
        config={
            "resources": {"rows_per_unit": 16, "replicas": replicas, "units_in_flight": in_flight},
            "retries": {"engine_stall_seconds": STALL_LIMIT},
        },
        model=ModelFingerprint(path="/m", config_sha256="0" * 64, architectures=[]),
        accelerator="cpu",
        input_files=files,
        totals=JobTotals(input_rows=64),
        attempts=[Attempt(number=1, started_at=at, status="running", skipped_rows=0, units_planned=len(units))],
    )
    location = OutputLocation(Storage(), str(root / "out"))
    location.write_manifest(manifest.model_dump(mode="json"))
    OutputLease(location, LeaseConfig(heartbeat_seconds=30, stale_after_seconds=180), "daily-7", 1).acquire()
    return location, units


def dt_iso(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


def commit(location: OutputLocation, unit, entered: float, committed: float, bad_rows: int = 0) -> dict:
    """Commits `unit` as an engine would (outputs, errors, marker), in the engine from `entered`,
    committed at `committed` (its marker's write time); returns its stats row."""
    import os

    import pyarrow as pa

    from tests.test_outputs import stats

    ids = [f"{unit.unit_id}-{i}" for i in range(unit.rows)]
    ok, bad = ids[bad_rows:], ids[:bad_rows]
    row = stats(unit.unit_id, unit.rows, len(ok)).model_copy(
        update=dict(
            started_at=entered,
            wall_seconds=committed - entered,
            engine_seconds=committed - entered,
            generated_tokens=8 * len(ok),
            cached_prompt_tokens=unit.rows // 4,
        )
    )
    tables = {
        "outputs": pa.table({"id": ok}),
        "errors": pa.table({"id": bad, "error_kind": ["empty_prompt"] * len(bad)}),
    }
    marker = location.commit(unit.unit_id, tables, row)
    os.utime(location.path("_commits", f"{unit.unit_id}.json"), (committed, committed))
    return marker.stats.model_dump()


def test_a_running_job_counts_its_commit_markers_while_the_stats_file_lags(tmp_path, capsys):
    """Issue 42: during a hang status said `rows: 0 of 1,536 done` with three markers in
    _commits/: it counted the stats file, which the driver had not written yet. Units and rows
    done are the markers' (one listing; rows from the plan); the split, tokens and error kinds
    come from the stats file and the markers of the units committed since."""
    now = time.time()
    location, units = running_job(tmp_path, started=now - 600)
    assert [u.rows for u in units] == [16, 16, 8, 16, 8]
    heard = [
        commit(location, u, now - 500 + 20 * i, now - 480 + 20 * i, bad_rows=1 if i == 3 else 0)
        for i, u in enumerate(units[:4])
    ]
    r = job_status(Storage(), location.uri)
    assert (r.counts_from, r.driver, r.units_committed, r.units_planned, r.rows_done) == ("commits", "alive", 4, 5, 56)
    assert (r.output_rows, r.error_rows, r.markers_read, r.stats_as_of) == (55, 1, 4, None)  # no stats file yet
    assert r.errors_by_kind == {"empty_prompt": 1} and r.generated_tokens == 8 * 55

    location.write_stats(1, heard[:2])  # the driver's last flush came two units ago
    r = job_status(Storage(), location.uri)
    assert (r.units_committed, r.rows_done, r.output_rows, r.error_rows, r.markers_read) == (4, 56, 55, 1, 2)
    assert r.stats_as_of == dt_iso(now - 460) and r.attempt_units_committed == 4
    text = status_text(capsys, location.uri)
    assert "rows:      56 of 64 done (88%): 55 generated, 1 errors" in text
    assert "units:     4 of 5 committed (4 by attempt 1); the last 7 min ago" in text
    # a unit's prompt tokens are its rows here, a quarter from the prefix cache; from the stats file and the markers
    assert (r.prompt_tokens, r.cached_prompt_tokens, r.prefix_cache_hit_rate) == (56, 14, 0.25)
    assert "prefill:   56 prompt tokens (14 from the prefix cache, 25%; 42 computed)" in text


def test_the_last_commit_age_and_a_pace_over_a_window_of_units(tmp_path, capsys):
    """The newest marker's write time is the last commit; the pace is measured over the last
    replicas x units_in_flight units (2 here); a commit long overdue against it is a warning."""
    now = time.time()
    location, units = running_job(tmp_path, started=now - 2000)
    for i, unit in enumerate(units[:2]):
        commit(location, unit, now - 1000 + 10 * i, now - 990 + 10 * i)
    r = job_status(Storage(), location.uri)
    assert r.last_commit_at == dt_iso(now - 980) and r.last_commit_age_seconds == pytest.approx(980, abs=5)
    assert (r.rows_per_second, r.eta_seconds, r.pace_units, r.units_before_pace) == (None, None, 2, 1)
    assert "ETA:       after the next unit commits" in status_text(capsys, location.uri)

    commit(location, units[2], now - 980, now - 970)  # a third unit of 8 rows: 16 + 8 rows in 20 s of generation
    r = job_status(Storage(), location.uri)
    assert r.rows_per_second == pytest.approx(24 / 20) and r.units_before_pace == 0
    assert r.warnings == [
        f"no unit has committed for 16 min, {r.last_commit_age_seconds / 10:.0f} times the usual 10 s "
        "between this attempt's commits"
    ]
    assert r.eta_seconds is None and "no ETA while no unit commits" in r.notes  # a pace that stopped dates nothing
    text = status_text(capsys, location.uri)
    assert f"WARNING: {r.warnings[0]}" in text and "ETA:       " not in text

    location, units = running_job(tmp_path / "on-time", started=now - 100)  # the same pace, its last commit 20 s ago
    for i, unit in enumerate(units[:3]):
        commit(location, unit, now - 50 + 10 * i, now - 40 + 10 * i)
    r = job_status(Storage(), location.uri)
    assert r.warnings == [] and r.eta_seconds == pytest.approx((64 - 40) / (24 / 20))
    assert r.eta_at == dt_iso(now - 20 + r.eta_seconds)
    text = status_text(capsys, location.uri)
    assert "ETA:       20 s (about " in text and "rows/s over the last 2 units committed" in text


def write_progress(
    location: OutputLocation, now: float, written_ago: float, attempt: int = 1, quiet: float = 200
) -> None:
    """_progress.json as the driver writes it: replica a holds 48 requests and last yielded `quiet`
    seconds ago; b generates; c holds nothing."""
    from schemas import JobProgress, ReplicaProgress

    replicas = [
        ReplicaProgress(
            actor_id="a1" * 16,
            node_id="n1" * 20,
            requests_in_flight=48,
            last_output_at=now - quiet,
            reported_at=now - 2,
        ),
        ReplicaProgress(
            actor_id="b2" * 16, node_id="n2" * 20, requests_in_flight=16, last_output_at=now - 1, reported_at=now - 1
        ),
        ReplicaProgress(
            actor_id="c3" * 16, node_id="n1" * 20, requests_in_flight=0, last_output_at=now - 900, reported_at=now - 3
        ),
    ]
    progress = JobProgress(
        attempt=attempt,
        written_at=now - written_ago,
        generating_since=now - 1000,
        last_commit_at=now - 500,
        replicas=replicas,
    )
    location.write_progress(progress.model_dump(mode="json"))


def test_an_engine_that_holds_requests_and_yields_nothing_is_named(tmp_path, capsys):
    now = time.time()
    location, units = running_job(tmp_path, started=now - 1000, replicas=3)
    commit(location, units[0], now - 600, now - 500)
    write_progress(location, now, written_ago=4)
    r = job_status(Storage(), location.uri)
    assert [(e.actor_id, e.requests_in_flight) for e in r.engines_without_progress] == [("a1" * 16, 48)]
    assert r.engines_without_progress[0].seconds_without_output == pytest.approx(200, abs=5)
    assert r.progress_written_at == dt_iso(now - 4)
    assert r.warnings == [
        "engine replica a1a1a1a1 on node n1n1n1n1 holds 48 requests and has yielded no token for 3 min "
        f"(at retries.engine_stall_seconds, {STALL_LIMIT:.0f} s, it is taken for hung and replaced)"
    ]
    text = status_text(capsys, location.uri)
    assert f"WARNING: {r.warnings[0]}" in text
    # 3 replicas of 2 slots: the pace needs 7 units, 4 are left, all in the engines
    assert (
        "ETA:       none: the last 4 units are running (the pace is measured over 6 units, one per engine slot)" in text
    )

    write_progress(
        location, now, written_ago=4, quiet=400
    )  # past the limit: the actor that should replace it is stuck too
    assert job_status(Storage(), location.uri).warnings == [
        "engine replica a1a1a1a1 on node n1n1n1n1 holds 48 requests and has yielded no token for 7 min: past "
        f"retries.engine_stall_seconds ({STALL_LIMIT:.0f} s), the least its actor waits before it replaces a hung "
        "engine (20 times the engine's slowest step, if longer); else the actor is stuck too"
    ]

    write_progress(location, now, written_ago=4, attempt=0)  # an earlier attempt's: says nothing of this one
    r = job_status(Storage(), location.uri)
    assert (r.engines_without_progress, r.warnings, r.progress_written_at) == ([], [], None)


def test_a_driver_that_stopped_writing_its_progress_is_said_to(tmp_path, capsys):
    """A _progress.json minutes old while the driver's lease is fresh: the driver is not generating
    or is stuck; its engines' figures are old, so no engine is named from them."""
    now = time.time()
    location, units = running_job(tmp_path, started=now - 1000)
    commit(location, units[0], now - 600, now - 500)
    write_progress(location, now, written_ago=300)
    r = job_status(Storage(), location.uri)
    assert r.engines_without_progress == [] and r.driver == "alive"
    assert r.warnings == [
        "the driver last wrote _progress.json 5 min ago (it rewrites it every 10 s while it generates): "
        "it is not generating now, or it is stuck; what its engines do is not known"
    ]
    assert f"WARNING: {r.warnings[0]}" in status_text(capsys, location.uri)


def test_a_running_job_on_s3_is_one_listing_of_its_markers(s3_endpoint, tmp_path, monkeypatch):
    """On S3: _job.json, the lease, one LIST of _commits/ (its write times with it), the stats
    listing and file, the markers of the units the stats file lacks, _progress.json; no HEAD."""
    now = time.time()
    local, units = running_job(tmp_path, started=now - 600)
    heard = [commit(local, u, now - 500 + 20 * i, now - 480 + 20 * i) for i, u in enumerate(units[:3])]
    local.write_stats(1, heard[:1])
    write_progress(local, now, written_ago=2)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    fs.put(str(tmp_path / "out") + "/", f"specbatch/running-{tmp_path.name}/", recursive=True)
    calls = record_s3_requests(monkeypatch)
    # listings go through the sync `call_s3`, which s3fs binds to the unrecorded `_call_s3` at import
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(s3fs.S3FileSystem._call_s3))
    r = job_status(Storage(endpoint_url=s3_endpoint), f"s3://specbatch/running-{tmp_path.name}")
    assert (r.units_committed, r.rows_done, r.output_rows, r.markers_read) == (3, 40, 40, 2)
    assert (
        r.last_commit_age_seconds is not None and r.last_commit_age_seconds < 600
    )  # the upload's time, the store's clock
    keys = sorted((method, key.split(tmp_path.name + "/", 1)[-1]) for method, key in calls)
    markers = sorted(("get_object", f"_commits/{u.unit_id}.json") for u in units[1:3])
    assert keys == sorted(
        [
            ("get_object", "_job.json"),
            ("get_object", "_lease.json"),
            ("list_objects_v2", "_commits/"),
            ("list_objects_v2", "stats/"),
            ("get_object", "stats/attempt-0001.parquet"),
            *markers,
            ("get_object", "_progress.json"),
        ]
    ), keys
