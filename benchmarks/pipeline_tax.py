"""What specbatch costs beyond the tokens: the same job through vLLM alone, Ray Data LLM and
specbatch, side by side, whole processes, in alternating rounds.

    python benchmarks/pipeline_tax.py [--sizes 256x32,2048x64] [--stores local,s3] [--rounds 3]
                                      [--kinds vllm,raydatallm,specbatch] [--ray own|cluster]

Every run is one process started from here, as a user starts it, on the same prompts (8
Parquet shards), engine settings and EAGLE-3.1 kit drafter (k=3), reading and writing Parquet:
  vllm       a plain script: read the Parquet prompts, one `LLM.generate`, write Parquet
  raydatallm Ray Data LLM: read_parquet -> build_processor(vLLMEngineProcessorConfig) -> write_parquet
  specbatch  `specbatch run CONFIG`, with the drafter probe and the acceptance guard on
In each round the three run in turn (their order rotates from round to round), so a slow
patch of this shared machine falls on all of them. Figures are medians over the rounds, with
min-max. Printed per run kind:
  wall s          whole process, from start to exit (wall time)
  steady tok/s    generated tokens / the time the engine generated: vllm the generate() call;
                  specbatch first unit into the engine to last unit out; raydatallm not known
  1st commit s    specbatch: from process start to the first committed unit (_job.json)
  engine starts   VLLM::EngineCore processes the run started (counted from the process table)
  busy share      engine time / wall time: vllm generate() / wall; specbatch _job.json's
                  engine_busy_share
  CPU s / 1M tok  CPU seconds of every process of the run (sampled each 0.5 s) by group, per
                  million generated tokens: the vLLM engine processes (EngineCore, Worker) and
                  everything outside them (driver, engine actor, preprocess, Ray's workers and
                  daemons)
and specbatch's start-up phases (medians), which say where its time to the first unit goes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
SHARDS = 8
KINDS = ("vllm", "raydatallm", "specbatch")


# ---------------------------------------------------------------- the three runs (child processes)


def _parquet_paths(config) -> tuple[object, list[str]]:
    import pyarrow.fs as pafs

    from pipeline.storage import Storage

    storage = Storage.from_config(config.storage)
    fs, path = storage.fs(config.input_uri)
    files = sorted(fs.glob(path.rstrip("/") + "/*.parquet"))
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), files


def run_vllm(config_path: str, sort_prompts: bool = False) -> dict:
    """vLLM alone: the Parquet prompts, one `LLM.generate`, Parquet out. `sort_prompts`: in the
    prompts' text order (rows that share a prefix side by side), not the input's."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams

    from pipeline.config import load_config
    from pipeline.stages.engine import engine_kwargs

    config = load_config(config_path)
    fs, files = _parquet_paths(config)
    table = pa.concat_tables([pq.read_table(f, filesystem=fs) for f in files])
    if sort_prompts:
        table = table.sort_by("prompt")
    llm = LLM(**engine_kwargs(config))
    params = SamplingParams(max_tokens=config.sampling.max_tokens, temperature=config.sampling.temperature)
    started = time.time()
    outputs = llm.generate(table.column("prompt").to_pylist(), params, use_tqdm=False)
    seconds = time.time() - started
    out = pa.table(
        {
            "id": table.column("id"),
            "text": [o.outputs[0].text for o in outputs],
            "tokens": [len(o.outputs[0].token_ids) for o in outputs],
        }
    )
    fs_out, out_path = _output(config, "vllm")
    pq.write_table(out, out_path + "/part-0.parquet", filesystem=fs_out)
    return {
        "tokens": int(sum(out.column("tokens").to_pylist())),
        "engine_seconds": seconds,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),  # prefix-cache hits (prefix_sharing.py)
        "kv_cache_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }


