"""One Ray Data graph of an attempt, iterated to its end: every stats row the engines send
back goes to the attempt's progress (totals, breaker, guard, progress line); the job board's
engine starts and probe verdict, and the nodes that left, go to `_job.json` through the
attempt's `save`; the graph's engines are stopped however it ends. Its outcome says what the
attempt does next. What a graph needs of its attempt is `GraphAttempt` (the JobAttempt of
pipeline/job/runner.py)."""

from __future__ import annotations

import atexit
import enum
import logging
import time
from typing import TYPE_CHECKING, Iterator, Optional

import pyarrow as pa

from pipeline.cluster import WATCH_SECONDS, ClusterWatch, StallInterrupt, StallWatch
from pipeline.cluster.startup import start_cost
from pipeline.inputs.units import WorkUnit
from pipeline.graph import engine_actor_label
from pipeline.job.breaker import ErrorBreaker
from pipeline.job.console import Pace, commit_window, print_progress, progress_line, say
from pipeline.job.manifest import plain_text
from pipeline.job.watch import AttemptLooks, probe_refusal
from pipeline.speculation.guard import AcceptanceGuard, AcceptanceTooLow, speculation_turned_off
from pipeline.stages.stats import EngineBusyTime
from pipeline.storage import StorageUnavailable
from pipeline.job.graph_attempt import GraphAttempt
from schemas import GuardEvent, NodeLoss, TrialVerdict, utc_timestamp
from schemas.board import BoardReading

if TYPE_CHECKING:
    import ray.data
    from ray.actor import ActorHandle

log = logging.getLogger("specbatch")
# The driver writes its stats file at least this often: a killed driver leaves the next
# attempt few markers to read.
STATS_FLUSH_SECONDS = 60.0
ENGINE_EXIT_SECONDS = 30  # an engine stops in a few seconds (vLLM gives EngineCore 5 s before it kills it)


class GraphOutcome(enum.Enum):
    FINISHED = "every unit of the graph committed"
    SPECULATION_OFF = "the acceptance guard turned speculation off"
    NODE_LOST = "the graph failed after a node left the cluster"


class AttemptProgress:
    """What the driver hears of an attempt's units: their stats rows (flushed to stats/ every
    STATS_FLUSH_SECONDS), the error breaker, the acceptance guard and the progress line, whose
    ETA runs from the rate since the first committed unit."""

    def __init__(self, attempt: GraphAttempt, total_rows: int, guard: Optional[AcceptanceGuard]):
        self.attempt, self.unit_stats, self.total_rows, self.guard = attempt, attempt.unit_stats, total_rows, guard
        self.breaker = ErrorBreaker(attempt.config.retries)
        self.flushed = time.time()
        self.tokens = self.drafted = self.accepted = 0
        self.rows = sum(r["rows"] for r in self.unit_stats.values())  # kept as units are heard, not summed per batch
        self.pace = Pace(commit_window(attempt.config.resources.max_replicas, attempt.config.resources.units_in_flight))
        self.busy = self._busy_time()

    def observe(self, stats: pa.Table) -> bool:
        """Takes one batch of stats rows; True when the guard turned speculation off. LeaseLost
        once the heartbeat found another run holding the location."""
        if self.attempt.lease.lost is not None:
            raise self.attempt.lease.lost
        record, rows = self.attempt.record, stats.to_pylist()
        for row in rows:
            before = self.unit_stats.get(row["unit_id"])
            self.rows += row["rows"] - (before["rows"] if before else 0)
            self.unit_stats[row["unit_id"]] = row
            self.breaker.observe(row)
            if before:  # a unit heard again (a retry): its earlier interval leaves the union
                self.busy = self._busy_time()
            else:
                self.busy.add(row["actor_id"], row["started_at"], row["engine_seconds"])
        record.processed_rows = self.rows
        self.tokens += sum(r["generated_tokens"] for r in rows)
        self.drafted += sum(r["draft_tokens"] for r in rows)
        self.accepted += sum(r["accepted_tokens"] for r in rows)
        if self.attempt.options.progress:
            self._print(record.skipped_rows + record.processed_rows)
        if time.time() - self.flushed > STATS_FLUSH_SECONDS:
            self.attempt.write_stats()
            self.flushed = time.time()
        events = [event for event in map(self.guard.observe, rows) if event] if self.guard else []
        for event in events:
            self._apply_guard_event(event)
        return speculation_turned_off(events)

    def _apply_guard_event(self, event: GuardEvent) -> None:
        self.attempt.manifest.guard_events.append(event)
        self.attempt.save()
        if event.action == "fail":
            raise AcceptanceTooLow(event.message)
        log.warning("acceptance guard: %s", event.message)

    def _busy_time(self) -> EngineBusyTime:
        busy = EngineBusyTime()
        for r in self.unit_stats.values():
            busy.add(r["actor_id"], r["started_at"], r["engine_seconds"])
        return busy

    def _print(self, done: int) -> None:
        now_ = time.time()
        self.pace.take(self.unit_stats)
        engine_rate = self.tokens / self.busy.seconds if self.busy.seconds else 0.0
        began = self.attempt.started  # where the attempt's wall time, and the summary's, begins
        wall_rate = self.tokens / (now_ - began) if now_ > began else 0.0
        acceptance = self.accepted / self.drafted if self.drafted else None
        eta = self.pace.eta_text(self.total_rows - done, len(self.attempt.plan.todo) - len(self.unit_stats))
        print_progress(
            progress_line(done, self.total_rows, engine_rate, wall_rate, acceptance, eta), done >= self.total_rows
        )


