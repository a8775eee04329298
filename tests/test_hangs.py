"""A frozen engine, as a GPU or NCCL hang leaves one (vLLM's EngineCore and its workers alive,
never answering): found by the engine actor's watch, recorded with its processes' stacks, its
processes killed and the engine replaced; and engines that freeze every time stop the attempt,
named. Jobs run as `specbatch run` in their own process (tests/test_resilience.py's helpers).
Its own module so that it can run beside test_resilience's group, not after it."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from pipeline.commit.outputs import OutputLocation
from pipeline.storage import Storage
from tests.test_resilience import (
    FAULTS_PLUGIN,
    alive,
    assert_exactly_once,
    assert_none_left,
    finish,
    make_job,
    start_job,
    vllm_processes,
    wait_for_commits,
)


def engine_events_after(
    location: OutputLocation, since: float, proc: subprocess.Popen, timeout: float = 300
) -> dict[str, float]:
    """The engine death and hang files recorded after `since`, once there is one (uri -> when)."""
    deadline = time.time() + timeout
    while not (found := location.engine_death_files(since=since)):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "no engine event recorded in time"
        time.sleep(0.2)
    return found


def assert_hung_event(event: dict, stall_floor: float) -> None:
    """A hang's event: where, what was in flight, how long, and the stacks of the engine's processes."""
    assert event["kind"] == "hung" and event["error"].startswith("EngineHung: the engine made no step for")
    assert event["units"] and sum(len(rows) for rows in event["rows_in_flight"].values()) > 0
    assert event["seconds_without_progress"] >= event["stall_limit_seconds"] >= stall_floor
    assert "--- process" in event["stacks"] and "Thread" in event["stacks"], event["stacks"][:2000]


@pytest.mark.engine
def test_a_frozen_engine_is_found_killed_and_replaced_and_one_that_always_freezes_trips_the_breaker(
    tmp_path, random_kit
):
    """First, every engine freezes at its first request (tests/vllm_faults stops EngineCore and
    its children with SIGSTOP, as a GPU or NCCL hang leaves them): each hang is found after the
    stall limit, recorded with the stacks of the engine's processes, its processes killed, and
    the second hang in a row with no commit between trips the breaker: exit 1, named, no engine
    process left. Then the same command without the fault resumes; the test freezes the real
    EngineCore and its children from outside after two commits: the hang is found, the engine
    replaced, every id lands exactly once, `succeeded`."""
    stall_floor = 4.0
    retries = {"engine_stall_seconds": stall_floor, "max_engine_failures": 2}
    config_path, ids, _ = make_job(tmp_path, random_kit, rows=64, retries=retries)
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    freezes = {
        "PYTHONPATH": os.pathsep.join(filter(None, [FAULTS_PLUGIN, os.environ.get("PYTHONPATH")])),
        "SPECBATCH_TEST_FREEZE_EVERY": "1",
    }
    always_frozen = start_job(config_path, freezes)
    out, _ = always_frozen.communicate(timeout=600)
    assert always_frozen.returncode == 1, out[-4000:]
    assert "specbatch: job failed: the engines failed 2 times in a row with no unit committed between (2 hung" in out, (
        out[-4000:]
    )
    assert_none_left(always_frozen)  # the frozen engines' processes were killed, none outlives the job
    manifest = location.read_manifest()
    assert manifest["status"] == "failed" and "retries.max_engine_failures = 2" in manifest["error"]
    hangs = manifest["attempts"][-1]["engine_deaths"]
    assert len(hangs) >= 2 and not location.committed_units()
    for event in hangs:
        assert_hung_event(event, stall_floor)

    job = start_job(config_path)
    wait_for_commits(location, 2, job)
    frozen = list(vllm_processes(job.pid).values())
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    frozen_at = time.time()
    ((event_file, found_at),) = engine_events_after(location, frozen_at, job).items()
    finish(job)
    ended_at = time.time()
    assert not alive(frozen)
    assert_engine_hang_recovered(location, ids, stall_floor)
    starts = location.read_manifest()["attempts"][-1]["start"]["engine_starts"]
    replaced_at = min(s["engine_ready_at"] for s in starts if s["engine_ready_at"] > frozen_at)
    first_commit = min(
        m.stats.started_at + m.stats.engine_seconds
        for m in location.markers().values()
        if m.stats.started_at > frozen_at
    )
    print(
        f"frozen engine: found {found_at - frozen_at:.1f} s after the freeze, replacement ready after "
        f"{replaced_at - frozen_at:.1f} s, its first unit generated after {first_commit - frozen_at:.1f} s, "
        f"job ended after {ended_at - frozen_at:.1f} s"
    )


def assert_engine_hang_recovered(location: OutputLocation, ids: list[str], stall_floor: float) -> None:
    assert_exactly_once(location, ids)
    assert location.read_table("errors").num_rows == 0
    manifest = location.read_manifest()
    assert manifest["status"] == "succeeded", manifest.get("error")
    (hang,) = manifest["attempts"][-1]["engine_deaths"]
    assert_hung_event(hang, stall_floor)
