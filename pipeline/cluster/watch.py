"""While the job runs: which nodes left the cluster and what waits for resources
(`ClusterWatch`), and the driver's stall watch (`StallWatch`), which ends a wait that cannot end
(pipeline/job/watch.py says why)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Callable

from pipeline.config import JobConfig


WAITING_ACTOR_STATES = ("PENDING_CREATION", "DEPENDENCIES_UNREADY", "RESTARTING")
# How often the driver looks at the cluster.
WATCH_SECONDS = 10.0


class SchedulingStalled(RuntimeError):
    """Nothing committed for `retries.stall_minutes` while the job's engines or tasks waited for resources."""


class ClusterWatch:
    """Nodes lost since the watch started, and whether anything of the job waits for resources.
    `engine_actor`: what Ray calls the engine actors (pipeline/graph.engine_actor_label), named
    first among what waits."""

    def __init__(self, engine_actor: str = ""):
        import ray

        self.engine_actor = engine_actor
        self.job_id = ray.get_runtime_context().get_job_id()
        self.alive = self._alive_nodes()

    @staticmethod
    def _alive_nodes() -> dict[str, str]:
        import ray

        return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}

    def lost_nodes(self) -> dict[str, str]:
        """Nodes (id -> address) alive when the watch started, and dead now."""
        now = self._alive_nodes()
        return {node: address for node, address in self.alive.items() if node not in now}

    def waiting(self) -> list[str]:
        """This job's actors and placement groups that wait for resources, the engine actors
        first (the GCS lists actors in no set order, and the message names the first six)."""
        import ray
        import ray._private.state

        actors = []
        for actor in ray._private.state.actors().values():
            if actor.get("JobID") == self.job_id and actor.get("State") in WAITING_ACTOR_STATES:
                actors.append(f"actor {actor.get('ActorClassName') or actor['ActorID'][:8]} ({actor['State']})")
        groups = [
            f"placement group {group_id[:8]} {group.get('bundles')} ({group.get('strategy')})"
            for group_id, group in ray.util.placement_group_table().items()
            if group.get("state") == "PENDING"
        ]
        return sorted(actors, key=lambda actor: not (self.engine_actor and self.engine_actor in actor)) + groups


def stall_message(config: JobConfig, waiting: list[str], idle_seconds: float) -> str:
    minutes = idle_seconds / 60
    return (
        f"no unit committed for {minutes:.1f} minutes (retries.stall_minutes = {config.retries.stall_minutes:g}) while "
        f"the job waits for resources: {'; '.join(waiting[:6])}{' ...' if len(waiting) > 6 else ''}. The cluster has "
        "not got them free (other jobs hold them, or the nodes that had them are gone and the autoscaler adds none). "
        "Committed units are kept: rerun when the resources are there."
    )


class StallInterrupt(BaseException):
    """Raised in the driver's main thread by the stall watch (a BaseException, as
    KeyboardInterrupt is, so no `except Exception` on the way swallows it)."""


def _raise_in_main_thread(exc_type: type | None) -> None:
    """An exception raised in the main thread at its next Python instruction (None: drop one
    not delivered yet). Not a signal: a job started in the background by a shell or a scheduler
    has SIGINT ignored, and `_thread.interrupt_main()` then does nothing (a stalled job waited forever)."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident), exc)


class StallWatch(threading.Thread):
    """Looks at the job while the driver waits for the next unit: every WATCH_SECONDS it calls
    `look(seconds since the last committed unit)`, and when that returns an exception (the job
    cannot go on: pipeline/job/watch.py names why) it raises StallInterrupt in the driver's wait
    (Ray Data's consumer sleeps in a loop, so it lands at once) and leaves the exception in
    `failure` for the driver to raise. It raises it too within a second of `lost()` turning true
    (the run lost its lease), `failure` None."""

    def __init__(self, look: Callable[[float], BaseException | None], lost: Callable[[], bool] = lambda: False):
        super().__init__(name="specbatch-stall-watch", daemon=True)
        self.look, self.lost = look, lost
        self.last = time.time()
        self.failure: BaseException | None = None
        self._raised = False
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # no interrupt once the driver stopped the watch

    def progress(self) -> None:
        self.last = time.time()

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
            if self._raised:  # one raised and not delivered yet is dropped
                _raise_in_main_thread(None)

    def run(self) -> None:
        last_look = 0.0
        while not self._stopped.wait(1.0):
            if self.lost():
                self._interrupt(None)
                continue
            if time.time() - last_look < WATCH_SECONDS:
                continue
            last_look = time.time()
            try:
                failure = self.look(time.time() - self.last)
            except (
                Exception
            ) as exc:  # a GCS or storage call that failed (a loaded or shrinking cluster): look again next round
                logging.getLogger("specbatch").warning(
                    "job watch: cannot look at the job (%s: %s)", type(exc).__name__, exc
                )
                continue
            if failure is not None:
                self._interrupt(failure)

    def _interrupt(self, failure: BaseException | None) -> None:
        # Again each round until the driver stops the watch, in case one lands where it is
        # caught and dropped.
        with self._lock:
            if not self._stopped.is_set():
                self.failure, self._raised = failure, True
                _raise_in_main_thread(StallInterrupt)