def run_graph(
    dataset: ray.data.Dataset, todo: list[WorkUnit], progress: AttemptProgress, board: ActorHandle
) -> GraphOutcome:
    """Iterates one graph to its outcome. Nodes that leave are noted in `_job.json` when
    seen. Stops with what the job watch found (pipeline/job/watch.py: SchedulingStalled,
    JobStalled, EnginesKeepFailing), DrafterRejected, or LeaseLost (an engine refused to
    commit, or the heartbeat found another owner)."""
    attempt = progress.attempt
    watch = ClusterWatch(engine_actor_label())
    losses = NodeLosses(attempt, watch, todo)
    stall = StallWatch(AttemptLooks(attempt, board, watch, todo), lost=lambda: attempt.lease.lost is not None)
    attempt.clock.mark("graph_started")
    stall.start()
    # closed in `finally`, as Ray Data asks of an iterator held by name: its executor stops
    # then, not when a traceback that holds the frame lets go (the engines: _stop_engines)
    batches = iter(dataset.iter_batches(batch_format="pyarrow", batch_size=None))
    try:
        try:
            return _take_batches(batches, progress, board, stall, losses)
        except Exception as exc:
            # The watch stopped first: the lease's check below may wait out a store's outage, and
            # the heartbeat gives up on it meanwhile (an interrupt then escaped the job unnamed).
            stall.stop()
            attempt.lease.still_ours()  # an engine refused to commit for the run that holds the lease now
            refused = probe_refusal(attempt, board)
            if refused is not None:
                raise refused from None
            if not watch.lost_nodes():
                raise
            losses.failed_the_graph(exc)
            return GraphOutcome.NODE_LOST
    except StallInterrupt:  # from the wait for a batch (or before the handler above stopped the watch)
        stall.stop()
        attempt.lease.still_ours()  # the heartbeat found another owner: stop now, not at the next unit
        losses.note()
        raise stall.failure or RuntimeError("the job watch stopped the graph") from None
    finally:
        stall.stop()
        batches.close()
        _end_graph(attempt, board)


def _take_batches(
    batches: Iterator[pa.Table], progress: AttemptProgress, board: ActorHandle, stall: StallWatch, losses: NodeLosses
) -> GraphOutcome:
    """Each batch of stats rows the engines send back, to the graph's end or until the guard
    turns speculation off."""
    attempt, last_look = progress.attempt, time.time()
    for stats in batches:
        if not stats.num_rows:  # a unit an engine did not commit: the probe refused the drafter
            _raise_a_refusal(attempt, board)
        stall.progress()
        if "first_commit" not in attempt.clock.marks:  # the board's figures go to _job.json at the first commit
            attempt.clock.mark("first_commit")
            _record_board(attempt, board)
        if time.time() - last_look > WATCH_SECONDS:
            losses.note()
            last_look = time.time()
        _record_trial_verdict(attempt, board)
        if progress.observe(stats):
            return GraphOutcome.SPECULATION_OFF
    _raise_a_refusal(attempt, board)  # Ray Data may drop the refused units' empty batches
    losses.note()
    return GraphOutcome.FINISHED


def _raise_a_refusal(attempt: GraphAttempt, board: ActorHandle) -> None:
    """DrafterRejected, when the probe refused the drafter: the engines commit nothing then and
    send their units back without a stats row; the refusal is on the board."""
    refused = probe_refusal(attempt, board)
    if refused is not None:
        raise refused


def _end_graph(attempt: GraphAttempt, board: ActorHandle) -> None:
    """The board's figures into `_job.json`, then the graph's engines stopped, whatever happened."""
    try:
        _record_board(attempt, board)
    except StorageUnavailable as down:  # the error that ended the graph goes on, not this one
        log.error("the engines' starts were not recorded in _job.json: %s", down)
    finally:  # also when this run lost its lease meanwhile, and may not write
        _stop_engines(board)


