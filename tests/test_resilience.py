"""Exactly once under real faults: the job runs as `specbatch run` in its own process (with its
own local Ray), and the tests kill its engine actor, kill the driver, and feed it a row that
crashes the engine (a store that stops answering: tests/test_storage_outage.py). After each:
every input id exactly once across outputs/ and errors/, and stats agree with outputs. Engine
faults are real ones: EngineCore killed by its process title, and a test-only vLLM plugin
(tests/vllm_faults) that kills it on a poisoned prompt. The killed driver's lease is taken over
by the same command, and a run that loses its lease stops committing."""

from __future__ import annotations

import datetime as dt
import os
import posixpath
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml

from pipeline.graph import engine_actor_label
from pipeline.commit.outputs import OutputLocation
from pipeline.config import parse_config
from pipeline.job.plan import ResultsChanged
from pipeline.job.runner import run_job
from pipeline.storage import Storage, json_bytes
from schemas import Lease
from tests.conftest import job_config, write_prompts

SPECBATCH = str(Path(sys.executable).with_name("specbatch"))
N_ROWS = 160


def make_job(tmp_path: Path, kit: dict, rows: int = N_ROWS, **overrides) -> tuple[Path, list[str], dict]:
    """Two shards of `rows` in all, units of 8 rows."""
    ids = [f"id-{i:04d}" for i in range(rows)]
    write_prompts(
        tmp_path / "in" / "a.parquet", {"id": ids[::2], "prompt": [f"def f{i}(a, b):" for i in range(0, rows, 2)]}
    )
    write_prompts(
        tmp_path / "in" / "b.parquet", {"id": ids[1::2], "prompt": [f"class K{i}:" for i in range(1, rows, 2)]}
    )
    overrides = {"sampling": {"max_tokens": 24}, "resources": {"rows_per_unit": 8, "units_in_flight": 2}, **overrides}
    config = job_config(str(tmp_path / "in"), str(tmp_path / "out"), kit, **overrides)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, ids, config


