"""The engine actor: one vLLM engine (with its EAGLE-3 drafter) for the actor's whole life.

Ray Data calls it with one prepared work unit at a time. The actor is async: several units
are in flight at once and their requests overlap inside the engine, so the engine does not
drain at a unit's tail. A unit goes through three stages, read top to bottom in `__call__`:
generation (pipeline/stages/engine_requests.py: requests, engine death, isolation of suspects), results
(pipeline/stages/unit_results.py: output and error rows, stats) and the commit of its outputs, errors
and marker to the output location, off the event loop. The stats row goes back to the driver.

Once its engine is up the actor checks in at the job board (pipeline/cluster/job_board.py) with how its
start went. The first engine with a unit to run measures the drafter probe's rows before its
units generate, and no engine commits a unit before the probe's verdict is in: a refused
drafter leaves nothing in outputs/. The speculation trial (pipeline/graph/engine_trial.py) may
restart the engine inside the actor, without the drafter or with it again, between units. Before
each unit's marker the actor checks that its run still holds the output location's lease
(pipeline/commit/lease.py): a run that lost it commits nothing more.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Optional

import pyarrow as pa

from pipeline.cluster.job_board import VERDICT_WAIT_SECONDS
from pipeline.cluster.startup import process_started_at
from pipeline.commit.outputs import OutputLocation
from pipeline.inputs.units import unit_of
from pipeline.config import JobConfig
from pipeline.graph.engine_trial import EngineTrial
from pipeline.speculation.probe import probe_concurrency, probe_result, refusal
from pipeline.stages.completions import reasoning_parser
from pipeline.stages.engine import EngineProcesses, lora_requests, prepare_process_env, process_title, start_engine
from pipeline.stages.engine_requests import EngineRequests
from pipeline.stages.engine_watch import EngineClock, engine_stacks
from pipeline.stages.metrics import ReplicaMetrics
from pipeline.stages.preprocess import CARRIED
from pipeline.stages.unit_results import Identity, UnitResults, collect, tables, unit_stats
from pipeline.storage import Storage
from schemas import EngineStart, Fence, ReplicaProgress, UnitStats, arrow_schema
from schemas.board import ProbeVerdict, TrialPlan

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from vllm.v1.engine.async_llm import AsyncLLM


# How often an actor looks at its engine's progress, and reports it to the job board.
ENGINE_WATCH_SECONDS = 1.0
PROGRESS_REPORT_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class EngineActorArgs:
    """What an engine actor is built with beside the job's config: the model ids its rows name,
    whether the guard turned speculation off, the job board it checks in at
    (pipeline/cluster/job_board.py) and the run's lease, checked before each commit
    (pipeline/commit/fence.check_fence)."""

    model_id: str
    drafter_id: Optional[str]
    job_id: str = ""
    disabled_by_guard: bool = False
    board: Optional[ActorHandle] = None
    fence: Optional[Fence] = None
    trial: Optional[TrialPlan] = None  # when this graph runs the speculation trial


class EngineStage:
    def __init__(self, config: dict[str, Any], engines: EngineActorArgs):
        began = time.time()
        import ray

        self.config = JobConfig.model_validate(config)
        prepare_process_env(self.config)
        self.vllm_classes = _import_vllm_apart()

        imported = time.time()
        self.processes = EngineProcesses()
        self.clock = EngineClock(self.config.retries.engine_stall_seconds)
        self.engine = held_until_stopped(
            start_engine(self.config, self.processes, self.vllm_classes, [self.clock.stat_logger_factory()])
        )
        ready = time.time()
        self.stopped = False
        atexit.register(_stop_at_exit, weakref.ref(self))
        self.location = OutputLocation(Storage.from_config(self.config.storage), self.config.output_uri)
        self.disabled_by_guard = engines.disabled_by_guard
        context = ray.get_runtime_context()
        self.where = {"actor_id": context.get_actor_id() or "driver", "node_id": context.get_node_id()}
        self.requests = EngineRequests(
            self.engine, self.location, lora_requests(self.config), self.processes.end, **self.where
        )
        self.metrics = ReplicaMetrics(engines.job_id, self.where["actor_id"])
        tokenizer = self.engine.get_tokenizer()
        self.drafter_id = engines.drafter_id
        self.identity = Identity(
            engines.model_id,
            engines.drafter_id,
            lambda token_id: tokenizer.decode([token_id]),
            reasoning_parser(self.config.chat.reasoning_parser, tokenizer),
        )
        engine_core = [p for p in self.processes.seen.values() if "EngineCore" in process_title(p)]
        self.start = EngineStart(
            **self.where,
            process_started_at=process_started_at(),
            init_started_at=began,
            vllm_imported_at=imported,
            engine_core_started_at=min((p.create_time() for p in engine_core), default=None),
            engine_ready_at=ready,
        )
        self.board, self.fence = engines.board, engines.fence
        if self.board is not None:
            ray.get(self.board.check_in.remote(self.start, context.current_actor))
        self.watching: Optional[asyncio.Task] = None  # the engine's watch (_watch_engine), from the first unit on
        self.probed: Optional[asyncio.Future] = None  # this engine's claim of the probe (and its measuring)
        self.verdict: Optional[ProbeVerdict] = None  # once in, not asked for again
        self.as_configured = self.config
        self.trial = EngineTrial(self.config, engines.trial, self.board, self.metrics, ready - imported)

    def __del__(self) -> None:
        # Ray Data's pool shutdown frees the actor (__ray_shutdown__) before Ray kills the
        # actor's child processes: the engine stops first, and its client does not find
        # EngineCore gone and log an error.
        self.stop()

    def stop(self) -> None:
        """Stops the engine, once: its output handler first, then EngineCore and its workers."""
        requests = getattr(self, "requests", None)
        if requests is not None and not requests.dying and not getattr(self, "stopped", True):
            self.stopped = True
            _stop_output_handler(self.engine)
            self.engine.shutdown()
            self.processes.end()  # a worker that shutdown left behind
        _ENGINES_UNTIL_STOPPED.discard(getattr(self, "engine", None))

    async def __call__(self, batch: pa.Table) -> pa.Table:
        received = time.time()
        unit = unit_of(batch)
        unit_id = unit[0]
        carried = batch.select([c for c in CARRIED if c in batch.column_names])  # to the output rows, as they are
        rows = batch.drop_columns(carried.column_names).to_pylist()
        valid_rows = [i for i, r in enumerate(rows) if r["error_kind"] is None]

        if self.watching is None:
            self.watching = asyncio.ensure_future(_watch_engine(weakref.ref(self)))
        await self._probe_once()
        suspects = await asyncio.to_thread(self._start_unit_attempt, unit_id)
        arm = await self.trial.enter(self._restart_engine)
        started, engine_seconds, out = time.time(), 0.0, None
        try:
            results = await self.requests.run(unit_id, rows, valid_rows, suspects)
            engine_seconds = time.time() - started
            out = collect(unit_id, rows, results, self.identity)
        finally:
            await self.trial.leave(arm, started, engine_seconds, len(valid_rows), out.generated_tokens if out else 0)
        stats = unit_stats(
            unit,
            len(rows),
            out,
            self.config.speculative,
            self.where,
            started,
            engine_seconds,
            self.disabled_by_guard,
        )
        stats.trial_arm = arm
        if not await self._verdict_passed():  # the probe refused the drafter: nothing is committed
            return pa.Table.from_pylist([], schema=arrow_schema(UnitStats))
        # Off the event loop: the other units in flight keep the engine busy meanwhile.
        return await asyncio.to_thread(self._commit, unit_id, out, carried, stats, received)

    async def _look_at_engine(self, reported: float) -> float:
        """One look of the engine's watch (`_watch_engine`); returns when it last reported."""
        self.clock.busy(self.requests.has_requests())
        stalled, limit = self.clock.seconds_without_progress(), self.clock.limit()
        self.metrics.record_progress(stalled)
        if self.board is not None and time.time() - reported >= PROGRESS_REPORT_SECONDS:
            reported = time.time()
            self.board.report_progress.remote(self._progress())
        if stalled > limit:
            stacks = functools.partial(engine_stacks, self.processes.running())
            await self.requests.engine_hung(stalled, limit, stacks)
        return reported

    def _progress(self) -> ReplicaProgress:
        in_flight = sum(len(rows) for rows in self.requests.in_flight.values())
        return ReplicaProgress(
            **self.where, requests_in_flight=in_flight, last_output_at=self.clock.last_step_at, reported_at=time.time()
        )

    async def _probe_once(self) -> None:
        """Claims the probe at this engine's first unit; when handed its rows, measures them
        alone in the engine, once, and posts the verdict to the board."""
        if self.board is None:
            return
        if self.probed is None:
            self.probed = asyncio.ensure_future(self._claim_and_measure())
        await asyncio.shield(self.probed)

    async def _claim_and_measure(self) -> None:
        from pipeline.speculation.measure import figures

        claim = await self.board.claim.remote(self.where["actor_id"])
        if claim is None:
            return
        started = time.time()
        results = await self.requests.probe(claim.rows, probe_concurrency(self.config, len(claim.rows)))
        seconds = time.time() - started
        finished = [r for r in results if r is not None and not isinstance(r, BaseException) and r.finished]
        result = probe_result(self.config, figures(finished, seconds), claim.near_limit_rows)
        rejected = refusal(self.config, result)
        verdict = ProbeVerdict(
            result=result,
            refusal=str(rejected) if rejected else None,
            started_at=started,
            actor_id=self.where["actor_id"],
        )
        await self.board.post.remote(verdict)

    async def _verdict_passed(self) -> bool:
        """Waits for the probe's verdict (at once when there is none to wait for); False when it
        refused the drafter. The unit then comes back without a stats row, and the driver, which
        reads the refusal from the board (pipeline/job/graph_run.py), ends the graph: a raise here
        would fail the dataset and wrap the refusal in Ray's errors and traces. While it waits it
        takes over a claim whose engine went away."""
        if self.board is None:
            return True
        while self.verdict is None:
            self.verdict = await self.board.wait_verdict.remote(VERDICT_WAIT_SECONDS)
            if self.verdict is None and self.probed is not None and self.probed.done():
                self.probed = None
                await self._probe_once()
        return not self.verdict.refusal

    async def _restart_engine(self, speculative: bool) -> float:
        """The speculation trial's switch, with no unit in the engine: this engine stops, and one
        with the configured speculation (or none) starts in its place; returns its start's seconds."""
        await _cancel_output_handler(self.engine)
        self.engine.shutdown()
        _ENGINES_UNTIL_STOPPED.discard(self.engine)
        await asyncio.to_thread(self.processes.end, 10.0, 10.0)  # a worker still exiting is given time first
        self.config = self.as_configured if speculative else self.as_configured.without_speculation()
        began = time.time()
        self.clock = EngineClock(self.config.retries.engine_stall_seconds)
        loggers = [self.clock.stat_logger_factory()]
        self.engine = held_until_stopped(
            await asyncio.to_thread(start_engine, self.config, self.processes, self.vllm_classes, loggers)
        )
        self.requests = EngineRequests(
            self.engine, self.location, lora_requests(self.config), self.processes.end, **self.where
        )
        self.identity = dataclasses.replace(self.identity, drafter_id=self.drafter_id if speculative else None)
        ready = time.time()
        if self.board is not None:  # the job's engine starts count this one
            start = self.start.model_copy(
                update={
                    "init_started_at": began,
                    "vllm_imported_at": began,
                    "engine_ready_at": ready,
                    "engine_core_started_at": None,
                }
            )
            await self.board.check_in.remote(start)
        return ready - began

    def _start_unit_attempt(self, unit_id: str) -> dict | None:
        """Starts the unit's attempt; its suspects once it was in flight at enough engine deaths."""
        crashes_before = self.location.start_attempt(unit_id)
        if crashes_before >= self.config.retries.isolate_after_attempts:
            return self.location.read_suspects(unit_id)
        return None

    def _commit(self, unit_id: str, out: UnitResults, carried: pa.Table, stats: UnitStats, received: float) -> pa.Table:
        stats.wall_seconds = time.time() - received
        marker = self.location.commit(unit_id, tables(out, carried), stats, self.fence)
        self.metrics.record(marker.stats)
        return pa.Table.from_pylist([marker.stats.model_dump()], schema=arrow_schema(UnitStats))


