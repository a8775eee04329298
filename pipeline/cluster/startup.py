"""The job's start: Ray for the job, and where the time to the first committed unit went,
phase by phase, in `_job.json` (Attempt.start).

The driver marks its own phases on a StartClock; each engine actor posts its start to the job
board (pipeline/cluster/job_board.py): process, `import vllm`, EngineCore, engine ready. The phases are
intervals on one time line from the driver's process start, so that overlapping work (engines
loading while units are read and prepared) shows as overlap.

Ray starts after the input check, not beside it: both are CPU-bound, side by side they saved
nothing measurable, and every refusal then started Ray first (docs/measurements.md).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

from schemas import EngineStart, StartCost, StartPhase
from schemas.board import ProbeVerdict


class StartClock:
    """Unix times of the driver's steps. The time line starts at the process's start for a
    process that runs one job (`specbatch run`: `from_process_start`), else when the job began."""

    def __init__(self, from_process_start: bool = False):
        now = time.time()
        self.marks: dict[str, float] = {"process": process_started_at() if from_process_start else now, "run": now}

    def mark(self, name: str) -> float:
        self.marks.setdefault(name, time.time())
        return self.marks[name]


def process_started_at() -> float:
    import psutil

    return psutil.Process(os.getpid()).create_time()


def local_ray_cpus() -> int:
    """Logical CPUs of the job's own local Ray: Ray Data's listing and read tasks claim logical
    CPUs next to the engine and preprocess actors, and on a 2-core machine the graph could not
    be scheduled with one logical CPU per core. The engine's own threads are outside Ray's
    accounting anyway."""
    return max(4, os.cpu_count() or 1)


def ray_init(verbose: bool = False, address: Optional[str] = None) -> tuple[Optional[str], str]:
    """Ray for the job, and which cluster it is, said plainly. `address` (--address), else
    RAY_ADDRESS (set by `ray job submit`), joins that cluster; otherwise the job starts a Ray of
    its own: never a cluster it happens to find on the machine through Ray's
    `ray_current_cluster` file, which a killed cluster leaves behind. A Ray of its own has no
    dashboard (a batch job has no one to show it to; it starts in about 2 s less), and its
    metrics endpoint still serves. Workers' logs (Ray's and vLLM's) stay in Ray's session log
    folder, which is returned, unless `verbose`."""
    import ray
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = verbose
    if not verbose:
        _ray_data_console_errors_only()
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=verbose)
        else:
            # a new local Ray turns token authentication on when RAY_AUTH_MODE is unset, and
            # warns that it did on every run: the job's own Ray is on 127.0.0.1 only
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
            ray.init(
                address="local",
                num_cpus=local_ray_cpus(),
                logging_level=logging.WARNING,
                log_to_driver=verbose,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
            )
        _spend_the_restart_warning()  # Ray prints it once per process: a Ray this job started
    node = ray._private.worker._global_node
    logs = node.get_logs_dir_path() if node is not None and not address else None
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    how = f"joined {address}" if address else "its own local Ray"
    return logs, f"{how} (GCS {ray.get_runtime_context().gcs_address}, {nodes} node{'s' if nodes != 1 else ''})"


class _Restartable:
    def __init__(self, _argument):
        pass


def _spend_the_restart_warning() -> None:
    """Ray's core worker logs once per process, as an ERROR on the driver's stderr, that a
    restartable actor has constructor arguments in the object store (ray-project/ray#53727).
    Every Ray Data actor pool has them (it ray.puts its map function, which the driver holds for
    the whole job), so for specbatch that line is no error. The driver spends it on an actor
    that it kills before it starts, with stderr pointed away; Ray's log file keeps the line."""
    import ray

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        actor = ray.remote(num_cpus=0, max_restarts=1)(_Restartable).remote(ray.put(None))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    ray.kill(actor, no_restart=True)


def _ray_data_console_errors_only() -> None:
    """Ray Data logs each dataset's start, plan and end, and that progress bars are off, to the
    console at INFO and WARNING; its log file in the session's folder keeps them all."""
    import ray.data  # noqa: F401  (configures the "ray.data" logger)
    from ray._private.log import PlainRayHandler

    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, PlainRayHandler):
            handler.setLevel(logging.ERROR)


def start_cost(clock: StartClock, engines: list[EngineStart], verdict: Optional[ProbeVerdict]) -> StartCost:
    """The phases to the first committed unit, on the driver's time line. The engine phases
    are those of the first engine ready; every engine start is listed."""
    t0, m = clock.marks["process"], clock.marks
    phases: list[StartPhase] = []

    def phase(name: str, begin: Optional[float], end: Optional[float]) -> None:
        if begin is not None and end is not None and end >= begin:
            phases.append(StartPhase(name=name, started_s=round(begin - t0, 3), seconds=round(end - begin, 3)))

    if m["run"] > t0:
        phase("process start and imports", t0, m["run"])
    phase("Ray start", m.get("ray_started"), m.get("ray_ready"))
    phase("input check and planning", m.get("run"), m.get("planned"))
    first = min(engines, key=lambda e: e.engine_ready_at, default=None)
    if first is not None:
        phase("engine actor start", m.get("graph_started"), max(first.init_started_at, m.get("graph_started", 0.0)))
        phase("import vllm", first.init_started_at, first.vllm_imported_at)
        core = first.engine_core_started_at
        if (
            core is not None
        ):  # a process's start time is known to about a second (the kernel's boot time is whole seconds)
            core = min(max(core, first.vllm_imported_at), first.engine_ready_at)
            phase("engine arguments and EngineCore spawn", first.vllm_imported_at, core)
            phase("EngineCore start: model load, KV cache, warm-up", core, first.engine_ready_at)
        else:
            phase("engine start: EngineCore, model load, KV cache", first.vllm_imported_at, first.engine_ready_at)
    probed_until = None
    if verdict is not None and verdict.result is not None and verdict.started_at is not None:
        probed_until = verdict.started_at + verdict.result.seconds
        phase("drafter probe (on the job's first engine)", verdict.started_at, probed_until)
    if first is not None:
        phase("first unit", max(first.engine_ready_at, probed_until or 0.0), m.get("first_commit"))
    phases.sort(key=lambda p: p.started_s)
    first_commit, generating = m.get("first_commit"), m.get("generating")
    return StartCost(
        to_first_commit_seconds=round(first_commit - t0, 3) if first_commit else None,
        generation_started_s=round(generating - t0, 3) if generating else None,
        phases=phases,
        engine_starts=engines,
    )
