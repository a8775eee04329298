"""vLLM engine arguments from a job config: one definition, used by the engine actors, the
benchmarks and calibration, so that every measurement runs the job's own engine settings."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from pipeline.config import JobConfig
from pipeline.storage import Storage
from pipeline.storage.model_cache import localize


def engine_kwargs(
    config: JobConfig, *, speculative: bool | None = None, num_speculative_tokens: int | None = None
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` / `AsyncEngineArgs(...)`. `speculative` and
    `num_speculative_tokens` override the config (calibration, side-by-side checks). Models in
    object storage are copied into this node's model cache first (pipeline/storage/model_cache.py): this
    runs in the process that starts the engine, on the engine's node."""
    storage = Storage.from_config(config.storage)
    kwargs = _engine_settings(config, storage)
    kwargs.update(_backend_options(config))
    use_spec = config.speculative.enabled if speculative is None else speculative
    if use_spec:
        kwargs.update(_speculation_options(config, storage, num_speculative_tokens))
    kwargs.update(config.engine.extra_args)
    return kwargs


def _engine_settings(config: JobConfig, storage: Storage) -> dict[str, Any]:
    """The model and tokenizer (copied into the model cache), and the engine section's settings."""
    engine = config.engine
    model = localize(config.model.path, storage)
    return dict(
        model=model,
        tokenizer=localize(config.model.tokenizer, storage, weights=False) if config.model.tokenizer else model,
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enforce_eager=engine.enforce_eager,
        seed=engine.seed,
        disable_log_stats=False,
    )


def _backend_options(config: JobConfig) -> dict[str, Any]:
    """The executor, the CPU build's KV cache, LoRA, structured outputs and the batched tokens."""
    engine, kwargs = config.engine, {}
    if config.engine_workers > 1 and not config.resources.cpu_build:
        # One process per GPU, started by vLLM's Ray executor inside the engine actor's placement
        # group (pipeline/cluster/placement.py), possibly on other nodes. vLLM's CPU build has no Ray
        # executor: there its own multiprocessing executor runs the workers on the actor's node.
        kwargs["distributed_executor_backend"] = "ray"
    if config.resources.cpu_build:
        kwargs["kv_cache_memory_bytes"] = int(engine.cpu_kv_cache_gib * 2**30)
    if config.lora:
        kwargs.update(enable_lora=True, max_lora_rank=config.lora.max_rank, max_loras=config.lora.max_loras)
    kwargs["structured_outputs_config"] = {"backend": structured_backend(config)}
    if not engine.json_whitespace:
        kwargs["structured_outputs_config"]["disable_any_whitespace"] = True
    if engine.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = engine.max_num_batched_tokens
    return kwargs


def _speculation_options(config: JobConfig, storage: Storage, num_speculative_tokens: int | None) -> dict[str, Any]:
    """The drafter (copied into the model cache) and its depth: a fixed depth asked for replaces the schedule."""
    spec = config.speculative
    speculative_config = {
        "method": spec.method,
        "model": localize(spec.drafter, storage),
        "num_speculative_tokens": num_speculative_tokens or spec.num_speculative_tokens,
    }
    if spec.depth_schedule and not num_speculative_tokens:
        speculative_config["num_speculative_tokens_per_batch_size"] = [list(r) for r in spec.depth_schedule]
    # Per-request acceptance counts: exact per-batch stats even when batches overlap.
    return {"per_request_spec_decode_metrics": "summary", "speculative_config": speculative_config}


def structured_backend(config: JobConfig) -> str:
    """vLLM's structured-output backend: auto (xgrammar, falling back to guidance) unless compact
    JSON is asked for, which vLLM allows only with one named backend."""
    return "auto" if config.engine.json_whitespace else "xgrammar"


def schedule_text(schedule) -> str:
    """`1-8:3,9-64:0`: a depth schedule as one readable string (stats, reports)."""
    return ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in schedule)


def prepare_process_env(config: JobConfig) -> None:
    """Environment a vLLM process needs before its engine starts (no hub, the CPU threads).
    A one-process engine talks to its EngineCore over loopback; left unset, vLLM would pick the
    machine's outward interface. A GPU engine of several workers (tensor or pipeline parallel)
    may span nodes through vLLM's Ray executor: its address is the node's address in the Ray
    cluster, never loopback, which the other nodes could not reach."""
    if config.engine_workers > 1 and not config.resources.cpu_build:
        import ray

        os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()
    else:
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if config.engine.cpu_omp_threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.engine.cpu_omp_threads_bind
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def lora_requests(config: JobConfig) -> dict[str, Any]:
    """vLLM LoRARequest of each configured adapter, from this node's copy of it."""
    if not config.lora:
        return {}
    from vllm.lora.request import LoRARequest

    storage = Storage.from_config(config.storage)
    return {
        name: LoRARequest(name, number, localize(path, storage))
        for number, (name, path) in enumerate(sorted(config.lora.adapters.items()), start=1)
    }


