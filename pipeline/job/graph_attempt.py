"""The seam between an attempt and the graphs it runs: what pipeline/job/graph_run.py and the
job watch read and write of the attempt (pipeline/job/runner.JobAttempt is the one there is)."""

from __future__ import annotations

from typing import Protocol

import pyarrow as pa

from pipeline.cluster.startup import StartClock
from pipeline.commit.lease import OutputLease
from pipeline.commit.outputs import OutputLocation
from pipeline.config import JobConfig
from pipeline.job.plan import JobPlan, RunOptions
from schemas import Attempt, JobManifest


class GraphAttempt(Protocol):
    """What a graph run reads and writes of its attempt (pipeline/job/runner.JobAttempt)."""

    config: JobConfig
    options: RunOptions
    plan: JobPlan
    manifest: JobManifest
    lease: OutputLease
    clock: StartClock
    unit_stats: dict[str, dict]  # unit id -> its stats row, for the units this attempt committed
    started: float  # when generation began

    @property
    def location(self) -> OutputLocation: ...

    @property
    def record(self) -> Attempt: ...

    def save(self) -> None: ...

    def write_stats(self) -> pa.Table: ...