class NodeLosses:
    """Nodes of one graph that left the cluster, into `_job.json` when they are first seen. Ray
    Data resubmits the lost node's units by itself when it can; when the dataset fails instead,
    the losses are marked graph-rebuilt, and the attempt stops after retries.max_node_losses."""

    def __init__(self, attempt: GraphAttempt, watch: ClusterWatch, todo: list[WorkUnit]):
        self.attempt, self.watch, self.todo = attempt, watch, todo

    def note(self, failed: Optional[BaseException] = None) -> None:
        record, location = self.attempt.record, self.attempt.location
        lost = self.watch.lost_nodes()
        known = {loss.node_id: loss for loss in record.node_losses}
        new = {node: address for node, address in lost.items() if node not in known}
        if new:
            committed = location.committed_units()
            for node, address in new.items():
                known[node] = NodeLoss(
                    time=utc_timestamp(),
                    node_id=node,
                    address=address,
                    recovery="ray-data-retried",
                    units_not_committed=sum(1 for u in self.todo if u.unit_id not in committed),
                )
                record.node_losses.append(known[node])
                log.warning("Ray node %s (%s) left the cluster during the job", node[:12], address)
        if failed is not None:
            for node in lost:
                known[node].recovery = "graph-rebuilt"
                known[node].error = plain_text(f"{type(failed).__name__}: {failed}")[:2000]
        if new or failed is not None:
            self.attempt.save()

    def failed_the_graph(self, exc: Exception) -> None:
        """The dataset failed after a node left: noted, and rebuilt unless too many were lost."""
        self.note(exc)
        lost = len(self.attempt.record.node_losses)
        if lost > self.attempt.config.retries.max_node_losses:
            raise RuntimeError(
                f"{lost} Ray nodes lost in this attempt (retries.max_node_losses = "
                f"{self.attempt.config.retries.max_node_losses}); the last one failed the dataset: "
                f"{plain_text(str(exc))[:500]}"
            ) from exc
        log.warning(
            "%d node(s) lost; rebuilding the graph over the units not committed yet", len(self.watch.lost_nodes())
        )


def _stop_engines(board: ActorHandle) -> None:
    """Each engine actor of the graph exits as an actor that is done (its engine stops first,
    in EngineStage.__del__). Ray Data lets go of its actors and leaves them to reference
    counting, which a graph that failed does not reach while its exception is held (a caller
    that keeps it, a traceback): their engines would sit idle, holding memory and polling.
    The board ends with its graph too: the dataset holds its handle in a reference cycle, so
    it lived on, idle but polling, until Python's garbage collector next ran."""
    import ray

    try:
        engines = ray.get(board.hand_over_engines.remote(), timeout=30)
    except Exception as exc:  # the board went with a lost node; so did its engines, or Ray stops them with the job
        log.warning("the job board could not be read (%s): engines are left to Ray to stop", type(exc).__name__)
        engines = []
    if not _EXITING:
        atexit.register(_wait_for_engine_exits)  # after ray.init's own hook: it runs before Ray ends
    _EXITING.extend(engine.__ray_terminate__.remote() for engine in engines)
    ray.kill(board)


_EXITING: list = []  # the engine actors' exits, each an ObjectRef that resolves when its actor is gone


def _wait_for_engine_exits() -> None:
    """At the driver's exit, before Ray's own exit hook ends a Ray this process started (the
    demo's, a local run's): the engine actors asked to exit are given up to ENGINE_EXIT_SECONDS
    to stop their engines in order. Torn down before that, an actor's EngineCore was killed under
    its live client, which logged EngineDeadError."""
    import ray

    if not _EXITING or not ray.is_initialized():
        return
    ended, _ = ray.wait(_EXITING, num_returns=len(_EXITING), timeout=ENGINE_EXIT_SECONDS)
    if len(ended) < len(_EXITING):
        log.warning(
            "%d of %d engine actors had not exited %d s after they were asked to; Ray ends them",
            len(_EXITING) - len(ended),
            len(_EXITING),
            ENGINE_EXIT_SECONDS,
        )


def _read_board(board: ActorHandle) -> Optional[BoardReading]:
    import ray

    try:
        return ray.get(board.read.remote(), timeout=30)
    except Exception as exc:  # the board went with a lost node: its figures are lost, not the job
        log.warning("the job board could not be read (%s): engine start figures are missing", type(exc).__name__)
        return None


def _record_board(attempt: GraphAttempt, board: ActorHandle) -> None:
    """The engines' starts and the probe's verdict into `_job.json`: a resume keeps the verdict."""
    read = _read_board(board)
    if read is None:
        return
    record = attempt.record
    known = record.start.engine_starts if record.start else []
    seen = {(e.actor_id, e.engine_ready_at) for e in known}
    new = [s for s in read.starts if (s.actor_id, s.engine_ready_at) not in seen]
    record.start = start_cost(attempt.clock, [*known, *new], read.verdict)
    if read.verdict is not None and read.verdict.result is not None:
        attempt.manifest.probe = read.verdict.result
    _take_trial_verdict(attempt, read.trial)
    attempt.save()


def _record_trial_verdict(attempt: GraphAttempt, board: ActorHandle) -> None:
    """The speculation trial's verdict, once its engine posts it: into `_job.json` and one console line."""
    manifest = attempt.manifest
    if manifest.trial is not None or not attempt.config.speculative.enabled or not attempt.config.speculative.trial:
        return
    import ray

    try:
        verdict = ray.get(board.trial_verdict.remote(), timeout=30)
    except Exception:  # the board went with a lost node: the graph's end says so
        return
    if _take_trial_verdict(attempt, verdict):
        attempt.save()


def _take_trial_verdict(attempt: GraphAttempt, verdict: Optional[TrialVerdict]) -> bool:
    if verdict is None or attempt.manifest.trial is not None:
        return False
    attempt.manifest.trial = verdict
    say(attempt.options.progress, attempt.manifest.trial.reason)
    return True