_ENGINES_UNTIL_STOPPED: set = set()


def held_until_stopped(engine: AsyncLLM) -> AsyncLLM:
    """The engine, held by this module until `EngineStage.stop`. An EngineStage in a reference cycle
    is freed by Python's cyclic collector, which calls the weakref callbacks of everything it
    frees before any `__del__`: vLLM's finalizers would stop EngineCore under a live output
    handler (EngineDeadError in the worker's log) before `EngineStage.__del__` could stop the
    engine in order. Held here, the engine is not among the cycle's garbage."""
    _ENGINES_UNTIL_STOPPED.add(engine)
    return engine


async def _watch_engine(stage: weakref.ref) -> None:
    """Every second: whether the engine still makes steps while it holds requests (a hung one is
    ended as a dead one is, and Ray replaces the actor), the replica's gauge, and every few
    seconds its progress to the job board, which the driver and status read. It holds the actor
    by a weak reference between looks: a pending task that held it would keep Ray Data's pool
    shutdown from freeing the actor, whose `__del__` stops the engine before Ray ends its processes."""
    reported = 0.0
    while True:
        await asyncio.sleep(ENGINE_WATCH_SECONDS)
        actor = stage()
        if actor is None or actor.stopped or actor.requests.dying:
            return
        reported = await actor._look_at_engine(reported)
        del actor


