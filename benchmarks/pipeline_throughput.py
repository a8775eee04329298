"""Throughput of the specbatch job against vLLM alone and against Ray Data LLM, on the same
prompts, engine settings and machine, in one run; and peak memory for N and 10N prompts.

    python benchmarks/pipeline_throughput.py [--prompts 1024] [--max-tokens 32] [--memory-scale 10]

(a) vLLM alone: one `LLM.generate` over all prompts in one process.
(b) specbatch: the full job through Ray Data, one replica, reading from and writing to moto's
    S3 server on 127.0.0.1.
(c) Ray Data LLM: `build_processor(vLLMEngineProcessorConfig(...))`, same engine arguments,
    same S3 input and output.
Each runs in its own process (clean memory figures). Engine start is excluded from the
steady-state figures and included in the end-to-end ones; both are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ProcessWatcher(threading.Thread):
    """Peak RSS of the engine actor (its process and the vLLM engine processes under it)."""

    def __init__(self, title: str):
        super().__init__(daemon=True)
        self.title, self.peak_mb, self.stop = title, 0.0, False

    def run(self):
        import psutil

        while not self.stop:
            for proc in psutil.process_iter(["cmdline"]):
                try:
                    if self.title in " ".join(proc.info["cmdline"] or []):
                        tree = [proc] + proc.children(recursive=True)
                        self.peak_mb = max(self.peak_mb, sum(p.memory_info().rss for p in tree) / 2**20)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            time.sleep(0.5)


def load(config_path: str):
    from pipeline.config import load_config

    return load_config(config_path)


def run_vllm_alone(config_path: str, prompts_file: str) -> dict:
    from vllm import LLM, SamplingParams

    from pipeline.engine import engine_kwargs

    config = load(config_path)
    prompts = json.loads(Path(prompts_file).read_text())
    started = time.time()
    llm = LLM(**engine_kwargs(config))
    ready = time.time()
    params = SamplingParams(max_tokens=config.sampling.max_tokens, temperature=config.sampling.temperature)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = time.time()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "steady_s": done - ready, "total_s": done - started, "driver_rss_mb": peak_rss_mb()}


def run_specbatch(config_path: str) -> dict:
    from pipeline.outputs import OutputLocation
    from pipeline.runner import run_job
    from pipeline.storage import Storage

    config = load(config_path)
    watcher = ProcessWatcher("MapBatches(Generator)")
    watcher.start()
    started = time.time()
    manifest = run_job(config, progress=False)
    done = time.time()
    watcher.stop = True
    stats = OutputLocation(Storage.from_config(config.storage), config.output_uri).read_table("stats").to_pylist()
    first = min(r["started_at"] for r in stats)
    last = max(r["started_at"] + r["engine_seconds"] for r in stats)
    return {
        "tokens": manifest.totals.generated_tokens,
        "steady_s": last - first,
        "total_s": done - started,
        "driver_rss_mb": peak_rss_mb(),
        "actor_rss_mb": watcher.peak_mb,
        "acceptance_rate": manifest.totals.acceptance_rate,
    }


def run_ray_data_llm(config_path: str) -> dict:
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from pipeline.engine import engine_kwargs
    from pipeline.storage import Storage

    config = load(config_path)
    storage = Storage.from_config(config.storage)
    ray.init(num_cpus=4, logging_level="WARNING", _node_ip_address="127.0.0.1")
    kwargs = engine_kwargs(config)
    kwargs.pop("model")
    processor = build_processor(
        vLLMEngineProcessorConfig(
            model_source=config.model.path,
            engine_kwargs=kwargs,
            batch_size=config.resources.rows_per_unit,
            concurrency=1,
            max_concurrent_batches=config.resources.units_in_flight,
            chat_template_stage=False,
            placement_group_config={"bundles": [{"CPU": 1}]},
            # Its engine-metrics logger imports ray.serve (not installed: ray[serve] is not ours).
            log_engine_metrics=False,
        ),
        preprocess=lambda row: {
            "prompt": row["prompt"],
            "sampling_params": {"max_tokens": config.sampling.max_tokens, "temperature": config.sampling.temperature},
        },
        postprocess=lambda row: {"id": row["id"], "text": row["generated_text"], "n": row["num_generated_tokens"]},
    )
    input_uri = config.input_uri
    started = time.time()
    ds = ray.data.read_parquet(input_uri.split("://", 1)[1], filesystem=storage.arrow_fs(input_uri))
    out = processor(ds).materialize()
    tokens = sum(out.to_pandas()["n"])
    out.write_parquet(config.output_uri.split("://", 1)[1] + "rdllm", filesystem=storage.arrow_fs(config.output_uri))
    done = time.time()
    return {"tokens": int(tokens), "total_s": done - started, "driver_rss_mb": peak_rss_mb()}


def child(mode: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, *args], capture_output=True, text=True, cwd=ROOT
    )
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{mode} failed:\n{out.stderr[-4000:]}")


def prepare(workdir: Path, endpoint: str, n: int, max_tokens: int, tag: str) -> tuple[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs
    import yaml

    from pipeline.tools.demo import demo_models, sample_prompts

    models, _ = demo_models(workdir)
    prompts = sample_prompts(n, seed=1)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    shards = 8
    for s in range(shards):
        ids = [f"{tag}-{i}" for i in range(s, n, shards)]
        pq.write_table(pa.table({"id": ids, "prompt": prompts[s::shards]}), f"bench/{tag}/in/{s:03d}.parquet", filesystem=fs)
    config = yaml.safe_load((ROOT / "jobs" / "configs" / "local.yaml").read_text())
    config.update(input_uri=f"s3://bench/{tag}/in/", output_uri=f"s3://bench/{tag}/out/", storage={"endpoint_url": endpoint})
    config["model"]["path"], config["speculative"]["drafter"] = models["target"], models["drafter"]
    config["sampling"]["max_tokens"] = max_tokens
    config_path = workdir / f"{tag}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    prompts_path = workdir / f"{tag}.json"
    prompts_path.write_text(json.dumps(prompts))
    return str(config_path), str(prompts_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--memory-scale", type=int, default=10, help="0 skips the memory runs")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        result = {"vllm": run_vllm_alone, "specbatch": run_specbatch, "raydatallm": run_ray_data_llm}[mode](*rest)
        print("RESULT " + json.dumps(result), flush=True)
        return

    import boto3
    from moto.server import ThreadedMotoServer

    from tests.conftest import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    workdir = Path(tempfile.mkdtemp(prefix="specbatch-bench-"))
    n = args.prompts
    config, prompts = prepare(workdir, endpoint, n, args.max_tokens, "n")
    print(f"{n} prompts x {args.max_tokens} tokens, config {config}", flush=True)
    a = child("vllm", config, prompts)
    print("(a)", a, flush=True)
    b = child("specbatch", config)
    print("(b)", b, flush=True)
    c = child("raydatallm", config)
    print("(c)", c, flush=True)
    rate = lambda r, key: r["tokens"] / r[key]  # noqa: E731
    print(f"\n{'run':<34}{'tokens':>8}{'steady tok/s':>14}{'end-to-end tok/s':>18}")
    print(f"{'(a) vLLM alone, one generate()':<34}{a['tokens']:>8}{rate(a, 'steady_s'):>14,.0f}{rate(a, 'total_s'):>18,.0f}")
    print(f"{'(b) specbatch job, S3, 1 replica':<34}{b['tokens']:>8}{rate(b, 'steady_s'):>14,.0f}{rate(b, 'total_s'):>18,.0f}")
    print(f"{'(c) Ray Data LLM processor, S3':<34}{c['tokens']:>8}{'-':>14}{rate(c, 'total_s'):>18,.0f}")
    print(f"(b)/(a) steady state: {rate(b, 'steady_s') / rate(a, 'steady_s'):.3f}   end to end: {rate(b, 'total_s') / rate(a, 'total_s'):.3f}")
    print(f"(b)/(c) end to end:   {rate(b, 'total_s') / rate(c, 'total_s'):.3f}")
    print(f"acceptance rate in (b): {b['acceptance_rate']}")

    if args.memory_scale:
        big_config, _ = prepare(workdir, endpoint, n * args.memory_scale, args.max_tokens, "big")
        big = child("specbatch", big_config)
        print(f"\npeak RSS, MB        {n:>8} prompts {n * args.memory_scale:>8} prompts   ratio")
        for key, label in (("driver_rss_mb", "driver"), ("actor_rss_mb", "engine actor")):
            print(f"{label:<20}{b[key]:>16,.0f}{big[key]:>17,.0f}{big[key] / b[key]:>8.2f}")
    server.stop()


if __name__ == "__main__":
    main()
