"""Exactly once under real faults: the job runs as `specbatch run` in its own process (with its
own local Ray), and the tests kill its engine actor, kill the driver, stop the S3 endpoint,
and feed it a row that crashes the engine. After each: every input id exactly once across
outputs/ and errors/, and stats agree with outputs. Engine faults are real ones: EngineCore
killed by its process title, and a test-only vLLM plugin (tests/vllm_faults) that kills it on
a poisoned prompt. The killed driver's lease refuses a second run until it is stale and taken
over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml

from pipeline.config import parse_config
from pipeline.outputs import OutputLocation
from pipeline.job_plan import ResultsChanged
from pipeline.runner import run_job
from pipeline.storage import Storage
from tests.conftest import job_config, write_prompts

SPECBATCH = str(Path(sys.executable).with_name("specbatch"))
N_ROWS = 160


def make_job(tmp_path: Path, kit: dict, rows: int = N_ROWS, **overrides) -> tuple[Path, list[str], dict]:
    """Two shards of `rows` in all, units of 8 rows."""
    ids = [f"id-{i:04d}" for i in range(rows)]
    write_prompts(tmp_path / "in" / "a.parquet", {"id": ids[::2], "prompt": [f"def f{i}(a, b):" for i in range(0, rows, 2)]})
    write_prompts(tmp_path / "in" / "b.parquet", {"id": ids[1::2], "prompt": [f"class K{i}:" for i in range(1, rows, 2)]})
    overrides = {"sampling": {"max_tokens": 24}, "resources": {"rows_per_unit": 8, "units_in_flight": 2}, **overrides}
    config = job_config(str(tmp_path / "in"), str(tmp_path / "out"), kit, **overrides)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, ids, config


def start_job(config_path: Path, env: dict | None = None, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [SPECBATCH, "run", str(config_path), *flags],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: the driver and the Ray it started
    )


def wait_for_commits(location: OutputLocation, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(location.committed_units()) >= n:
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    raise TimeoutError("no unit committed in time")


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def assert_exactly_once(location: OutputLocation, ids: list[str]) -> None:
    outputs, errors, stats = (location.read_table(n) for n in ("outputs", "errors", "stats"))
    landed = outputs.column("id").to_pylist() + (errors.column("id").to_pylist() if errors.num_rows else [])
    assert Counter(landed) == Counter(ids)
    assert sum(stats.column("output_rows").to_pylist()) == outputs.num_rows
    assert sorted(stats.column("unit_id").to_pylist()) == sorted(location.committed_units())
    assert sum(stats.column("rows").to_pylist()) == len(ids)
    assert sum(stats.column("generated_tokens").to_pylist()) == sum(outputs.column("generated_tokens").to_pylist())


def engine_actor_pids() -> list[int]:
    return [
        p.pid for p in psutil.process_iter(["cmdline"])
        if "MapBatches(Generator)" in " ".join(p.info["cmdline"] or [])
    ]


def kill_engine_cores() -> int:
    """SIGKILL every vLLM EngineCore process, found by its title, as a GPU fault, a CUDA OOM
    or the OOM killer ends it; the engine actor's own process stays alive."""
    cores = [p for p in psutil.process_iter(["name", "cmdline"]) if "VLLM::EngineCore" in (p.info["name"] or "") + " ".join(p.info["cmdline"] or [])]
    for proc in cores:
        proc.send_signal(signal.SIGKILL)
    return len(cores)


def assert_engine_death_recovered(location: OutputLocation, ids: list[str]) -> None:
    """Every id exactly once in outputs/, none failed by the dead engine, and the death and
    restart recorded in _job.json."""
    assert_exactly_once(location, ids)
    errors = location.read_table("errors")
    assert errors.num_rows == 0, errors.to_pylist()
    manifest = location.read_manifest()
    assert manifest["status"] == "succeeded"
    (death, *_) = manifest["attempts"][-1]["engine_deaths"]
    assert "EngineDeadError" in death["error"] and death["units"] and death["actor_id"]