def start_job(config_path: Path, env: dict | None = None, *flags: str) -> subprocess.Popen:
    """`specbatch run` in a session of its own (the driver and the Ray it starts), with a mark in
    its environment that its processes inherit (`engine_cores_of`)."""
    mark = uuid.uuid4().hex
    job = subprocess.Popen(
        [SPECBATCH, "run", str(config_path), *flags],
        env={**os.environ, JOB_MARK: mark, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    job.mark = mark
    return job


def wait_for_commits(location: OutputLocation, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(location.committed_units()) >= n:
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    raise TimeoutError("no unit committed in time")


def units_skipped_by_attempt(
    location: OutputLocation, number: int, proc: subprocess.Popen, timeout: float = 120
) -> int:
    """The units committed before attempt `number` planned, from its record in `_job.json`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        attempts = location.read_manifest()["attempts"] if location.has_manifest() else []
        if len(attempts) >= number:
            return attempts[number - 1]["units_skipped"]
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    raise TimeoutError(f"attempt {number} did not start in time")


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


def engine_actor_pids(job: subprocess.Popen) -> list[int]:
    """The job's engine actor processes (Ray workers titled after the map stage), from its session."""
    return list(titled_processes(engine_actor_label(), session=job.pid))


def kill_engine_cores(job: subprocess.Popen, wait_seconds: float = 180) -> float:
    """SIGKILL the job's vLLM EngineCore processes (`engine_cores_of`), as a GPU fault, a CUDA OOM
    or the OOM killer ends one; the engine actor's own process stays alive. Looks again until one
    is there, while the job runs; when none is found, the message describes every vLLM process
    seen meanwhile (its session, its parents, whether it carries the job's mark). Returns when it
    killed, for `wait_for_new_engine_core`."""
    deadline, seen = time.time() + wait_seconds, {}
    while not (cores := engine_cores_of(job)):
        seen.update({pid: describe_process(p, job) for pid, p in titled_processes("VLLM::").items() if pid not in seen})
        assert job.poll() is None and time.time() < deadline, (
            f"no EngineCore of job {job.pid} found while it ran; vLLM processes seen: {list(seen.values())}; "
            f"the job's output: {job.stdout.read()[-2000:] if job.poll() is not None else '(running)'}"
        )
        time.sleep(0.2)
    killed_at = time.time()
    for proc in cores:
        proc.send_signal(signal.SIGKILL)
    return killed_at


def engine_cores_of(job: subprocess.Popen) -> list[psutil.Process]:
    """The job's EngineCore processes: of its session (`start_job` gives the run a session of its
    own, which its Ray and engines stay in: no other test's engine is touched), among its
    descendants, or carrying its mark (JOB_MARK, which Ray's workers and vLLM's processes inherit).
    Three ways, as two whole-suite runs found none by session, and one none by either of the
    first two, for a whole job."""
    found = []
    for pid, proc in titled_processes("VLLM::EngineCore").items():
        try:
            if session_of(pid) == job.pid or job_mark(proc) == job.mark or job.pid in ancestors(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


JOB_MARK = "SPECBATCH_TEST_JOB"


def job_mark(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get(JOB_MARK)
    except psutil.Error:
        return None


def ancestors(proc: psutil.Process) -> list[int]:
    try:
        return [parent.pid for parent in proc.parents()]
    except psutil.Error:
        return []


def describe_process(proc: psutil.Process, job: subprocess.Popen) -> str:
    try:
        chain = " < ".join(f"{p.pid}:{p.name()}" for p in [proc, *proc.parents()][:6])
        return f"{chain} (session {session_of(proc.pid)}, mark {'of this job' if job_mark(proc) == job.mark else None})"
    except psutil.Error as exc:
        return f"{proc.pid}: {type(exc).__name__}"


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def titled_processes(*marks: str, session: int | None = None) -> dict[int, psutil.Process]:
    """Every live process whose title holds one of `marks` (of one session, when given), by pid."""
    found = {}
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        title = (p.info["name"] or "") + " ".join(p.info["cmdline"] or [])
        if any(mark in title for mark in marks) and p.info["status"] != psutil.STATUS_ZOMBIE:
            if session is None or session_of(p.pid) == session:
                found[p.pid] = p
    return found


def vllm_processes(session: int | None = None) -> dict[int, psutil.Process]:
    """Every live process vLLM titled (VLLM::EngineCore, VLLM::Worker), of one session when given, by pid."""
    return titled_processes("VLLM::", session=session)


def alive(procs) -> list[int]:
    return [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def job_processes(*jobs: subprocess.Popen) -> dict[int, psutil.Process]:
    """Every live engine process (VLLM::) and Ray worker (ray::) of the jobs' sessions, by pid."""
    return {pid: p for job in jobs for pid, p in titled_processes("VLLM::", "ray::", session=job.pid).items()}


def assert_none_left(*jobs: subprocess.Popen, within: float = 10) -> None:
    """No engine process or Ray worker of the jobs (the runs' sessions) `within` s after they ended."""
    deadline = time.time() + within
    while (left := alive(job_processes(*jobs).values())) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, [(pid, psutil.Process(pid).cmdline()) for pid in left if psutil.pid_exists(pid)]


def wait_for_new_engine_core(killed_at: float, proc, timeout: float = 300) -> None:
    """Until an EngineCore started after `killed_at` runs. By start time, not by pids unseen
    before: a whole suite spawns more processes than pid_max (32768 on CI), and a CI run once
    missed a replacement whose job then ended, restarted engine and all; a pid reused from
    before the job is the likeliest cause."""
    deadline = time.time() + timeout
    while not any(p.create_time() >= killed_at - 1 for p in engine_cores_of(proc)):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "no replacement engine started"
        time.sleep(0.1)


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


def take_the_lease_elsewhere(location: OutputLocation) -> Lease:
    """Another run, on another host, takes the location over as a run does: a compare-and-swap
    on the lease's version that raises its generation."""
    data, version = location.storage.read_versioned(location.path("_lease.json"))
    held = Lease.model_validate_json(data)
    taker = held.model_copy(
        update={
            "owner": "elsewhere:1:0badf00d",
            "host": "elsewhere",
            "pid": 1,
            "attempt": held.attempt + 1,
            "generation": held.generation + 1,
            "heartbeat_at": time.time(),
        }
    )
    location.storage.write_if(location.path("_lease.json"), json_bytes(taker.model_dump(mode="json")), version)
    return taker


def beat_elsewhere(location: OutputLocation) -> float:
    """The run elsewhere renews its lease once more (then falls silent); returns when."""
    data, version = location.storage.read_versioned(location.path("_lease.json"))
    beat = Lease.model_validate_json(data).model_copy(update={"heartbeat_at": time.time()})
    location.storage.write_if(location.path("_lease.json"), json_bytes(beat.model_dump(mode="json")), version)
    return beat.heartbeat_at


def test_a_generator_freed_by_the_cyclic_collector_stops_its_engine_before_vllms_finalizers():
    """vLLM stops EngineCore in weakref finalizers, and Python's cyclic collector calls those
    before any __del__: an EngineStage in a reference cycle would have its EngineCore stopped under
    a live output handler (EngineDeadError in the worker's log, seen in a fresh clone's demo)
    before EngineStage.stop could stop it in order. The engine here is a stand-in carrying a
    finalizer as vLLM's AsyncLLM does, since a real one costs an engine start; the demo's log
    test (tests/test_install.py) checks a real engine's stop."""
    import gc
    import weakref
    from types import SimpleNamespace

    from pipeline.graph import engine_stage

    events: list[str] = []

    class Engine:  # what EngineStage.stop uses of AsyncLLM
        output_handler = None

        def shutdown(self) -> None:
            events.append("EngineStage.stop")

    engine = Engine()
    weakref.finalize(engine, events.append, "vLLM's finalizer")
    actor = engine_stage.EngineStage.__new__(engine_stage.EngineStage)
    actor.engine, actor.stopped = engine_stage.held_until_stopped(engine), False
    actor.requests, actor.processes = SimpleNamespace(dying=False), SimpleNamespace(end=lambda: None)
    actor.itself = actor  # the cycle
    del engine, actor
    gc.collect()
    assert events == ["EngineStage.stop", "vLLM's finalizer"]


@pytest.mark.engine
def test_ctrl_c_a_killed_driver_and_a_lost_lease_land_each_ids_samples_exactly_once(tmp_path, random_kit):
    """One job, the ways a driver stops. Ctrl-C between commits (SIGINT to the run's process
    group, as a terminal sends it) closes the attempt as interrupted in one line, exit 130, and
    releases the lease. The resume's whole session is then SIGKILLed (a preempted or OOM-killed
    driver): the same command at once takes over (its owner's process on this host is gone).
    That run then loses the lease to a run elsewhere (its compare-and-swap wins): it commits
    nothing more, exits 4 naming the new owner, and records what it did as `fenced`. The same
    command waits for the silent lease elsewhere to go stale and finishes. n=4 at temperature
    0.8 (without the drafter: vLLM's CPU build samples wrongly with it, and the job refuses
    that): each id's four samples land exactly once, in one unit."""
    sampling = {"max_tokens": 12, "n": 4, "temperature": 0.8, "seed": 7}
    lease = {
        "heartbeat_seconds": 1,
        "stale_after_seconds": 15,
        "wait_seconds": 60,
    }  # 15 s: a slow machine's start-up reads a fresh lease
    config_path, ids, config = make_job(
        tmp_path, random_kit, sampling=sampling, speculative={"enabled": False}, lease=lease
    )
    location = OutputLocation(Storage(), str(tmp_path / "out"))

    proc = start_job(config_path)
    wait_for_commits(location, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in out and "(raylet)" not in out, out[-3000:]
    assert_none_left(proc)
    interrupted_units = location.committed_units()
    interrupted = location.read_manifest()
    assert interrupted["status"] == "interrupted" and interrupted["totals"]["units"] == len(interrupted_units) >= 2
    assert out.splitlines()[-1] == (
        f"specbatch: interrupted after {len(interrupted_units)} of {interrupted['attempts'][0]['units_planned']} "
        "units; rerun the same command to resume"
    )
    assert not location.storage.exists(location.path("_lease.json"))  # released: the rerun needs no --take-over

    second_started = time.time()
    second = start_job(config_path)
    wait_for_commits(location, len(interrupted_units) + 2, second)
    driver = second.pid
    os.killpg(second.pid, signal.SIGKILL)  # the driver and the local Ray it started
    second.wait()
    killed_at = time.time()
    killed_units = location.committed_units()

    # The same command at once, no flag: the dead driver ran here, and its process is gone.
    third = start_job(config_path)
    skipped = units_skipped_by_attempt(location, 3, third)  # the killed run's workers may commit while they die
    wait_for_commits(location, skipped + 2, third)
    assert time.time() - killed_at < 5 * 60
    taker = take_the_lease_elsewhere(location)
    at_takeover = location.committed_units()
    out, _ = third.communicate(timeout=180)
    fenced_exit_seconds = time.time() - taker.heartbeat_at
    assert third.returncode == 4, out[-4000:]
    assert_none_left(second, third)  # neither the fenced run's nor the killed run's
    assert f"its process {driver} on this host is gone" in out and "taking over" in out
    assert f"specbatch: fenced: {location.uri} is now leased to run {taker.owner}" in out and "succeeded" not in out
    fenced_units = location.committed_units()
    assert len(fenced_units - at_takeover) <= 1  # one engine: at most the unit between its check and its marker
    named = {location.path(f) for m in location.markers().values() for f in m.files.values()}
    dropped = {
        posixpath.basename(uri).split(".")[0]
        for uri in location.storage.list_files(location.path("outputs"))
        if f".g{taker.generation - 1}-" in uri and uri not in named
    }
    assert len(dropped) <= 2  # generated by the fenced run, refused at its check: its engine's units in flight
    print(
        f"fenced run: {len(fenced_units - at_takeover)} unit(s) committed after the takeover, {len(dropped)} generated "
        "and dropped at the check (generated again by the next run)"
    )
    assert Lease.model_validate(location.storage.read_json(location.path("_lease.json"))).owner == taker.owner

    # Elsewhere's lease falls silent after one more heartbeat (the fenced run may take longer to
    # stop than stale_after_seconds on a slow machine): the same command waits for it to go
    # stale, then finishes.
    last_beat = beat_elsewhere(location)
    waited = start_job(config_path)
    out = finish(waited)
    assert_none_left(waited)
    assert "waiting until" in out and "no heartbeat for" in out and time.time() - last_beat >= 15

    outputs = location.read_table("outputs").select(["id", "sample_index", "unit_id"]).to_pylist()
    assert Counter((o["id"], o["sample_index"]) for o in outputs) == Counter((i, s) for i in ids for s in range(4))
    units_of = {}
    for o in outputs:
        units_of.setdefault(o["id"], set()).add(o["unit_id"])
    assert all(len(units) == 1 for units in units_of.values())  # an id's samples commit together
    stats = location.read_table("stats")
    assert sum(stats.column("rows").to_pylist()) == len(ids) and sum(stats.column("samples").to_pylist()) == len(
        outputs
    )
    assert sorted(stats.column("unit_id").to_pylist()) == sorted(location.committed_units())
    assert not location.storage.exists(location.path("_lease.json"))  # released at the end
    manifest = location.read_manifest()
    assert [a["status"] for a in manifest["attempts"]] == ["interrupted", "killed", "fenced", "succeeded"]
    killed, fenced, resumed = manifest["attempts"][1:]
    assert killed["ended_at"] and 0 < killed["wall_seconds"] <= killed_at - second_started + 2  # its last heartbeat
    # what the fenced run heard of committing under its own lease: its stats file and its record
    heard = set(location.stats_files()["attempt-0003"].column("unit_id").to_pylist())
    assert len(heard) >= 2 and heard <= fenced_units - killed_units and fenced["units_skipped"] == skipped
    assert taker.owner in fenced["error"] and fenced["processed_rows"] == 8 * len(heard)
    assert resumed["units_skipped"] >= len(fenced_units) >= len(killed_units) + 2  # a worker may commit while it dies
    assert resumed["skipped_rows"] == 8 * resumed["units_skipped"]
    assert resumed["skipped_rows"] + resumed["processed_rows"] == len(ids)
    started = [dt.datetime.fromisoformat(a["started_at"]).timestamp() for a in manifest["attempts"]]
    print(
        f"takeover on this host: attempt 3 started {started[2] - killed_at:.0f} s after the SIGKILL; fenced run "
        f"exited {fenced_exit_seconds:.1f} s after the takeover; elsewhere's silent lease: attempt 4 started "
        f"{started[3] - last_beat:.0f} s after its last heartbeat (stale after 15 s)"
    )
    assert resumed["footers_read"] == 0  # the attempts before recorded both files
    assert (manifest["totals"]["output_rows"], manifest["totals"]["samples"]) == (len(ids), 4 * len(ids))

    # A finished job: rerunning it starts no generation (no Ray, no engine, no new unit).
    units = location.committed_units()
    rerun = run_job(parse_config(config), progress=False)
    assert rerun.attempts[-1].skipped_rows == len(ids) and rerun.attempts[-1].processed_rows == 0
    assert location.committed_units() == units
    assert rerun.totals.output_rows == len(ids) and rerun.totals.units == len(units) and len(rerun.attempts) == 5

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
def test_engine_core_then_engine_actor_killed_one_job_on_s3(tmp_path, s3_endpoint, random_kit):
    """One job on S3 meets two faults in turn and ends exactly once in its one attempt: vLLM's
    EngineCore is killed (the death and restart are recorded; none of the dead engine's
    processes is alive when its replacement starts), then the restarted engine's actor process
    is killed. 10 s after the job, none of its engines' processes is alive. (A store that stops
    answering mid-job: tests/test_storage_outage.py.)"""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    ids = [f"s3-{i:04d}" for i in range(N_ROWS)]
    write_prompts(
        "specbatch/outage/in/a.parquet", {"id": ids, "prompt": [f"import m{i}" for i in range(N_ROWS)]}, filesystem=fs
    )
    config = job_config(
        "s3://specbatch/outage/in/",
        "s3://specbatch/outage/out/",
        random_kit,
        storage={"endpoint_url": s3_endpoint},
        sampling={"max_tokens": 24},
        resources={"rows_per_unit": 8, "units_in_flight": 2},
    )
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    location = OutputLocation(Storage(endpoint_url=s3_endpoint), config["output_uri"])

    proc = start_job(config_path)
    wait_for_commits(location, 2, proc)
    dying = list(vllm_processes(proc.pid).values())  # its EngineCore and workers
    killed_at = kill_engine_cores(proc)  # vLLM's EngineCore dies (a GPU fault, the OOM killer)...
    wait_for_new_engine_core(killed_at, proc)
    assert not alive(dying)  # ...and none of its processes outlives it into the replacement's start
    committed = len(location.committed_units())
    wait_for_commits(location, committed + 1, proc)  # ...the restarted engine commits...
    pids = engine_actor_pids(proc)
    assert pids, "engine actor process not found"
    for pid in pids:  # ...and then the whole actor process dies (a lost node, an OOM kill of the actor)
        os.kill(pid, signal.SIGKILL)
    finish(proc)
    assert_none_left(proc)  # the job left no engine process or Ray worker
    assert len(location.committed_units()) == N_ROWS // 8
    assert_engine_death_recovered(location, ids)
    assert len(location.read_manifest()["attempts"]) == 1  # all of it recovered inside the one attempt


FAULTS_PLUGIN = str(Path(__file__).parent / "vllm_faults")


@pytest.mark.engine
def test_a_row_that_kills_the_engine_every_time_ends_alone_in_errors_then_retry_errors(tmp_path, random_kit):
    """A row whose request kills EngineCore every time (tests/vllm_faults): its unit's
    suspects run alone, half at a time, until the row kills the engine alone; it goes to
    errors/ as a final EngineCrash and every other row of its unit to outputs/ (units of 2: each
    death is an engine restart, so one halving: the unit dies, then the row alone). One error in 24
    rows is over retries.max_error_fraction: completed_with_errors, exit code 3. With the fault
    gone, --retry-errors generates it: every row in outputs/, none in errors/."""
    from transformers import AutoTokenizer

    config_path, ids, _ = make_job(
        tmp_path,
        random_kit,
        rows=24,
        retries={
            "isolate_after_attempts": 1,
            "max_error_fraction": 0.01,
            "breaker_window_units": 13,
        },  # > its 12 units: never full
        resources={"rows_per_unit": 2, "units_in_flight": 1},
    )
    poison = AutoTokenizer.from_pretrained(random_kit["target"]).encode("class K13:")  # the prompt of id-0013
    faults = {
        "PYTHONPATH": os.pathsep.join(filter(None, [FAULTS_PLUGIN, os.environ.get("PYTHONPATH")])),
        "SPECBATCH_TEST_POISON_TOKENS": ",".join(map(str, poison)),
    }
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
