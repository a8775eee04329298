"""A store that stops answering never holds a job forever (pipeline/storage/retry.py).

The store is moto's S3 server in a process of its own, frozen with SIGSTOP as a hung endpoint
leaves it (the kernel still accepts connections; nothing answers) and thawed with SIGCONT, or
killed and started again on the same port. Without an engine: one call to a store frozen for
good gives up within its bound, naming the store, the operation and the key; a commit and a
conditional write made while the store is frozen for less than the window land once after it
answers again; a store that refuses connections and comes back costs only the wait; a lease
the store does not renew for the window stops the attempt; a graph that fails while the store is
frozen ends with the store named, also when the heartbeat gives up meanwhile. With an engine: one job on S3 meets
a freeze shorter than the window and goes on, then one longer: the attempt fails (exit 1),
naming the store, and a rerun finishes every id exactly once."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from pipeline.commit.lease import OutputLease
from pipeline.commit.outputs import OutputLocation
from pipeline.config import LeaseConfig, parse_config
from pipeline.storage import Storage, StorageUnavailable
from pipeline.storage.retry import call_deadline
from tests.conftest import free_port, job_config, write_prompts
from tests.test_outputs import commit_unit, files, visible_ids

MOTO_SERVER = str(Path(sys.executable).with_name("moto_server"))
BUCKET = "specbatch"
SLACK = 1.0  # seconds of scheduling on a busy 2-core machine, beyond the bound the code promises


class MotoProcess:
    """moto's S3 server as a process of its own on 127.0.0.1, with a bucket: one that can be
    frozen (SIGSTOP), thawed (SIGCONT), killed and started again on the same port."""

    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        import boto3
        from botocore.config import Config

        self.proc = subprocess.Popen(
            [MOTO_SERVER, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            config=Config(connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1}),
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket=BUCKET)
                return
            except Exception:
                assert self.proc.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)

    def freeze(self) -> float:
        os.kill(self.proc.pid, signal.SIGSTOP)
        return time.monotonic()

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.thaw()
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def moto_process():
    server = MotoProcess()
    yield server
    server.kill()


def wait_for(condition, seconds: float, what: str):
    """Polls `condition` until it returns something true, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f}s"
        time.sleep(0.05)
    return found


def failed_attempts(caplog, operation: str) -> int:
    """How many attempts at an `operation` failed and were retried (the storage's warnings)."""
    pattern = re.compile(rf"storage: {operation} \S+ failed")
    return sum(1 for r in caplog.records if r.name == "specbatch.storage" and pattern.match(r.getMessage()))


def in_thread(call) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = call()
        except BaseException as exc:  # the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_store_frozen_for_good_fails_each_call_within_its_bound_naming_the_store_the_operation_and_the_key(
    moto_process,
):
    """The first call waits out the window (a PUT of a 1 MiB part: S3's `Expect: 100-continue`
    waits with no socket timer, so only the call's own deadline ends each attempt; before it, one
    such call never returned); the next call, with the store already given up on, ends after
    its one attempt."""
    outage, timeout = 4.0, 1.0
    storage = Storage(endpoint_url=moto_process.endpoint, outage_seconds=outage, request_timeout_seconds=timeout)
    part, marker = os.urandom(2**20), f"s3://{BUCKET}/frozen/_commits/u1.json"
    storage.write_json(marker, {"unit": "u1"})
    began = moto_process.freeze()
    with pytest.raises(StorageUnavailable) as down:
        storage.write_bytes(f"s3://{BUCKET}/frozen/outputs/u2.parquet", part)
    assert time.monotonic() - began <= outage + call_deadline(timeout, len(part)) + SLACK
    assert (down.value.store, down.value.operation, down.value.key) == (
        f"the S3 endpoint {moto_process.endpoint}",
        "write",
        f"s3://{BUCKET}/frozen/outputs/u2.parquet",
    )
    assert f"over storage.outage_seconds ({outage:g}s)" in str(down.value) and "rerun the same command" in str(
        down.value
    )

    began = time.monotonic()
    with pytest.raises(
        StorageUnavailable, match=rf"the S3 endpoint {moto_process.endpoint} has not answered .* 'read' of {marker}"
    ):
        storage.read_json(marker)
    assert time.monotonic() - began <= call_deadline(timeout) + SLACK


