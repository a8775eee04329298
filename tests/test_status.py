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

from pipeline.cli import main as cli_main
from pipeline.commit.lease import OutputLease
from pipeline.commit.outputs import OutputLocation
from pipeline.config import LeaseConfig
from pipeline.job.console import STEADY_MIN_SECONDS
from pipeline.storage import Storage
from pipeline.tools.status import job_status, main
from schemas import JobManifest
from schemas.status import StatusReport
from tests.conftest import RANDOM_JOB_BAD as BAD
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
# line prefixed with its process: "\x1b[36m(MapWorker(MapBatches(Generator)) pid=21530)\x1b[0m ..."
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
    assert r.last_attempt.model_dump() == doc.attempts[0].model_dump(include={"number", "status", "started_at", "ended_at", "error"})
    outputs, errors = location.read_table("outputs"), location.read_table("errors")
    assert r.input_rows == r.rows_done == ROWS == doc.totals.input_rows
    assert r.output_rows == len(set(outputs.column("id").to_pylist())) == doc.totals.output_rows == ROWS - len(BAD)
    assert r.error_rows == errors.num_rows == len(BAD)
    assert r.errors_by_kind == dict(Counter(errors.column("error_kind").to_pylist())) == EXPECTED_KINDS
    assert r.errors_by_kind_complete and r.error_units == r.error_units_read == 4
    assert r.units_committed == r.units_planned == len(location.committed_units()) == 4
    assert r.acceptance_rate is not None and r.acceptance_rate == doc.totals.acceptance_rate  # the random drafter drafts
    assert r.mean_acceptance_length == doc.totals.mean_acceptance_length
    assert r.generated_tokens == doc.totals.generated_tokens > 0 and r.tokens_per_second == doc.totals.tokens_per_second
    assert r.counts_from == "manifest" and r.eta_seconds is None and r.notes == []
    text = status_text(capsys, out)
    assert_text_agrees(text, r)
    assert "lease:     none" in text and "ETA" not in text and "WARNING" not in text

    partial = job_status(Storage(), out, error_files=1)  # one error file of three: said so, not scaled
    assert (partial.error_units, partial.error_units_read, partial.errors_by_kind_complete) == (4, 1, False)
    assert sum(partial.errors_by_kind.values()) == 1 and "from 1 of the 4 units with error rows" in partial.notes[0]


def running_copy(job, dest: Path, heartbeat_age: float) -> tuple[OutputLocation, JobManifest, float]:
    """What a running job leaves: the job's output copied, its manifest back to running, the
    last two units not committed yet (their marker, files and stats row gone), a lease whose
    last heartbeat was `heartbeat_age` seconds ago. Returns the location, the manifest and the
    attempt's steady pace in rows per second from the stats file."""
    root, _ = job
    shutil.copytree(root / "out", dest)
    location = OutputLocation(Storage(), str(dest))
    manifest = JobManifest.model_validate(location.read_manifest())
    attempt = manifest.attempts[-1]
    manifest.status, manifest.ended_at = "running", None
    attempt.status, attempt.ended_at, attempt.wall_seconds = "running", None, 0.0
    location.write_manifest(manifest.model_dump(mode="json"))

    stats_uri = location.path("stats", "attempt-0001.parquet")
    stats = location.storage.read_parquet(stats_uri).sort_by("unit_id")
    kept, dropped = stats.slice(0, 2), stats.slice(2)
    location.storage.write_parquet(stats_uri, kept)
    markers = location.markers(dropped.column("unit_id").to_pylist())
    for unit, marker in markers.items():
        for path in marker.files.values():
            location.storage.delete(location.path(path))
        location.storage.delete(location.path("_commits", f"{unit}.json"))

    lease = OutputLease(location, LeaseConfig(heartbeat_seconds=30, stale_after_seconds=180), manifest.job_id, attempt.number)
    beat = lease.lease.model_copy(update={"heartbeat_at": time.time() - heartbeat_age})
    location.storage.write_json(lease.uri, beat.model_dump(mode="json"))

    # the steady pace: rows committed after the first commit, over the time since it (no start-up);
    # units that committed within a second of each other give none: then since the attempt began
    commits = sorted((r["started_at"] + r["wall_seconds"], r["rows"]) for r in kept.to_pylist())
    span = commits[-1][0] - commits[0][0]
    if span >= STEADY_MIN_SECONDS:
        pace = sum(rows for _, rows in commits[1:]) / span
    else:
        from datetime import datetime

        pace = sum(rows for _, rows in commits) / (commits[-1][0] - datetime.fromisoformat(attempt.started_at).timestamp())
    return location, manifest, pace


