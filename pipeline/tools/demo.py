"""The embedded default: local Ray, local folders, sample prompt shards, the tiny model kit
and vLLM's CPU build, through exactly the code path a GPU cluster runs."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from pipeline.config import load_config
from pipeline.runner import run_job


def demo_models(workdir: Path) -> dict[str, str]:
    """The trained tiny kit when it is present, else a random-weight kit built here."""
    from pipeline import tinykit

    paths = tinykit.kit_paths()
    if Path(paths["target"], "config.json").is_file():
        return {"target": paths["target"], "drafter": paths["drafter_eagle31"]}
    from pipeline.tinykit.random_kit import build_random_kit

    return build_random_kit(str(workdir / "random-kit"))


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
    root = Path(workdir).resolve()
    models = demo_models(root)
    write_sample_shards(root / "prompts", rows)
    template = yaml.safe_load((Path(__file__).parents[1] / "jobs" / "configs" / "local.yaml").read_text())
    template.update(input_uri=str(root / "prompts"), output_uri=str(root / "output"))
    template["model"]["path"] = models["target"]
    template["speculative"]["drafter"] = models["drafter"]
    config_path = root / "job.yaml"
    config_path.write_text(yaml.safe_dump(template, sort_keys=False))

    manifest = run_job(load_config(str(config_path)))
    t = manifest.totals
    print(f"\nspecbatch demo: {manifest.status}")
    print(f"  config   {config_path}")
    print(f"  outputs  {root / 'output'}  (outputs/, errors/, stats/, _job.json)")
    print(f"  rows     {t.output_rows} generated, {t.error_rows} failed, of {t.input_rows}")
    print(f"  tokens   {t.generated_tokens} generated in {t.wall_seconds:.1f}s = {t.tokens_per_second:,.0f} tok/s")
    if t.acceptance_rate is not None:
        print(f"  drafts   acceptance rate {t.acceptance_rate:.3f}, mean acceptance length {t.mean_acceptance_length:.2f}")
    from pipeline.cli import EXIT

    return EXIT.get(manifest.status, EXIT["failed"])
