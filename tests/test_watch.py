"""The driver's job watch (pipeline/job/watch.py) on a real local Ray and a real job board, with
no engine: the board holds what engines would report, `_events/` what they would record. The
attempt is the few fields the watch reads of the driver's JobAttempt."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pipeline.cluster import ClusterWatch, SchedulingStalled
from pipeline.cluster.job_board import start_board
from pipeline.commit.outputs import OutputLocation
from pipeline.inputs.units import WorkUnit
from pipeline.config import parse_config
from pipeline.job.watch import AttemptLooks, EnginesKeepFailing, JobStalled
from pipeline.storage import Storage
from schemas import JobProgress
from tests.conftest import job_config

KIT = {"target": "/models/target", "drafter": "/models/drafter"}


def attempt_at(tmp_path, unit_stats: dict | None = None, **retries) -> SimpleNamespace:
    config = parse_config(
        job_config(
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            KIT,
            retries={"stall_minutes": 0.5, "max_engine_failures": 2, **retries},
        )
    )
    return SimpleNamespace(
        config=config,
        manifest=SimpleNamespace(job_id="job-1"),
        record=SimpleNamespace(number=3),
        started=time.time() - 120,
        unit_stats=unit_stats or {},
        location=OutputLocation(Storage(), config.output_uri),
    )


def units(*ids: str) -> list[WorkUnit]:
    return [
        WorkUnit(unit_id=i, source="in/a.parquet", size=1000, first_row=0, rows=8, text_column="prompt") for i in ids
    ]


def report(board, actor: str, requests: int, last_output_ago: float, reported_ago: float = 1.0) -> None:
    import ray

    now = time.time()
    ray.get(
        board.report_progress.remote(
            {
                "actor_id": actor,
                "node_id": "node-" + actor,
                "requests_in_flight": requests,
                "last_output_at": now - last_output_ago,
                "reported_at": now - reported_ago,
            }
        )
    )


def hang(location: OutputLocation, actor: str) -> None:
    location.record_engine_death(
        {
            "time": "2026-12-06T00:00:00+00:00",
            "actor_id": actor,
            "node_id": "node-1",
            "error": "EngineHung: no step",
            "units": ["u1"],
            "kind": "hung",
            "rows_in_flight": {"u1": [0, 1]},
            "seconds_without_progress": 9.0,
            "stall_limit_seconds": 8.0,
        }
    )


def test_no_commit_and_no_engine_generating_is_a_stall_naming_what_it_waited_for(tmp_path, ray_local):
    attempt = attempt_at(tmp_path, unit_stats={"u1": {}})
    board = start_board([])
    look = AttemptLooks(attempt, board, ClusterWatch(), units("u1", "u2", "u3"))
    report(board, "aaaaaaaa11", requests=0, last_output_ago=200)
    report(board, "bbbbbbbb22", requests=5, last_output_ago=100)  # holds requests, no step within the window
    assert look(10.0) is None  # committed 10 s ago: nothing to say yet
    stalled = look(31.0)
    assert isinstance(stalled, JobStalled)
    message = str(stalled)
    assert message.startswith(
        "no unit committed for 0.5 minutes (retries.stall_minutes = 0.5) and no engine is generating"
    )
    assert "waited for 2 units (u2, u3)" in message and "replica bbbbbbbb: 5 requests, last step 100 s ago" in message
    progress = JobProgress.model_validate(attempt.location.read_progress())  # what status reads
    assert progress.attempt == 3 and {r.actor_id for r in progress.replicas} == {"aaaaaaaa11", "bbbbbbbb22"}
    assert abs(progress.last_commit_at - (time.time() - 31.0)) < 5


def test_an_engine_still_generating_is_left_to_finish_its_long_units(tmp_path, ray_local):
    board = start_board([])
    look = AttemptLooks(attempt_at(tmp_path), board, ClusterWatch(), units("u1"))
    report(board, "aaaaaaaa11", requests=5, last_output_ago=0.5)
    assert look(3600.0) is None
    report(board, "aaaaaaaa11", requests=5, last_output_ago=0.5, reported_ago=120)  # its actor stopped reporting
    assert isinstance(look(3600.0), JobStalled)


def test_no_engine_reported_at_all_says_so(tmp_path, ray_local):
    look = AttemptLooks(attempt_at(tmp_path), start_board([]), ClusterWatch(), units("u1"))
    assert "none has reported (no engine actor started" in str(look(60.0))


def test_engine_failures_in_a_row_without_a_commit_trip_the_breaker(tmp_path, ray_local, caplog):
    attempt = attempt_at(tmp_path, stall_minutes=60)
    look = AttemptLooks(attempt, start_board([]), ClusterWatch(), units("u1"))
    hang(attempt.location, "aaaaaaaa11")
    assert look(60.0) is None  # one hang since the last commit, of 2 allowed
    assert caplog.messages == [
        "engine replica aaaaaaaa on node node-1 hung: no step for 9.0 s (limit 8.0 s) with 2 rows "
        "of 1 units in it; its processes were killed and the engine is replaced, its units run again"
    ]
    committed_at = (
        max(attempt.location.engine_death_files().values()) + 0.002
    )  # then a unit commits: that hang no longer counts
    while time.time() < committed_at + 0.002:  # the next hang's file time (to the ms) is after the commit
        pass
    hang(attempt.location, "aaaaaaaa11")
    assert look(time.time() - committed_at) is None
    hang(attempt.location, "bbbbbbbb22")
    failing = look(time.time() - committed_at)
    assert isinstance(failing, EnginesKeepFailing)
    assert str(failing).startswith(
        "the engines failed 2 times in a row with no unit committed between (2 hung, 0 died; "
        "retries.max_engine_failures = 2); the last: engine replica bbbbbbbb on node node-1 hung"
    )


def test_what_waits_for_resources_is_named_before_a_stall(tmp_path, ray_local):
    import ray

    attempt = attempt_at(tmp_path)
    look = AttemptLooks(attempt, start_board([]), ClusterWatch(), units("u1"))
    group = ray.util.placement_group([{"CPU": 64}])  # more than the local Ray has: it waits
    try:
        stalled = look(60.0)
        assert isinstance(stalled, SchedulingStalled) and "placement group" in str(stalled)
    finally:
        ray.util.remove_placement_group(group)


def test_a_look_that_cannot_reach_the_board_raises_and_the_watch_looks_again(tmp_path, ray_local):
    import ray

    board = start_board([])
    look = AttemptLooks(attempt_at(tmp_path), board, ClusterWatch(), units("u1"))
    ray.kill(board)
    with pytest.raises(ray.exceptions.RayActorError):
        look(60.0)