@pytest.mark.engine
def test_ctrl_c_then_a_killed_driver_then_a_take_over_land_each_ids_samples_exactly_once(tmp_path, random_kit):
    """One job, the two ways a driver stops. Ctrl-C between commits (SIGINT to the run's process
    group, as a terminal sends it) closes the attempt as interrupted in one line, exit 130, and
    releases the lease. The resume's whole session is then SIGKILLed (a preempted or OOM-killed
    driver): its lease refuses a rerun while fresh, is named stale after, and --take-over
    resumes. n=4 at temperature 0.8 (without the drafter: vLLM's CPU build samples wrongly with
    it, and the job refuses that): each id's four samples land exactly once, in one unit."""
    sampling = {"max_tokens": 12, "n": 4, "temperature": 0.8, "seed": 7}
    lease = {"heartbeat_seconds": 1, "stale_after_seconds": 6}
    config_path, ids, config = make_job(tmp_path, random_kit, sampling=sampling, speculative={"enabled": False}, lease=lease)
    location = OutputLocation(Storage(), str(tmp_path / "out"))

    proc = start_job(config_path)
    wait_for_commits(location, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in out and "(raylet)" not in out, out[-3000:]
    interrupted_units = location.committed_units()
    interrupted = location.read_manifest()
    assert interrupted["status"] == "interrupted" and interrupted["totals"]["units"] == len(interrupted_units) >= 2
    assert out.splitlines()[-1] == (
        f"specbatch: interrupted after {len(interrupted_units)} of {interrupted['attempts'][0]['units_planned']} units; "
        "rerun the same command to resume"
    )
    assert not location.storage.exists(location.path("_lease.json"))  # released: the rerun needs no --take-over

    second_started = time.time()
    proc = start_job(config_path)
    wait_for_commits(location, len(interrupted_units) + 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
    proc.wait()
    killed_at = time.time()
    # The dead run's lease is still fresh: a second run is refused, naming the owner and the way out.
    refused = start_job(config_path)
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "is leased to run" in out and "--take-over" in out, out[-2000:]
    if time.time() - killed_at < 6:
        assert "that run is alive" in out
    time.sleep(max(0.0, killed_at + 7 - time.time()))
    stale = start_job(config_path)
    out, _ = stale.communicate(timeout=120)
    assert stale.returncode == 2 and "which is stale" in out, out[-2000:]
    killed_units = location.committed_units()
    finish(start_job(config_path, None, "--take-over"))

    outputs = location.read_table("outputs").select(["id", "sample_index", "unit_id"]).to_pylist()
    assert Counter((o["id"], o["sample_index"]) for o in outputs) == Counter((i, s) for i in ids for s in range(4))
    units_of = {}
    for o in outputs:
        units_of.setdefault(o["id"], set()).add(o["unit_id"])
    assert all(len(units) == 1 for units in units_of.values())  # an id's samples commit together
    stats = location.read_table("stats")
    assert sum(stats.column("rows").to_pylist()) == len(ids) and sum(stats.column("samples").to_pylist()) == len(outputs)
    assert sorted(stats.column("unit_id").to_pylist()) == sorted(location.committed_units())
    assert not location.storage.exists(location.path("_lease.json"))  # released at the end
    manifest = location.read_manifest()
    assert [a["status"] for a in manifest["attempts"]] == ["interrupted", "killed", "succeeded"]  # closed by the next attempt
    killed, resumed = manifest["attempts"][1:]
    assert killed["ended_at"] and 0 < killed["wall_seconds"] <= killed_at - second_started + 2  # its last heartbeat
    assert resumed["units_skipped"] >= len(killed_units) >= len(interrupted_units) + 2  # a worker may commit while it dies
    assert resumed["skipped_rows"] == 8 * resumed["units_skipped"]
    assert resumed["skipped_rows"] + resumed["processed_rows"] == len(ids)
    assert resumed["footers_read"] == 0  # the attempts before recorded both files
    assert (manifest["totals"]["output_rows"], manifest["totals"]["samples"]) == (len(ids), 4 * len(ids))

    # A finished job: rerunning it starts no generation (no Ray, no engine, no new unit).
    units = location.committed_units()
    rerun = run_job(parse_config(config), progress=False)
    assert rerun.attempts[-1].skipped_rows == len(ids) and rerun.attempts[-1].processed_rows == 0
    assert location.committed_units() == units
    assert rerun.totals.output_rows == len(ids) and rerun.totals.units == len(units) and len(rerun.attempts) == 4

    # A change of results under the same output is refused, naming what changed...
    changed = parse_config({**config, "sampling": {**config["sampling"], "repetition_penalty": 1.1}})
    with pytest.raises(ResultsChanged, match=r"sampling: .*--restart"):
        run_job(changed, progress=False)
    # ...and so is an input file rewritten in place (its units would be new beside the old).
    # A drafter rewritten in place: tests/test_lease.py, before any engine.
    shard = tmp_path / "in" / "b.parquet"
    shard.write_bytes(shard.read_bytes())
    with pytest.raises(ResultsChanged, match=r"input files changed .*b\.parquet \(size \d+ -> \d+, version"):
        run_job(parse_config(config), progress=False)
    location.clear()
    assert not location.committed_units() and not location.has_manifest()


@pytest.mark.engine
def test_storage_down_then_engine_core_then_engine_actor_killed_one_job(tmp_path, s3_endpoint, random_kit):
    """One job on S3 meets three faults in turn and ends exactly once in its one attempt: the
    endpoint stops for seconds, then vLLM's EngineCore is killed (the death and restart are
    recorded), then the restarted engine's actor process is killed."""
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    port = int(s3_endpoint.rsplit(":", 1)[1])
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    ids = [f"s3-{i:04d}" for i in range(N_ROWS)]
    write_prompts("specbatch/outage/in/a.parquet", {"id": ids, "prompt": [f"import m{i}" for i in range(N_ROWS)]}, filesystem=fs)
    config = job_config(
        "s3://specbatch/outage/in/", "s3://specbatch/outage/out/", random_kit, storage={"endpoint_url": s3_endpoint},
        sampling={"max_tokens": 24}, resources={"rows_per_unit": 8, "units_in_flight": 2},
    )
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    location = OutputLocation(Storage(endpoint_url=s3_endpoint), config["output_uri"])

    proc = start_job(config_path)
    wait_for_commits(location, 2, proc)
    from tests import conftest

    conftest.S3_SERVER.stop()  # the endpoint goes away...
    time.sleep(8)
    assert proc.poll() is None
    conftest.S3_SERVER = ThreadedMotoServer(ip_address="127.0.0.1", port=port)  # ...and comes back
    conftest.S3_SERVER.start()
    boto3.client("s3", endpoint_url=s3_endpoint).head_bucket(Bucket="specbatch")
    committed = len(location.committed_units())
    wait_for_commits(location, committed + 1, proc)
    assert kill_engine_cores() >= 1  # then vLLM's EngineCore dies (a GPU fault, the OOM killer)...
    committed = len(location.committed_units())
    wait_for_commits(location, committed + 1, proc)  # ...the restarted engine commits...
    pids = engine_actor_pids()
    assert pids, "engine actor process not found"
    for pid in pids:  # ...and then the whole actor process dies (a lost node, an OOM kill of the actor)
        os.kill(pid, signal.SIGKILL)
    finish(proc)
    assert len(location.committed_units()) == N_ROWS // 8
    assert_engine_death_recovered(location, ids)
    assert len(location.read_manifest()["attempts"]) == 1  # all of it recovered inside the one attempt


FAULTS_PLUGIN = str(Path(__file__).parent / "vllm_faults")


@pytest.mark.engine
def test_a_row_that_kills_the_engine_every_time_ends_alone_in_errors_then_retry_errors(tmp_path, random_kit):
    """A row whose request kills EngineCore every time (tests/vllm_faults): its unit's
    suspects run alone, half at a time, until the row kills the engine alone; it goes to
    errors/ as a final EngineCrash and every other row of its unit to outputs/ (units of 2: each
    death is an engine restart, so one halving: the unit dies, then the row alone). One error in 24 rows is over retries.max_error_fraction: completed_with_errors, exit code 3. With
    the fault gone, --retry-errors generates it: every row in outputs/, none in errors/."""
    from transformers import AutoTokenizer

    config_path, ids, _ = make_job(
        tmp_path, random_kit, rows=24,
        retries={"isolate_after_attempts": 1, "max_error_fraction": 0.01, "breaker_window_units": 13},  # > its 12 units: never full
        resources={"rows_per_unit": 2, "units_in_flight": 1},
    )
    poison = AutoTokenizer.from_pretrained(random_kit["target"]).encode("class K13:")  # the prompt of id-0013
    faults = {"PYTHONPATH": os.pathsep.join(filter(None, [FAULTS_PLUGIN, os.environ.get("PYTHONPATH")])),
              "SPECBATCH_TEST_POISON_TOKENS": ",".join(map(str, poison))}
    proc = start_job(config_path, faults)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 3, out[-4000:]
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    assert_exactly_once(location, ids)
    errors = location.read_table("errors").to_pylist()
    assert [(e["id"], e["stage"], e["error_kind"], e["retryable"]) for e in errors] == [
        ("id-0013", "generate", "EngineCrash", False)
    ]
    manifest = location.read_manifest()
    assert manifest["status"] == "completed_with_errors" and manifest["totals"]["error_rows"] == 1
    deaths = manifest["attempts"][-1]["engine_deaths"]
    assert len(deaths) == 2  # the unit of 2, then the row alone (log2(2) + 1)

    finish(start_job(config_path, None, "--retry-errors"))  # the fault is gone
    assert_exactly_once(location, ids)
    assert location.read_table("errors").num_rows == 0
    manifest = location.read_manifest()
    assert manifest["status"] == "succeeded" and manifest["attempts"][-1]["units_skipped"] == 11  # of 12 units