def test_a_commit_and_a_conditional_write_while_the_store_is_frozen_for_less_than_the_window_land_once(
    moto_process, caplog
):
    """A unit's commit (its files, then its marker: plain PUTs, the same bytes again when retried)
    and a create-if-absent write (the lease's and the manifest's kind) both wait for a frozen
    store; once it answers they land, once each, and nothing else is left."""
    storage = Storage(endpoint_url=moto_process.endpoint, outage_seconds=60, request_timeout_seconds=1)
    location = OutputLocation(storage, f"s3://{BUCKET}/brief-freeze/out")
    ids, manifest = [f"id-{i}" for i in range(8)], location.path("_job.json")
    caplog.set_level(logging.WARNING, logger="specbatch.storage")
    moto_process.freeze()
    committing, committed = in_thread(lambda: commit_unit(location, "u1", ids, failed={"id-3"}))
    creating, created = in_thread(lambda: storage.write_if(manifest, b'{"status": "running"}\n', None))
    wait_for(lambda: failed_attempts(caplog, "write") >= 4, 30, "both writes failing on the frozen store, twice each")
    moto_process.thaw()
    committing.join(60), creating.join(60)
    assert "error" not in committed and "error" not in created, (committed, created)

    assert location.committed_units() == {"u1"} and visible_ids(location) == Counter(ids)
    marker = committed["result"]
    assert sorted(files(location)) == sorted(
        location.path(f) for f in marker.files.values()
    )  # one file each, no duplicate
    assert storage.read_versioned(manifest) == (b'{"status": "running"}\n', created["result"])


def test_a_store_that_refuses_connections_and_comes_back_within_the_window_costs_only_the_wait(caplog):
    """The endpoint gone (connections refused), then back on the same port with its objects
    (moto in this process keeps them across a restart of its server)."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="restarted")
    storage = Storage(endpoint_url=endpoint, outage_seconds=60, request_timeout_seconds=1)
    uri = "s3://restarted/_events/restart.json"
    caplog.set_level(logging.WARNING, logger="specbatch.storage")
    server.stop()
    try:
        writing, wrote = in_thread(lambda: storage.write_json(uri, {"written": True}))
        wait_for(lambda: failed_attempts(caplog, "write") >= 2, 30, "the write refused twice")
        assert any("Could not connect" in r.getMessage() for r in caplog.records)  # refused, not timed out
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        writing.join(60)
        assert "error" not in wrote, wrote
        assert storage.read_json(uri) == {"written": True}
    finally:
        server.stop()


def test_a_lease_the_frozen_store_does_not_renew_for_the_window_stops_the_attempt(moto_process):
    """The heartbeat gives up after the window and the run's next look at its lease raises the
    store's error: the attempt stops instead of holding the lease for nothing."""
    outage, timeout, beat = 3.0, 1.0, 0.5
    storage = Storage(endpoint_url=moto_process.endpoint, outage_seconds=outage, request_timeout_seconds=timeout)
    location = OutputLocation(storage, f"s3://{BUCKET}/lease/out")
    lease = OutputLease(location, LeaseConfig(heartbeat_seconds=beat, stale_after_seconds=60), "job", 1)
    lease.acquire()
    frozen_at = moto_process.freeze()
    lost = wait_for(lambda: lease.lost, beat + outage + call_deadline(timeout) + SLACK, "the heartbeat giving up")
    assert time.monotonic() - frozen_at <= beat + outage + call_deadline(timeout) + SLACK
    assert isinstance(lost, StorageUnavailable) and lost.key == location.path("_lease.json")
    with pytest.raises(StorageUnavailable, match="_lease.json"):
        lease.still_ours()
    moto_process.thaw()
    lease.release()  # the store answers again: the lease is given back
    assert not storage.exists(location.path("_lease.json"))


def test_retry_seconds_is_outage_seconds_former_name():
    assert parse_config(job_config("in", "out", KIT, storage={"retry_seconds": 30})).storage.outage_seconds == 30
    with pytest.raises(Exception, match="former name of storage.outage_seconds"):
        parse_config(job_config("in", "out", KIT, storage={"retry_seconds": 30, "outage_seconds": 40}))


KIT = {"target": "/nonexistent/target", "drafter": "/nonexistent/drafter"}


# ---------------------------------------------------------------- one job on S3, frozen twice


class JobOutput(threading.Thread):
    """The lines a `specbatch run` process prints, each with when it arrived (its stderr is
    line-buffered: the storage's warnings and the failure come as they are written)."""

    def __init__(self, job: subprocess.Popen):
        super().__init__(daemon=True)
        self.job, self.lines = job, []
        self.start()

    def run(self) -> None:
        for line in self.job.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def since(self, moment: float) -> list[str]:
        return [line for at, line in self.lines if at >= moment]

    def first(self, text: str) -> tuple[float, str] | None:
        return next(((at, line) for at, line in self.lines if text in line), None)

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-60:])