def _output(config, name: str):
    import pyarrow.fs as pafs

    from pipeline.storage import Storage

    storage = Storage.from_config(config.storage)
    uri = storage.join(config.output_uri, name)
    fs, path = storage.fs(uri)
    fs.makedirs(path, exist_ok=True)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def run_ray_data_llm(config_path: str) -> dict:
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from pipeline.config import load_config
    from pipeline.stages.engine import engine_kwargs

    config = load_config(config_path)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="WARNING")
    else:
        ray.init(
            num_cpus=max(4, os.cpu_count() or 1),
            logging_level="WARNING",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
        )
    ray.data.DataContext.get_current().enable_progress_bars = False
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
            log_engine_metrics=False,  # its engine-metrics logger imports ray.serve, which ray[data] lacks
        ),
        preprocess=lambda row: {
            "prompt": row["prompt"],
            "sampling_params": {"max_tokens": config.sampling.max_tokens, "temperature": config.sampling.temperature},
        },
        postprocess=lambda row: {"id": row["id"], "text": row["generated_text"], "tokens": row["num_generated_tokens"]},
    )
    fs, files = _parquet_paths(config)
    fs_out, out_path = _output(config, "raydatallm")
    processor(ray.data.read_parquet(files, filesystem=fs)).write_parquet(out_path, filesystem=fs_out)
    written = ray.data.read_parquet(out_path, filesystem=fs_out)
    return {"tokens": int(written.sum("tokens"))}


def run_specbatch(config_path: str) -> dict:
    """Only reads what `specbatch run` (run by the parent) left."""
    from pipeline.commit.outputs import OutputLocation
    from pipeline.config import load_config
    from pipeline.storage import Storage

    config = load_config(config_path)
    location = OutputLocation(Storage.from_config(config.storage), config.output_uri)
    manifest = location.read_manifest()
    stats = location.read_table("stats").to_pylist()
    first = min(r["started_at"] for r in stats)
    last = max(r["started_at"] + r["engine_seconds"] for r in stats)
    start = manifest["attempts"][-1]["start"]
    return {
        "tokens": manifest["totals"]["generated_tokens"],
        "engine_seconds": last - first,
        "busy_share": manifest["totals"]["engine_busy_share"],
        "first_commit_s": start["to_first_commit_seconds"],
        "phases": {p["name"]: p["seconds"] for p in start["phases"]},
        "status": manifest["status"],
        "probe": (manifest.get("probe") or {}).get("passed"),
    }


# ---------------------------------------------------------------- CPU by process group


def group_of(cmdline: str, root: int, pid: int) -> str:
    if "VLLM::" in cmdline or "multiprocessing.spawn" in cmdline:
        return "vLLM engine processes"
    if pid == root:
        return "driver"
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0]
        if "MapBatches(EngineStage)" in name or "vLLMEngineStage" in name:
            return "engine actor"
        if "Preprocess" in name or "Tokenize" in name or "Detokenize" in name:
            return "preprocess"
        return "Ray workers"
    return "Ray daemons"