class EngineProcesses:
    """This process's engine processes (vLLM's EngineCore and its workers), noted while they
    are its descendants, so that they are ended with the engine, before a replacement starts.
    A vLLM worker learns that its EngineCore died only from its death pipe, whose watcher
    merely flags the worker's message queues; a worker blocked where the flag is not read (the
    queues' start-up handshake, a zmq recv without timeout; a write into a full ring buffer)
    lives on, re-parented to init, holding the model's memory (on a GPU, the device's) until
    killed. The watch looks every 0.2 s while the engine starts (an EngineCore that dies then
    leaves workers it started) and once more when asked to end them."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self.seen: dict[int, Any] = {}  # pid -> psutil.Process, which knows its start time (no reused pid is killed)

    def watch(self) -> Callable[[], None]:
        """Looks every 0.2 s until the function returned is called (then once more)."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.2):
                self.look()

        threading.Thread(target=watch, name="specbatch-engine-processes", daemon=True).start()

        def done() -> None:
            stop.set()
            self.look()

        return done

    def look(self) -> None:
        import psutil

        try:
            for child in self._me.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.Error:  # a child that ended while listed
            pass

    def running(self) -> list[int]:
        """The pids of the engine processes still running (multiprocessing's resource tracker aside)."""
        self.look()
        return [p.pid for p in self.seen.values() if p.is_running() and not _is_resource_tracker(p)]

    def end(self, grace_seconds: float = 5.0, patience: float = 0.0) -> list[int]:
        """SIGKILL each engine process still running (after up to `patience` seconds for them to
        exit on their own), and wait up to `grace_seconds` for them to be gone; returns the pids
        that had to be killed."""
        import psutil

        self.look()
        running = [p for p in self.seen.values() if p.is_running() and not _is_resource_tracker(p)]
        if patience and running:
            _, running = psutil.wait_procs(running, timeout=patience)
        titles = [f"{p.pid} ({process_title(p)[:60]})" for p in running]
        for proc in running:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(running, timeout=grace_seconds)
        if running:
            logging.getLogger("specbatch").warning(
                "ended %d process(es) of this actor's engine that outlived it: %s", len(running), ", ".join(titles)
            )
        return [p.pid for p in running]


# An engine whose start fails is started once more: an EngineCore killed while it loads (a GPU
# fault, the OOM killer) fails the actor's creation, which Ray does not retry. A second failure
# is the job's error, named (a start that fails every time, e.g. out of memory, costs one start).
ENGINE_START_ATTEMPTS = 2


def start_engine(
    config: JobConfig, processes: EngineProcesses, vllm_classes: tuple[type, type], stat_loggers: list | None = None
):
    """vLLM's AsyncLLM (`vllm_classes`: AsyncEngineArgs and AsyncLLM) for the job's engine
    settings, with its processes noted in `processes`; a failed start leaves none of them.
    `stat_loggers`: vLLM stat logger factories (pipeline/stages/engine_watch.py's clock)."""
    AsyncEngineArgs, AsyncLLM = vllm_classes
    for attempt in range(1, ENGINE_START_ATTEMPTS + 1):
        started = processes.watch()
        try:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(config)), stat_loggers=stat_loggers)
        except Exception as exc:
            started()
            processes.end()
            if attempt == ENGINE_START_ATTEMPTS:
                raise
            logging.getLogger("specbatch").warning("the engine failed to start (%s); starting it once more", exc)
            continue
        started()
        return engine


def _is_resource_tracker(proc) -> bool:
    """multiprocessing's resource tracker, which unlinks the shared memory a killed engine
    leaves behind once its users are gone: not ended with the engine."""
    import psutil

    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def process_title(process) -> str:
    """A process's title as `ps` shows it (vLLM names its engine process VLLM::EngineCore)."""
    try:
        return " ".join(process.cmdline()) or process.name()
    except Exception:  # gone, or not ours to read
        return ""
