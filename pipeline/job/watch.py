"""What the driver looks at while it waits for units, every `cluster.WATCH_SECONDS`, from the
stall watch's thread (pipeline/cluster/watch.py `StallWatch`). Nothing waits forever:

- the engines' progress, as each engine actor reports it to the job board, goes to
  `_progress.json` (schemas.JobProgress, which `specbatch status` reads) and the seconds since
  the last committed unit to the job's Prometheus gauge;
- engine deaths and hangs the actors recorded in `_events/` are named on the console as they
  happen; `retries.max_engine_failures` of them in a row, with no unit committed between,
  fail the attempt with EnginesKeepFailing;
- the drafter probe's refusal, which an engine posts to the board: DrafterRejected;
- no unit committed for `retries.stall_minutes`: SchedulingStalled when something of the job
  waits for resources, JobStalled when no engine is generating either (a read that never
  returns, an actor Ray does not report, a stuck driver). An engine that still generates
  (long units) is left to finish.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from pipeline.cluster import ClusterWatch, SchedulingStalled, stall_message
from pipeline.inputs.units import WorkUnit
from pipeline.speculation.probe import DrafterRejected
from pipeline.config import JobConfig
from pipeline.job.graph_attempt import GraphAttempt
from schemas import JobProgress, ReplicaProgress

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger("specbatch")
# A replica whose last report is older than this has stopped reporting (its actor is gone or stuck).
REPORT_STALE_SECONDS = 60.0


class JobStalled(RuntimeError):
    """No unit committed for `retries.stall_minutes` while no engine generated."""


class EnginesKeepFailing(RuntimeError):
    """`retries.max_engine_failures` engine deaths or hangs in a row, with no unit committed between."""


class AttemptLooks:
    """One look at a graph of an attempt and its job board; returns the exception that ends the
    attempt, or None."""

    def __init__(self, attempt: GraphAttempt, board: ActorHandle, cluster: ClusterWatch, todo: list[WorkUnit]):
        self.attempt, self.board, self.cluster, self.todo = attempt, board, cluster, todo
        self.retries = attempt.config.retries
        self.failures: dict[str, float] = {}  # engine death and hang files seen -> when
        self.gauge = _job_gauge()

    def __call__(self, idle_seconds: float) -> Optional[BaseException]:
        refused = probe_refusal(self.attempt, self.board)
        if refused is not None:
            return refused
        last_commit = time.time() - idle_seconds
        replicas = self._engine_progress(last_commit)
        self.gauge.set(idle_seconds, tags={"job_id": self.attempt.manifest.job_id})
        failing = self._engine_failures(last_commit)
        if failing is not None or idle_seconds <= self.retries.stall_minutes * 60:
            return failing
        waiting = self.cluster.waiting()
        if waiting:
            return SchedulingStalled(stall_message(self.attempt.config, waiting, idle_seconds))
        if any(generating(r, self.retries.stall_minutes * 60) for r in replicas):
            return None
        return JobStalled(stalled_message(self.attempt.config, idle_seconds, self._not_committed(), replicas))

    def _engine_progress(self, last_commit: float) -> list[ReplicaProgress]:
        """The engines' last reports, into `_progress.json`."""
        import ray

        replicas = ray.get(self.board.read_progress.remote(), timeout=30)
        progress = JobProgress(
            attempt=self.attempt.record.number,
            written_at=time.time(),
            generating_since=self.attempt.started,
            last_commit_at=last_commit if self.attempt.unit_stats else None,
            replicas=replicas,
        )
        self.attempt.location.write_progress(progress.model_dump(mode="json"))
        return replicas

    def _engine_failures(self, last_commit: float) -> Optional[EnginesKeepFailing]:
        """New engine deaths and hangs, each named once; the breaker over those since the last commit."""
        location = self.attempt.location
        files = location.engine_death_files(since=self.attempt.started)
        new = sorted((uri for uri in files if uri not in self.failures), key=files.get)
        self.failures.update({uri: files[uri] for uri in new})
        events = location.read_all(location.storage.read_json, new)
        for event in events:
            log.warning("%s", failure_line(event))
        in_a_row = [uri for uri, at in self.failures.items() if at > last_commit]
        if len(in_a_row) < self.retries.max_engine_failures:
            return None
        hung = sum(1 for uri in in_a_row if "/engine-hung-" in uri)
        last = events[-1] if events else location.storage.read_json(max(in_a_row, key=self.failures.get))
        return EnginesKeepFailing(
            f"the engines failed {len(in_a_row)} times in a row with no unit committed between ({hung} hung, "
            f"{len(in_a_row) - hung} died; retries.max_engine_failures = {self.retries.max_engine_failures}); the "
            f"last: {failure_line(last)}. Committed units are kept: rerun to resume. The events, with the hung "
            f"engines' stacks, are in {location.path('_events')}"
        )

    def _not_committed(self) -> list[str]:
        return [u.unit_id for u in self.todo if u.unit_id not in self.attempt.unit_stats]


