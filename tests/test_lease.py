"""The lease on an output location and the layout version, without an engine: a live owner is
refused, a dead one taken over without a flag (at once on this host, once stale elsewhere), a
run whose lease was taken is fenced, two runs at one instant make one owner, and a location of
another output layout, or of results made with other settings or a drafter rewritten in place,
is refused before anything is written."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pyarrow as pa
import pytest

from pipeline.commit.fence import check_fence, read_lease
from pipeline.commit.lease import LeaseHeld, LeaseLost, OutputLease
from pipeline.commit.outputs import LayoutMismatch, OutputLocation
from pipeline.config import LeaseConfig, parse_config
from pipeline.job.runner import run_job
from pipeline.storage import Storage, json_bytes
from schemas import Lease
from tests.conftest import job_config

FAST = LeaseConfig(heartbeat_seconds=0.2, stale_after_seconds=1.0, wait_seconds=1.0)
SLOW = LeaseConfig(heartbeat_seconds=30, stale_after_seconds=600, wait_seconds=0)


def test_a_live_lease_refuses_a_second_run_even_with_take_over(location):
    first = OutputLease(location, FAST, "job-1", 1)
    first.acquire()
    try:
        time.sleep(1.5)  # longer than stale_after: only the heartbeat keeps it live
        second = OutputLease(location, FAST, "job-1", 2)
        with pytest.raises(LeaseHeld, match=r"leased to run .*job-1, attempt 1.*alive") as err:
            second.acquire(take_over=True)
        assert first.lease.owner in str(err.value) and f"`kill -INT {os.getpid()}`" in str(err.value)
        assert "rerun with --take-over" not in str(err.value)
    finally:
        first.release()
    assert first.current() is None  # released: the next run just takes it
    third = OutputLease(location, FAST, "job-1", 3)
    third.acquire()
    third.release()


def held_by(
    location,
    host: str,
    *,
    pid: int | None = None,
    started: float | None = None,
    age: float = 0.0,
    stale_after: float = 1.0,
    generation: int = 3,
) -> Lease:
    """A lease another run wrote (through the store's own compare-and-swap), as it reads."""
    lease = Lease(
        owner=f"{host}:{pid or 1}:abcd1234",
        job_id="job-1",
        attempt=1,
        acquired_at="2026-12-03T00:00:00+00:00",
        heartbeat_at=time.time() - age,
        stale_after_seconds=stale_after,
        host=host,
        pid=pid,
        pid_started_at=started,
        generation=generation,
    )
    location.storage.write_if(location.path("_lease.json"), json_bytes(lease.model_dump(mode="json")), None)
    return lease


def test_a_dead_process_on_this_host_is_taken_over_at_once_without_a_flag(location):
    """The owner ran here and its process is gone (a SIGKILLed driver): no wait, no --take-over.
    A pid reused by another process (another start time) is not the owner either."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(dead.stdout)
    assert not psutil.pid_exists(gone)
    held_by(location, socket.gethostname(), pid=gone, started=time.time() - 5, stale_after=600)
    said, began = [], time.time()
    successor = OutputLease(location, SLOW, "job-1", 2)
    taken = successor.acquire(say=said.append)
    try:
        assert time.time() - began < 5 and taken.pid == gone
        assert successor.current().owner == successor.lease.owner and successor.current().generation == 4
        assert any(f"its process {gone} on this host is gone" in line for line in said), said
    finally:
        successor.release()

    held_by(
        location, socket.gethostname(), pid=os.getpid(), started=psutil.Process().create_time() - 100, stale_after=600
    )
    reused = OutputLease(location, SLOW, "job-1", 3)
    reused.acquire(say=said.append)  # our pid, another process's start time: that process is gone
    reused.release()


@pytest.fixture
def sleeper():
    """A live process on this host to own a lease, as a run's driver would: a Python child that
    sleeps, and ends at an interrupt (Python's own handler, as the driver's: not one inherited as ignored)."""
    code = (
        "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); print('ready', flush=True); "
        "time.sleep(600)"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as child:
        assert child.stdout.readline() == "ready\n"  # its handler is in place
        yield child
        if child.poll() is None:
            child.kill()  # also ends a stopped one


def held_by_process(location, child: subprocess.Popen) -> Lease:
    """The lease of a run whose driver is `child`, silent for a minute: stale by its heartbeat."""
    return held_by(
        location, socket.gethostname(), pid=child.pid, started=psutil.Process(child.pid).create_time(), age=60
    )


def the_command_in(message: str) -> str:
    """The first command a refusal quotes (between backticks)."""
    return message.split("`")[1]


def test_take_over_of_an_owner_alive_here_names_its_process_and_how_to_end_it(location, sleeper):
    """Alive here, a heartbeat silent for a minute does not matter; --take-over is refused too,
    and the refusal names the process and the command that ends it, never the flag just given.
    The command works: the process ends, and the same run takes the location over at once."""
    host, pid = socket.gethostname(), sleeper.pid
    held_by_process(location, sleeper)
    with pytest.raises(LeaseHeld) as refused:
        OutputLease(location, SLOW, "job-1", 2).acquire(take_over=True)
    message = str(refused.value)
    assert f"its process {pid} on this host ({host}) is " in message
    assert "--take-over takes a location only from a run that is dead" in message
    assert the_command_in(message) == f"kill -INT {pid}" and "rerun with --take-over" not in message
    with pytest.raises(LeaseHeld) as without_flag:
        OutputLease(location, SLOW, "job-1", 2).acquire()  # without the flag: the same way out, no flag suggested
    assert f"its process {pid} on this host ({host}) is " in str(without_flag.value)
    assert the_command_in(str(without_flag.value)) == f"kill -INT {pid}" and "--take-over" not in str(
        without_flag.value
    )

    subprocess.run(["sh", "-c", the_command_in(message)], check=True)
    sleeper.wait(timeout=60)  # it would sleep for 10 minutes: the interrupt ended it
    said = []
    successor = OutputLease(location, SLOW, "job-1", 2)
    assert successor.acquire(take_over=True, say=said.append).pid == pid
    successor.release()
    assert f"its process {pid} on this host is gone" in said[-1], said


def test_a_stopped_owner_here_is_refused_with_how_to_continue_and_end_it(location, sleeper):
    """A driver paused with SIGSTOP is not dead (its engines would hold this host's resources):
    refused with or without --take-over, and in a dry run; the refusal's command ends it."""
    pid = sleeper.pid
    held_by_process(location, sleeper)
    os.kill(pid, signal.SIGSTOP)
    _, status = os.waitpid(pid, os.WUNTRACED)  # returns once the child has stopped
    assert os.WIFSTOPPED(status)
    with pytest.raises(LeaseHeld) as refused:
        OutputLease(location, SLOW, "job-1", 2).acquire(take_over=True)
    message = str(refused.value)
    assert "that run is stopped, not dead" in message and "is in state 'stopped' (Ctrl-Z or SIGSTOP)" in message
    assert the_command_in(message) == f"kill -INT {pid} && kill -CONT {pid}" and "rerun with --take-over" not in message
    with pytest.raises(LeaseHeld, match=f"kill -INT {pid} && kill -CONT {pid}"):
        OutputLease(location, SLOW, "job-1", 2).check(take_over=True)  # the dry run says the same
    with pytest.raises(
        LeaseHeld, match=rf"that run is stopped, not dead: .* end it: `kill -INT {pid} && kill -CONT {pid}`"
    ):
        OutputLease(location, SLOW, "job-1", 2).acquire()  # without the flag: the same way out

    subprocess.run(["sh", "-c", the_command_in(message)], check=True)
    sleeper.wait(timeout=60)  # continued, it ended at the interrupt
    successor = OutputLease(location, SLOW, "job-1", 2)
    assert successor.acquire().pid == pid  # no flag: its process is gone
    successor.release()


def test_an_owner_that_ended_but_was_not_reaped_yet_is_gone(location):
    """A zombie (a driver that exited, its parent not having waited for it yet) runs no more."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited; still unreaped
    assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    held_by(
        location, socket.gethostname(), pid=child.pid, started=psutil.Process(child.pid).create_time(), stale_after=600
    )
    successor = OutputLease(location, SLOW, "job-1", 2)
    try:
        assert successor.acquire().pid == child.pid
    finally:
        successor.release()
        child.wait()


def test_a_silent_owner_elsewhere_is_waited_for_until_stale_then_taken_over(location):
    silent = held_by(location, "elsewhere", pid=1, stale_after=1.5)
    said, began = [], time.time()
    successor = OutputLease(location, FAST.model_copy(update={"wait_seconds": 10}), "job-1", 2)
    successor.acquire(say=said.append)
    try:
        # taken once stale: 1.5 s after the owner's last heartbeat (the write of its lease, which a
        # loaded store can make take a while, is not part of the wait), and well within wait_seconds
        assert time.time() - silent.heartbeat_at >= 1.5 and time.time() - began < 10
        assert "waiting until" in said[0] and "for it to go stale" in said[0], said
        assert "no heartbeat for" in said[-1] and "its run is dead" in said[-1]
        assert successor.current().owner == successor.lease.owner
    finally:
        successor.release()


def test_an_owner_elsewhere_that_keeps_beating_is_refused_and_the_wait_is_bounded(location):
    owner = OutputLease(location, FAST, "job-1", 1)
    owner.lease.host = "elsewhere"  # its process is not this host's to look at: only its heartbeat tells
    owner.acquire()
    try:
        began = time.time()
        with pytest.raises(LeaseHeld, match="renewed while this run waited"):
            OutputLease(location, FAST, "job-1", 2).acquire()
        assert time.time() - began < 3 * FAST.heartbeat_seconds + 1
    finally:
        owner.release()
    held_by(location, "elsewhere", pid=1, stale_after=600)
    with pytest.raises(LeaseHeld, match=r"goes stale in \d+s, and that is after lease.wait_seconds \(1s\)"):
        OutputLease(location, FAST, "job-1", 2).acquire()
    taker = OutputLease(location, FAST, "job-1", 2)
    taker.acquire(take_over=True)  # a person who knows it is dead
    taker.release()


def test_a_run_whose_lease_another_run_took_is_fenced(location):
    """The new owner's compare-and-swap wins: the old run's next renewal finds it, its engines'
    check refuses to commit, its release leaves the new owner's lease."""
    old = OutputLease(location, FAST, "job-1", 1)
    old.lease.host = "elsewhere"
    old.acquire()
    new = OutputLease(location, FAST, "job-1", 2)
    new.acquire(take_over=True)
    try:
        assert new.lease.generation == old.lease.generation + 1
        deadline = time.time() + 5
        while old.lost is None and time.time() < deadline:
            time.sleep(0.05)
        assert old.lost is not None and old.lost.owner.owner == new.lease.owner
        with pytest.raises(LeaseLost, match=f"now leased to run {new.lease.owner} \\(attempt 2\\)"):
            check_fence(location.storage, location.uri, old.fence)
        with pytest.raises(LeaseLost):
            old.still_ours()
        check_fence(location.storage, location.uri, new.fence)
        # the commit the engines run: the old run's unit is refused before its marker, the new one's lands
        from tests.test_outputs import stats as outputs_stats

        with pytest.raises(LeaseLost):
            location.commit(
                "u-old", {"outputs": pa.table({"id": ["a"]})}, outputs_stats("u-old", rows=1, outputs=1), old.fence
            )
        marker = location.commit(
            "u-new", {"outputs": pa.table({"id": ["b"]})}, outputs_stats("u-new", rows=1, outputs=1), new.fence
        )
        assert location.committed_units() == {"u-new"} and marker.stats.lease_owner == new.lease.owner
        assert marker.token.startswith(f"g{new.lease.generation}-")
        old.release()
        assert new.current().owner == new.lease.owner
    finally:
        new.release()
    assert new.current() is None


@pytest.mark.parametrize("round_", range(10))
def test_two_runs_started_at_the_same_instant_one_proceeds(location, round_):
    """Two runs at one instant, as threads released by a barrier: the store's conditional write
    decides, not timing (threads make the race tighter than processes would; moto 5.2 honours
    If-None-Match and If-Match on PutObject as S3 does, and local folders lock)."""
    barrier, outcomes = threading.Barrier(2), []

    def run(attempt: int) -> None:
        lease = OutputLease(location, SLOW, "job-1", attempt)
        barrier.wait()
        try:
            lease.acquire()
            outcomes.append(("proceeds", lease))
        except LeaseHeld as refused:
            outcomes.append(("refused", refused))

    threads = [threading.Thread(target=run, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(kind for kind, _ in outcomes) == ["proceeds", "refused"], outcomes
    (winner,) = [lease for kind, lease in outcomes if kind == "proceeds"]
    assert winner.current().owner == winner.lease.owner and winner.lease.generation == 1
    winner.release()


def test_fenced_attempts_record_survives_the_owners_manifest(location):
    """_job.json: the fenced run records its own attempt; the owner's later writes keep it."""
    owner_view = {"job_id": "j", "attempts": [{"number": 1, "status": "killed"}, {"number": 2, "status": "running"}]}
    location.write_manifest(dict(owner_view))
    location.record_fenced_attempt({"number": 1, "status": "fenced", "processed_rows": 24})
    location.write_manifest(dict(owner_view, status="succeeded"))
    doc = location.read_manifest()
    assert doc["status"] == "succeeded"
    assert doc["attempts"] == [
        {"number": 1, "status": "fenced", "processed_rows": 24},
        {"number": 2, "status": "running"},
    ]


def test_a_location_of_another_layout_is_refused_untouched(tmp_path):
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    old = {"job_id": "old", "status": "succeeded", "input_files": ["a.parquet"]}  # layout 1 wrote no version
    location.write_manifest(old)
    config = parse_config(
        job_config(str(tmp_path / "in"), str(tmp_path / "out"), {"target": "/m/t", "drafter": "/m/d"})
    )
    with pytest.raises(LayoutMismatch, match=r"output layout 1; this specbatch writes layout 2.*--restart"):
        run_job(config, progress=False)
    assert location.read_manifest() == old and not location.storage.exists(location.path("_lease.json"))


def test_a_manifest_that_breaks_the_contract_is_refused_naming_its_fields(tmp_path, capsys):
    """A `_job.json` of this layout that is not a manifest (a hand edit, another tool) is a refusal
    (exit 2) that names its fields, for the run, status and the report; it was a crash."""
    import yaml

    from pipeline.cli import run_from_config
    from pipeline.tools.cost import ReportError, read_job
    from pipeline.tools.status import StatusError, job_status

    location = OutputLocation(Storage(), str(tmp_path / "out"))
    broken = {"layout_version": 2, "job_id": "j", "status": "finished-ish"}
    location.write_manifest(broken)
    config_path = tmp_path / "job.yaml"
    config_path.write_text(
        yaml.safe_dump(job_config(str(tmp_path / "in"), location.uri, {"target": "/m/t", "drafter": "/m/d"}))
    )
    assert run_from_config(str(config_path)) == 2
    said = capsys.readouterr().err
    assert "_job.json does not match the job manifest contract" in said and "status" in said, said
    for read, error in (
        (lambda: job_status(location.storage, location.uri), StatusError),
        (lambda: read_job(location.storage, location.uri), ReportError),
    ):
        with pytest.raises(error, match=r"_job\.json does not match the job manifest contract: .*status"):
            read()
    assert location.read_manifest() == broken and not location.storage.exists(location.path("_lease.json"))


def test_a_drafter_rewritten_in_place_is_refused_on_resume(tmp_path, random_kit):
    """Same config, same size, new bytes (a retrained drafter copied over the old one): a resume
    would mix two drafters' outputs under one output location, so it is refused, naming the
    file, before any engine starts. The manifest is the one a finished job writes."""
    import shutil
    from pathlib import Path

    from pipeline.inputs import inspect_inputs
    from pipeline.job.manifest import versions
    from pipeline.job.plan import ResultsChanged, model_fingerprint, plan_job, results_fingerprint
    from schemas import LAYOUT_VERSION, JobManifest, JobTotals
    from tests.conftest import write_prompts
    from tests.test_outputs import stats as outputs_stats

    kit = {name: str(shutil.copytree(path, tmp_path / "kit" / name)) for name, path in random_kit.items()}
    write_prompts(tmp_path / "in" / "p.parquet", {"id": ["a", "b"], "prompt": ["x", "y"]})
    config = parse_config(job_config(str(tmp_path / "in"), str(tmp_path / "out"), kit))
    location = OutputLocation(Storage(), config.output_uri)
    target, drafter = model_fingerprint(config.model.path), model_fingerprint(config.speculative.drafter)
    location.write_manifest(
        JobManifest(
            layout_version=LAYOUT_VERSION,
            job_id="j",
            status="succeeded",
            started_at="2026-12-03T00:00:00+00:00",
            config=config.redacted(),
            results_fingerprint=results_fingerprint(config, target, drafter),
            versions=versions(),
            model=target,
            drafter=drafter,
            accelerator="cpu",
            input_files=inspect_inputs(config.input_uri, location.storage).files,
            totals=JobTotals(input_rows=2),
            attempts=[],
        ).model_dump(mode="json")
    )
    plan = plan_job(config)
    assert plan.previous.job_id == "j" and plan.todo  # the same drafter: a resume
    location.commit(
        plan.todo[0].unit_id,
        {"outputs": pa.table({"id": ["a"]})},
        outputs_stats(plan.todo[0].unit_id, rows=1, outputs=1),
    )
    weights = Path(kit["drafter"]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    with pytest.raises(ResultsChanged, match=r"drafter files: model\.safetensors"):
        plan_job(config)


# ---------------------------------------------------------------- refused before any engine starts


def refused(capsys, config_path, *flags) -> str:
    from pipeline.cli import run_from_config

    assert run_from_config(str(config_path), *flags) == 2
    return capsys.readouterr().err


def write_job(tmp_path, kit: dict, columns: dict, **overrides):
    import yaml

    from tests.conftest import write_prompts

    write_prompts(tmp_path / "in" / "chat.parquet", columns)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config(str(tmp_path / "in"), str(tmp_path / "out"), kit, **overrides)))
    return path


def test_a_changed_setting_blocks_a_resume_only_when_something_was_committed(tmp_path, capsys):
    """The earlier attempt committed nothing: the changed config goes ahead (here to the next
    check, which refuses its max_tokens). Once a unit is committed, the change is refused,
    naming the setting and the flag that starts over."""
    from pipeline.job.manifest import versions
    from pipeline.job.plan import model_fingerprint
    from tinykit import kit_paths
    from schemas import LAYOUT_VERSION, JobManifest, JobTotals

    kit = kit_paths()
    path = write_job(
        tmp_path,
        {"target": kit["target"], "drafter": kit["drafter_eagle31"]},
        {"id": ["p"], "prompt": ["x = 1"]},
        sampling={"max_tokens": 300},
    )
    earlier = parse_config(
        job_config(
            str(tmp_path / "in"), str(tmp_path / "out"), {"target": kit["target"], "drafter": kit["drafter_eagle31"]}
        )
    )
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    location.write_manifest(
        JobManifest(
            layout_version=LAYOUT_VERSION,
            job_id="earlier",
            status="failed",
            started_at="2026-11-30T00:00:00+00:00",
            config=earlier.redacted(),
            results_fingerprint="0" * 64,
            versions=versions(),
            model=model_fingerprint(kit["target"]),
            drafter=model_fingerprint(kit["drafter_eagle31"]),
            accelerator="cpu",
            input_files=[],
            totals=JobTotals(),
        ).model_dump(mode="json")
    )
    assert "sampling.max_tokens (300) leaves no room" in refused(capsys, path)

    location.storage.write_json(location.path("_commits", "u.json"), {})
    err = refused(capsys, path)
    assert "holds results of job earlier made with other settings (sampling: " in err and "--restart" in err


def test_a_lease_write_that_landed_but_whose_answer_was_lost_is_found_as_this_runs_own(location):
    """A create of the lease that timed out on its answer is retried by the storage layer; the
    retry finds the object there (412) and the run reads it: its own owner id in it is its lease,
    never a live run to refuse. The lease as the lost answer left it: written, this run not told."""
    run = OutputLease(location, SLOW, "job-1", 1)
    run.lease.generation = 1
    location.storage.write_if(location.path("_lease.json"), json_bytes(run.lease.model_dump(mode="json")), None)
    assert run.acquire() is None  # nothing taken over: the lease was free before this run's own write
    try:
        assert read_lease(location.storage, location.uri).owner == run.lease.owner and run.lease.generation == 1
        run.still_ours()
    finally:
        run.release()
    assert read_lease(location.storage, location.uri) is None
