"""The lease on an output location and the layout version, without an engine: a second run
is refused while the owner's heartbeat is fresh, a stale lease is taken over only when asked,
and a location of another output layout is refused before anything is written."""

from __future__ import annotations

import time

import pytest

from pipeline.config import LeaseConfig, parse_config
from pipeline.lease import LeaseHeld, OutputLease
from pipeline.outputs import OutputLocation
from pipeline.runner import LayoutMismatch, run_job
from pipeline.storage import Storage
from tests.conftest import job_config

FAST = LeaseConfig(heartbeat_seconds=0.2, stale_after_seconds=1.0)


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path, s3_endpoint):
    if request.param == "local":
        return OutputLocation(Storage(), str(tmp_path / "out"))
    return OutputLocation(Storage(endpoint_url=s3_endpoint), f"s3://specbatch/lease-{tmp_path.name}")


def test_a_live_lease_refuses_a_second_run_even_with_take_over(location):
    first = OutputLease(location, FAST, "job-1", 1)
    first.acquire()
    try:
        time.sleep(1.5)  # longer than stale_after: only the heartbeat keeps it live
        second = OutputLease(location, FAST, "job-1", 2)
        with pytest.raises(LeaseHeld, match=r"leased to run .*job-1, attempt 1.*alive.*--take-over") as err:
            second.acquire(take_over=True)
        assert first.lease.owner in str(err.value)
    finally:
        first.release()
    assert first.current() is None  # released: the next run just takes it
    third = OutputLease(location, FAST, "job-1", 3)
    third.acquire()
    third.release()


def test_a_stale_lease_is_taken_over_only_when_asked(location):
    dead = OutputLease(location, FAST, "job-1", 1)
    dead._write()  # a run that wrote its lease and was killed: no heartbeat follows
    time.sleep(1.2)
    successor = OutputLease(location, FAST, "job-1", 2)
    with pytest.raises(LeaseHeld, match="which is stale.*--take-over"):
        successor.acquire()
    successor.acquire(take_over=True)
    try:
        assert successor.current().owner == successor.lease.owner and successor.current().attempt == 2
    finally:
        successor.release()


def test_a_location_of_another_layout_is_refused_untouched(tmp_path):
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    old = {"job_id": "old", "status": "succeeded", "input_files": ["a.parquet"]}  # layout 1 wrote no version
    location.write_manifest(old)
    config = parse_config(job_config(str(tmp_path / "in"), str(tmp_path / "out"), {"target": "/m/t", "drafter": "/m/d"}))
    with pytest.raises(LayoutMismatch, match=r"output layout 1; this specbatch writes layout 2.*--restart"):
        run_job(config, progress=False)
    assert location.read_manifest() == old and not location.storage.exists(location.path("_lease.json"))