class CpuSampler(threading.Thread):
    """CPU seconds of a process and all its descendants, by group, and the EngineCore
    processes seen. A process's last reading before it ends is what counts (sampled often).
    `cluster`: the pid of a running Ray head's raylet, whose workers run the job's actors:
    they and the head's daemons count too, from the run's start."""

    def __init__(self, pid: int, cluster: int | None = None):
        super().__init__(daemon=True)
        self.pid, self.stop, self.cpu, self.engine_cores = pid, threading.Event(), {}, set()
        self.roots, self.baseline = [pid, *([cluster] if cluster else [])], {}

    def run(self):
        import psutil

        while not self.stop.is_set():
            procs = []
            for pid in self.roots:
                try:
                    root = psutil.Process(pid)
                    procs += [root, *root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
            if not any(p.pid == self.pid for p in procs):
                break
            for p in procs:
                try:
                    cmdline = " ".join(p.cmdline()) or p.name()
                    times = p.cpu_times()
                    seconds = times.user + times.system
                    self.baseline.setdefault(
                        p.pid,
                        seconds
                        if p.pid != self.pid and p.pid not in self.cpu and p.create_time() < self.started
                        else 0.0,
                    )
                    self.cpu[p.pid] = (group_of(cmdline, self.pid, p.pid), seconds - self.baseline[p.pid])
                    if "VLLM::EngineCore" in cmdline:
                        self.engine_cores.add((p.pid, p.create_time()))
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass
            self.stop.wait(0.5)

    def start(self):
        self.started = time.time()
        super().start()

    def by_group(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for group, seconds in self.cpu.values():
            out[group] += seconds
        return dict(out)


def timed_run(kind: str, config_path: str, cluster: dict | None = None, script: str = __file__) -> dict:
    """One whole process of `kind`, timed from outside, its CPU sampled; then its figures.
    `cluster`: a running Ray head the Ray runs join (RAY_ADDRESS), as `ray job submit` does.
    `script`: the script whose `--child KIND CONFIG` runs vllm and raydatallm (this one's by default)."""
    if kind == "specbatch":
        command = [str(Path(sys.executable).parent / "specbatch"), "run", config_path]
    else:
        command = [sys.executable, script, "--child", kind, config_path]
    started = time.time()
    env = {**os.environ, **(cluster["env"] if cluster and kind != "vllm" else {})}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = CpuSampler(proc.pid, cluster["raylet"] if cluster and kind != "vllm" else None)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.time() - started
    sampler.stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} exited {proc.returncode}:\n{stderr[-3000:]}")
    if kind == "specbatch":
        result = run_specbatch(config_path)
    else:
        (line,) = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        result = json.loads(line[len("RESULT ") :])
    if kind == "vllm":
        result["busy_share"] = result["engine_seconds"] / wall
    result.update(wall=wall, cpu=sampler.by_group(), engine_starts=len(sampler.engine_cores))
    return result


# ---------------------------------------------------------------- inputs and the report


def prepare(workdir: Path, store: str, endpoint: str | None, n: int, max_tokens: int) -> str:
    import pyarrow as pa
    import yaml

    from pipeline.storage import Storage
    from pipeline.tools.demo import demo_models, sample_prompts

    tag = f"{store}-{n}x{max_tokens}"
    models, trained = demo_models(workdir)
    if not trained:
        raise SystemExit("the trained kit is needed (models/tinykit): the random kit's drafter is refused by the probe")
    prompts = sample_prompts(n, seed=1)
    config = yaml.safe_load((ROOT / "jobs" / "configs" / "local.yaml").read_text())
    base = f"s3://bench/{tag}" if store == "s3" else str(workdir / tag)
    config.update(input_uri=f"{base}/in/", output_uri=f"{base}/out/")
    if store == "s3":
        config["storage"] = {"endpoint_url": endpoint}
    config["model"]["path"], config["speculative"]["drafter"] = models["target"], models["drafter"]
    config["sampling"]["max_tokens"] = max_tokens
    storage = Storage(endpoint_url=endpoint) if store == "s3" else Storage()
    for s in range(SHARDS):
        ids = [f"{tag}-{i}" for i in range(s, n, SHARDS)]
        uri = f"{base}/in/{s:03d}.parquet"
        if store == "local":
            Path(uri).parent.mkdir(parents=True, exist_ok=True)
        storage.write_parquet(uri, pa.table({"id": ids, "prompt": prompts[s::SHARDS]}))
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def clear_outputs(config_path: str) -> None:
    from pipeline.config import load_config
    from pipeline.storage import Storage

    config = load_config(config_path)
    fs, path = Storage.from_config(config.storage).fs(config.output_uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def med(values: list[float], digits: int = 1) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    m = statistics.median(values)
    spread = f" ({min(values):,.{digits}f}-{max(values):,.{digits}f})" if len(values) > 1 else ""
    return f"{m:,.{digits}f}{spread}"


def report(label: str, runs: dict[str, list[dict]]) -> None:
    kinds = [k for k in KINDS if runs.get(k)]
    print(f"\n== {label}: {max(len(runs[k]) for k in kinds)} rounds, medians (min-max)")
    header = f"{'':<12}{'wall s':>22}{'steady tok/s':>24}{'1st commit s':>20}{'engine starts':>15}{'busy share':>20}"
    print(header)
    for kind in kinds:
        rs = runs[kind]
        steady = [r["tokens"] / r["engine_seconds"] if r.get("engine_seconds") else None for r in rs]
        print(
            f"{kind:<12}{med([r['wall'] for r in rs]):>22}{med(steady, 0):>24}"
            f"{med([r.get('first_commit_s') for r in rs]):>20}"
            f"{med([r['engine_starts'] for r in rs], 0):>15}{med([r.get('busy_share') for r in rs], 2):>20}"
        )
    if kinds == list(KINDS):
        rounds = list(zip(runs["vllm"], runs["raydatallm"], runs["specbatch"]))
        print(f"vllm wall / specbatch wall, per round: {med([v['wall'] / s['wall'] for v, _, s in rounds], 2)}")
        print(f"raydatallm wall / specbatch wall, per round: {med([d['wall'] / s['wall'] for _, d, s in rounds], 2)}")
        steady = [(s["tokens"] / s["engine_seconds"]) / (v["tokens"] / v["engine_seconds"]) for v, _, s in rounds]
        print(f"specbatch steady tok/s / vllm steady tok/s, per round: {med(steady, 2)}")
    groups = sorted({g for k in kinds for r in runs[k] for g in r["cpu"]})
    print("CPU s per 1M generated tokens by process group (medians):")
    print(f"{'':<24}" + "".join(f"{k:>14}" for k in kinds))
    for g in [*groups, "outside the vLLM engine processes"]:
        cells = []
        for kind in kinds:
            if g == "outside the vLLM engine processes":
                vals = [
                    sum(c for n, c in r["cpu"].items() if n != "vLLM engine processes") / r["tokens"] * 1e6
                    for r in runs[kind]
                ]
            else:
                vals = [r["cpu"].get(g, 0.0) / r["tokens"] * 1e6 for r in runs[kind]]
            cells.append(f"{statistics.median(vals):>14,.0f}")
        print(f"{g:<24}" + "".join(cells))
    phases = defaultdict(list)
    for r in runs.get("specbatch", []):
        for name, seconds in r["phases"].items():
            phases[name].append(seconds)
    print("specbatch start-up phases, seconds (they overlap; medians):")
    for name, values in phases.items():
        print(f"  {name:<52}{med(values):>18}")


def start_cluster() -> dict:
    """A Ray head on 127.0.0.1 with 4 logical CPUs, as a job's own Ray has (the test suite's
    LocalCluster), for the runs to join; the raylet's pid, whose workers run the job's actors."""
    import psutil

    from tests.ray_cluster import LocalCluster

    cluster = LocalCluster(head_cpus=4)
    (raylet,) = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if cluster.temp_dir in " ".join(p.info["cmdline"] or []) and "raylet/raylet" in " ".join(p.info["cmdline"])
    ]
    return {"env": cluster.env, "raylet": raylet, "cluster": cluster}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256x32,2048x64", help="PROMPTSxMAX_TOKENS, comma-separated")
    parser.add_argument("--stores", default="local,s3", help="local and/or s3 (moto's server on 127.0.0.1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--ray",
        default="own",
        choices=("own", "cluster"),
        help="own: each Ray run starts a local Ray, as `specbatch run` alone does; cluster: they join "
        "a Ray head started once here, as jobs submitted with `ray job submit` do",
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help="which runs, comma-separated (ratios need all three)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, config = args.child
        result = {"vllm": run_vllm, "raydatallm": run_ray_data_llm}[kind](config)
        print("RESULT " + json.dumps(result), flush=True)
        return

    server = endpoint = None
    stores = args.stores.split(",")
    if "s3" in stores:
        import boto3
        from moto.server import ThreadedMotoServer

        from tests.conftest import free_port

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log: a line per request
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    workdir = Path(tempfile.mkdtemp(prefix="specbatch-tax-"))
    cluster = start_cluster() if args.ray == "cluster" else None
    try:
        for size in args.sizes.split(","):
            n, max_tokens = map(int, size.split("x"))
            for store in stores:
                config = prepare(workdir, store, endpoint, n, max_tokens)
                kinds = tuple(k for k in KINDS if k in args.kinds.split(","))
                runs: dict[str, list[dict]] = {k: [] for k in kinds}
                for r in range(args.rounds):
                    order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
                    for kind in order:
                        clear_outputs(config)
                        runs[kind].append(timed_run(kind, config, cluster))
                        print(f"  round {r + 1} {store} {size} {kind}: {runs[kind][-1]['wall']:.1f} s", flush=True)
                report(f"{n} prompts x {max_tokens} tokens, {store}, {args.ray} Ray", runs)
    finally:
        if cluster is not None:
            cluster["cluster"].shutdown()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