def _stop_at_exit(stage: weakref.ref) -> None:
    """At the actor process's exit, the engine of an actor that Ray Data's pool shutdown did not
    free (something still held it, so `__del__` did not run): stopped before vLLM's own exit
    hooks kill EngineCore under a live output handler, which then logs EngineDeadError.
    Registered after the engine's start, so it runs before them."""
    alive = stage()
    if alive is not None:
        alive.stop()


def _stop_output_handler(engine: AsyncLLM) -> None:
    """Cancels the engine's output handler and waits for its end. AsyncLLM.shutdown stops
    EngineCore first and cancels the handler after: in between the handler wakes on the closed
    engine and logs EngineDeadError with a traceback."""
    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done():
        return
    loop = handler.get_loop()
    try:
        on_its_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_its_loop = False
    if on_its_loop or not loop.is_running():
        handler.cancel()
        return
    asyncio.run_coroutine_threadsafe(_cancel_output_handler(engine), loop).result(timeout=30)


async def _cancel_output_handler(engine: AsyncLLM) -> None:
    """On the handler's own loop: cancels it and waits for its end, before EngineCore stops."""
    handler = getattr(engine, "output_handler", None)
    if handler is not None and not handler.done():
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)


def _import_vllm_apart() -> tuple[type, type]:
    """vLLM's engine classes, imported on a thread of its own. Imported under `__init__`, vLLM
    leaves frames of its import referenced, and through their callers' frames the actor itself:
    Ray Data's pool shutdown then cannot free the actor, `__del__` does not run, and Ray kills
    EngineCore under a live client (an EngineDeadError traceback in the log of every job)."""
    imported = {}

    def load() -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        imported["classes"] = AsyncEngineArgs, AsyncLLM

    thread = threading.Thread(target=load, name="import-vllm")
    thread.start()
    thread.join()
    return imported["classes"]