def probe_refusal(attempt: GraphAttempt, board: ActorHandle) -> Optional[DrafterRejected]:
    """DrafterRejected when the probe refused the drafter on the graph's first engine (one read
    of the board). The engines send their units back uncommitted rather than fail the graph, so
    that the refusal is said alone, not inside Ray's errors and traces."""
    import ray

    try:
        verdict = ray.get(board.read.remote(), timeout=30).verdict
    except Exception as exc:  # the board went with a lost node: the other looks go on
        log.warning("the job board could not be read (%s)", type(exc).__name__)
        return None
    if verdict is None or not verdict.refusal:
        return None
    attempt.manifest.probe = verdict.result
    return DrafterRejected(verdict.refusal, verdict.result)


def generating(replica: ReplicaProgress, window_seconds: float) -> bool:
    """The replica reports, holds requests, and its engine made a step within the window."""
    now = time.time()
    return (
        now - replica.reported_at < REPORT_STALE_SECONDS
        and replica.requests_in_flight > 0
        and replica.last_output_at is not None
        and now - replica.last_output_at < window_seconds
    )


def failure_line(event: dict) -> str:
    where = f"engine replica {event['actor_id'][:8]} on node {event['node_id'][:8]}"
    rows = sum(len(r) for r in event.get("rows_in_flight", {}).values())
    if event.get("kind") == "hung":
        return (
            f"{where} hung: no step for {event['seconds_without_progress']:.1f} s (limit "
            f"{event['stall_limit_seconds']:.1f} s) with {rows} rows of {len(event['units'])} units in it; its "
            "processes were killed and the engine is replaced, its units run again"
        )
    return (
        f"{where} died ({event['error'][:200]}) with {rows} rows of {len(event['units'])} units in it; it is replaced"
    )


def stalled_message(
    config: JobConfig, idle_seconds: float, not_committed: list[str], replicas: list[ReplicaProgress]
) -> str:
    now = time.time()
    engines = (
        "; ".join(
            f"replica {r.actor_id[:8]}: {r.requests_in_flight} requests, last step "
            f"{_ago(now, r.last_output_at)}, last report {now - r.reported_at:.0f} s ago"
            for r in replicas[:6]
        )
        or "none has reported (no engine actor started, or none reached its first unit)"
    )
    return (
        f"no unit committed for {idle_seconds / 60:.1f} minutes (retries.stall_minutes = "
        f"{config.retries.stall_minutes:g}) and no engine is generating: the attempt waited for {len(not_committed)} "
        f"units ({', '.join(not_committed[:3])}{' ...' if len(not_committed) > 3 else ''}) from reads, preprocessing "
        f"or engines that gave nothing. The engines: {engines}. Committed units are kept: rerun to resume; if it "
        "happens again, `ray stack` on the nodes shows where the driver and the actors wait."
    )


def _ago(now: float, at: Optional[float]) -> str:
    return "never" if at is None else f"{now - at:.0f} s ago"


def _job_gauge():
    from ray.util.metrics import Gauge

    return Gauge(
        "specbatch_seconds_since_last_commit",
        "Seconds since the driver heard a unit of the job committed (since generation began, before the first).",
        ("job_id",),
    )