def wait_for_units(
    location: OutputLocation, n: int, job: subprocess.Popen, output: JobOutput, timeout: float = 300
) -> None:
    deadline = time.time() + timeout
    while len(location.committed_units()) < n:
        assert job.poll() is None, output.tail()
        assert time.time() < deadline, f"{n} units not committed in time: {output.tail()}"
        time.sleep(0.5)


@pytest.mark.engine
def test_a_job_on_s3_rides_out_a_short_freeze_fails_named_on_a_long_one_and_a_rerun_finishes_it(
    tmp_path, moto_process, random_kit
):
    """The S3 server frozen for half the outage window mid-job: the job goes on (its calls
    waited: the driver said so), and commits again. Frozen again for good: the attempt fails
    within the window and a few calls' deadlines, exit 1, one line naming the store, the
    operation and the key. Thawed, the same command resumes and every id lands exactly once."""
    import s3fs

    from tests.test_resilience import assert_exactly_once, assert_none_left, start_job

    outage, timeout, rows = 12.0, 2.0, 96
    endpoint = moto_process.endpoint
    ids = [f"s3-{i:03d}" for i in range(rows)]
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    write_prompts(
        f"{BUCKET}/job/in/a.parquet", {"id": ids, "prompt": [f"def f{i}(x):" for i in range(rows)]}, filesystem=fs
    )
    config = job_config(
        f"s3://{BUCKET}/job/in/",
        f"s3://{BUCKET}/job/out/",
        random_kit,
        storage={"endpoint_url": endpoint, "outage_seconds": outage, "request_timeout_seconds": timeout},
        lease={"heartbeat_seconds": 2.0, "stale_after_seconds": 60.0},
        sampling={"max_tokens": 16},
        resources={"rows_per_unit": 8, "units_in_flight": 2},
    )
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    location = OutputLocation(Storage(endpoint_url=endpoint, request_timeout_seconds=timeout), config["output_uri"])

    job = start_job(config_path, {"PYTHONUNBUFFERED": "1"})
    output = JobOutput(job)
    wait_for_units(location, 1, job, output)
    moto_process.freeze()  # shorter than the window: the fault's length, not a wait for an event
    frozen_at = time.time()
    time.sleep(outage / 2)
    moto_process.thaw()
    assert job.poll() is None, output.tail()
    wait_for_units(location, len(location.committed_units()) + 1, job, output)
    waited = [line for line in output.since(frozen_at) if re.match(r"storage: \w+ s3://\S+ failed", line)]
    assert waited, output.tail()  # the freeze was felt, and cost only the wait

    moto_process.freeze()  # for good
    frozen_at = time.time()
    job.wait(timeout=10 * outage)  # the bound on the whole attempt's end: its close, its engines, its Ray
    ended_after = time.time() - frozen_at
    output.join(10)
    gave_up_at, first = output.first("storage unavailable: ") or (None, output.tail())
    failure = output.first("specbatch: job failed: storage unavailable: ")
    assert job.returncode == 1 and gave_up_at is not None and failure is not None, output.tail()
    named = re.search(
        rf"the S3 endpoint {endpoint} has not answered for \d+s, over storage.outage_seconds \(12s\); "
        rf"gave up on '(\w+)' of (s3://{BUCKET}/job/\S+) ",
        failure[1],
    )
    assert named and "rerun the same command" in failure[1], failure[1]
    gave_up_after = gave_up_at - frozen_at  # the heartbeat's renewal began within a beat of the freeze
    assert gave_up_after <= config["lease"]["heartbeat_seconds"] + outage + call_deadline(timeout) + 5 * SLACK, first
    assert_none_left(job)  # no engine or Ray worker of the failed attempt outlives it
    print(
        f"store frozen for good: the driver gave up on it {gave_up_after:.1f} s after the freeze, the attempt "
        f"ended {ended_after:.1f} s after it (exit 1, '{named[1]}' of {named[2]})"
    )

    moto_process.thaw()
    thawed_at = time.time()
    rerun = start_job(config_path)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out[-4000:]
    assert_exactly_once(location, ids)
    manifest = location.read_manifest()
    assert [a["status"] for a in manifest["attempts"]][-1] == "succeeded" and len(manifest["attempts"]) == 2
    print(
        f"thawed {thawed_at - frozen_at:.1f} s after the freeze; the rerun finished the job "
        f"{time.time() - thawed_at:.1f} s later ({time.time() - frozen_at:.1f} s after the freeze)"
    )