@pytest.mark.engine
def test_a_running_job_whose_driver_is_gone(job, tmp_path, capsys):
    root, _ = job
    location, manifest, pace = running_copy(job, tmp_path / "out", heartbeat_age=15 * 60)
    r = status_json(capsys, location.uri)
    assert (r.status, r.driver, r.counts_from) == ("running", "gone", "stats")
    assert r.lease.stale and r.lease.heartbeat_age_seconds == pytest.approx(15 * 60, abs=30)
    assert r.notes[0] == "no heartbeat for 15 min: the driver is probably gone; `specbatch run CONFIG` takes over and resumes"
    assert (r.units_committed, r.units_planned, r.input_rows) == (2, 4, ROWS)
    errors = location.read_table("errors")  # the errors of the units still committed
    assert r.rows_done == 16 and r.error_rows == errors.num_rows
    assert r.errors_by_kind == dict(Counter(errors.column("error_kind").to_pylist()))
    assert r.rows_per_second == pytest.approx(pace)
    assert r.eta_seconds == pytest.approx((ROWS - 16) / pace) and r.eta_seconds > 0
    assert r.eta_at is None  # nobody is running it
    assert r.acceptance_rate is not None and r.stats_as_of

    text = status_text(capsys, location.uri)
    assert_text_agrees(text, r)
    assert "WARNING: no heartbeat for 15 min: the driver is probably gone; `specbatch run CONFIG` takes over and resumes" in text
    assert "ETA:" in text and "once resumed" in text and "STALE" in text

    # with the job's config, the resume command names it (the output location is not the config's: it says so)
    config = str(root / "job.yaml")
    r = status_json(capsys, location.uri, "--config", config)
    assert r.notes[0].endswith(f"`specbatch run {config} --output-uri {location.uri}` takes over and resumes")


@pytest.mark.engine
def test_a_running_job_whose_driver_is_alive(job, tmp_path, capsys):
    location, _, pace = running_copy(job, tmp_path / "out", heartbeat_age=5)
    r = status_json(capsys, location.uri)
    assert (r.status, r.driver) == ("running", "alive") and not r.lease.stale
    assert r.eta_seconds == pytest.approx((ROWS - 16) / pace) and r.eta_at
    assert not [n for n in r.notes if "heartbeat" in n]
    text = status_text(capsys, location.uri)
    assert f"(about {r.eta_at})" in text and "WARNING" not in text and "fresh" in text


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
        "daily-1", "running", "starting", 0, lease.lease.owner, False)
    assert r.notes == [f"the first attempt of job daily-1 is starting (input check, plan, Ray): run {lease.lease.owner} "
                       f"holds the lease, heartbeat {r.lease.heartbeat_age_seconds:.0f} s ago; no _job.json yet, so no counts yet"]
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
        [sys.executable, "-m", "pipeline.cli", "status", s3_job, "--json"], env=env, capture_output=True, text=True,
        cwd=Path(__file__).parent.parent, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    r = StatusReport.model_validate(json.loads(done.stdout))
    assert (r.status, r.rows_done, r.errors_by_kind) == ("succeeded", ROWS, EXPECTED_KINDS)
    missing = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "status", "s3://specbatch/no-such-job"], env=env, capture_output=True,
        text=True, cwd=Path(__file__).parent.parent, timeout=120,
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
    assert statuses == {"preflight": "skipped", "drafter": "skipped", "drafter_probe": "skipped", "lease": "pass",
                        "cluster": "skipped"}
    assert files_of(root / "out") == before

    assert cli_main(["run", config, "--dry-run"]) == 0
    assert f"rerun of job {manifest.job_id}: 4 committed, 0 left to run" in capsys.readouterr().out
