"""One engine replica against two on two nodes of a one-machine Ray cluster, side by side:

    python benchmarks/scaling.py [--rows 2048] [--max-tokens 32] [--rounds 2]

A head (no engine slot) and two worker nodes with one `engine_slot` each are started with
`ray start` on 127.0.0.1 (tests/ray_cluster.py). The same job (the trained tiny kit, EAGLE-3.1
drafter, greedy) runs with `resources.replicas: 1` and `2`, alternating, each into a fresh output
location, through `specbatch run` joining the cluster. Printed per run: wall time, rows/s over
the whole run, and rows/s in steady state (from the first unit entering an engine to the last
commit: engine start excluded) and each engine's own decode rate; then the ratios of the
medians, 2 replicas over 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPECBATCH = str(Path(sys.executable).with_name("specbatch"))

from pipeline.commit.outputs import OutputLocation  # noqa: E402
from pipeline.storage import Storage  # noqa: E402
from pipeline.tools.demo import demo_models, write_sample_shards  # noqa: E402
from tests.ray_cluster import LocalCluster  # noqa: E402


def job(work: Path, models: dict, replicas: int, run: int, max_tokens: int) -> Path:
    config = yaml.safe_load((ROOT / "jobs" / "configs" / "local.yaml").read_text())
    config.update(input_uri=str(work / "prompts"), output_uri=str(work / f"out-{replicas}-{run}"))
    config["model"]["path"], config["speculative"]["drafter"] = models["target"], models["drafter"]
    config["speculative"]["guard"] = None
    config["speculative"]["probe"] = {"rows": 0}
    config["sampling"].update(max_tokens=max_tokens, ignore_eos=True)
    config["resources"].update(replicas=replicas, resources_per_replica={"engine_slot": 1})
    config["storage"] = {"shared_mounts": [str(work), str(Path(models["target"]).parent)]}
    path = work / f"job-{replicas}-{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def measure(cluster: LocalCluster, config: Path) -> dict:
    started = time.time()
    done = subprocess.run([SPECBATCH, "run", str(config)], env=cluster.env, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    location = OutputLocation(Storage(), yaml.safe_load(config.read_text())["output_uri"])
    stats = location.read_table("stats").to_pylist()
    rows = sum(s["rows"] for s in stats)
    first = min(s["started_at"] for s in stats)
    last = max(s["started_at"] + s["wall_seconds"] for s in stats)
    engines = {}
    for s in stats:  # each engine's decode rate: tokens over the time it had units inside
        engines.setdefault(s["actor_id"], []).append(s)
    per_engine = statistics.mean(
        sum(s["generated_tokens"] for s in units)
        / (max(s["started_at"] + s["wall_seconds"] for s in units) - min(s["started_at"] for s in units))
        for units in engines.values()
    )
    return dict(
        wall=wall,
        rows=rows,
        rows_per_s=rows / wall,
        steady_rows_per_s=rows / (last - first),
        start=first - started,
        nodes=len({s["node_id"] for s in stats}),
        engine_tokens_per_s=per_engine,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="scaling-"))
    models, _ = demo_models(work)
    write_sample_shards(work / "prompts", args.rows)
    print(
        f"{platform.node()}: {os.cpu_count()} cores; {args.rows} prompts, {args.max_tokens} tokens each, "
        f"{args.rounds} rounds, alternating 1 and 2 replicas"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark still stops its cluster
    cluster = LocalCluster(head_cpus=2)
    results: dict[int, list[dict]] = {1: [], 2: []}
    try:
        cluster.add_node("a", {"engine_slot": 1})
        cluster.add_node("b", {"engine_slot": 1})
        for run in range(args.rounds):
            for replicas in (1, 2):
                r = measure(cluster, job(work, models, replicas, run, args.max_tokens))
                results[replicas].append(r)
                print(
                    f"  replicas {replicas} (run {run + 1}): {r['wall']:6.1f} s wall ({r['start']:4.1f} s to the first "
                    f"unit), {r['rows_per_s']:6.1f} rows/s overall, {r['steady_rows_per_s']:6.1f} rows/s steady, "
                    f"{r['engine_tokens_per_s']:6.0f} tok/s per engine, on {r['nodes']} node(s)",
                    flush=True,
                )
    finally:
        cluster.shutdown()
    keys = ("wall", "rows_per_s", "steady_rows_per_s", "engine_tokens_per_s", "start")
    one, two = ({k: statistics.median(r[k] for r in results[n]) for k in keys} for n in (1, 2))
    print(
        f"median rows/s overall: 1 replica {one['rows_per_s']:.1f}, 2 replicas {two['rows_per_s']:.1f} "
        f"-> {two['rows_per_s'] / one['rows_per_s']:.2f}x"
    )
    print(
        f"median rows/s steady:  1 replica {one['steady_rows_per_s']:.1f}, 2 replicas {two['steady_rows_per_s']:.1f} "
        f"-> {two['steady_rows_per_s'] / one['steady_rows_per_s']:.2f}x"
    )
    print(
        f"median tok/s per engine: 1 replica {one['engine_tokens_per_s']:.0f}, 2 replicas "
        f"{two['engine_tokens_per_s']:.0f} -> {two['engine_tokens_per_s'] / one['engine_tokens_per_s']:.2f}x; time to "
        f"the first unit: {one['start']:.1f} s and {two['start']:.1f} s"
    )
    print(
        f"ideal scaling is 2.00x; the nodes here share {os.cpu_count()} cores, so each engine gets about half of what "
        "one had"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