# ---------------------------------------------------------------- a graph that fails on a frozen store

# A driver's graph (pipeline/job/graph_run.run_graph) whose one task raises while the store is
# frozen: the driver's check of its lease then waits on the store, and the heartbeat gives up on
# it meanwhile. Run in a process of its own: the stall watch raises in the main thread. The
# attempt is the GraphAttempt seam's smallest form (a graph of no units); Ray, the job board,
# the lease and its heartbeat are real.
FAILING_GRAPH = """
import sys, threading, time
import ray
from pipeline.cluster.job_board import start_board
from pipeline.cluster.startup import StartClock
from pipeline.commit.lease import OutputLease
from pipeline.commit.outputs import OutputLocation
from pipeline.config import LeaseConfig, parse_config
from pipeline.job.graph_run import AttemptProgress, run_graph
from pipeline.job.plan import RunOptions
from pipeline.storage import Storage
from schemas import Attempt, utc_timestamp
from tests.conftest import job_config

endpoint, outage, task_fails_after = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
storage = Storage(endpoint_url=endpoint, outage_seconds=outage, request_timeout_seconds=1)


class SmallestAttempt:
    config = parse_config(job_config("in", "s3://specbatch/graph/out", {"target": "/t", "drafter": "/d"}))
    options, clock, unit_stats, started = RunOptions(progress=False), StartClock(), {}, time.time()
    location = OutputLocation(storage, "s3://specbatch/graph/out")
    lease = OutputLease(location, LeaseConfig(heartbeat_seconds=0.5, stale_after_seconds=60), "job", 1)
    record = Attempt(number=1, started_at=utc_timestamp(), status="running", skipped_rows=0)

    class manifest:
        job_id, probe, trial = "job", None, None

    def save(self):
        pass

    def write_stats(self):
        pass


ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
ray.data.range(1).materialize()  # Ray Data's workers warm: the task below fails when it is told to
attempt = SmallestAttempt()
attempt.lease.acquire()
lease_lost_at = []


def note_when_the_lease_is_lost():
    while attempt.lease.lost is None:
        time.sleep(0.05)
    lease_lost_at.append(time.time())


threading.Thread(target=note_when_the_lease_is_lost, daemon=True).start()


def engine_fails(batch, fail_at):
    time.sleep(max(0.0, fail_at - time.time()))
    raise RuntimeError("the unit's engine failed")


# The store is frozen once the watch has had its first look (one second in; the next is ten
# seconds later): from then on it looks each second whether the heartbeat gave up.
started = time.time()
frozen_at = started + 4.0
threading.Timer(frozen_at - started, lambda: print("freeze", flush=True)).start()
dataset = ray.data.range(1).map_batches(engine_fails, fn_kwargs={"fail_at": frozen_at + task_fails_after})
try:
    run_graph(dataset, [], AttemptProgress(attempt, 0, None), start_board([]))
except BaseException as exc:
    print(f"ended by {type(exc).__name__}: {str(exc)[:300]}", flush=True)
print(f"heartbeat gave up after {lease_lost_at[0] - frozen_at if lease_lost_at else -1:.1f}", flush=True)
"""


def test_a_graph_that_fails_while_the_store_is_frozen_ends_as_the_stores_outage(moto_process):
    """The graph fails (an engine's error) 3 s into a freeze; the driver's check of its lease then
    waits on the store, and the heartbeat gives up on it meanwhile (about 7 s in, outage 6 s),
    which the stall watch turns into an interrupt of the driver. The graph ends with the store
    named (StorageUnavailable), never with the interrupt: a CI run of the S3 job below ended so,
    with a traceback. Before the fix, 3 runs of 3 here ended with StallInterrupt."""
    driver = subprocess.Popen(
        [sys.executable, "-c", FAILING_GRAPH, moto_process.endpoint, "6", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert driver.stdout.readline().strip() == "freeze", driver.stderr.read()[-3000:]
    moto_process.freeze()
    out, err = driver.communicate(timeout=120)
    moto_process.thaw()
    ended = re.search(r"ended by (\w+): (.*)", out)
    assert ended and ended[1] == "StorageUnavailable", out + err[-3000:]
    assert f"the S3 endpoint {moto_process.endpoint} has not answered" in ended[2]
    print(out)  # when the heartbeat gave up, after the freeze
