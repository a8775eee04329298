"""Does the speculation trial pick the faster setting, and what does it cost? Whole jobs, side
by side in one run (issue "Speculation that proves it pays on the job's own traffic"):

    python benchmarks/speculation_trial.py [--rounds 2] [--rows4 800] [--rows64 6000]

At two concurrencies on the trained tiny kit (target + EAGLE-3.1 drafter, fp32, eager, greedy,
the demo's prompts, `ignore_eos` so that every row generates its max_tokens):
  4 sequences   max_num_seqs 4, units of 4 rows, one unit in flight, max_tokens 128
  64 sequences  max_num_seqs 64, units of 64 rows, one unit in flight, max_tokens 64
each job runs three ways, as `specbatch run CONFIG` processes, each into its own output folder:
  (a) off      speculative.enabled: false
  (b) k=3      speculation at depth 3, speculative.trial: off (every unit drafts)
  (c) trial    depth 3 with the trial on (its defaults: 4 units a setting, margin 0.05, payback 5 starts)
The probe (64 rows) and the guard are on in (b) and (c), as a user runs them. The order of
the three rotates from round to round, so that drift on this shared machine falls on all of
them. Printed per concurrency and run: whole-process wall seconds (median and min-max over the
rounds), the trial's verdict, and (c) against the better of (a) and (b): the target is (c)
within 5% of it at both concurrencies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
RUNS = ("off", "k=3", "trial")
SETTINGS = {4: {"max_tokens": 128}, 64: {"max_tokens": 64}}


def build_input(folder: Path, rows: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.tools.demo import sample_prompts

    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({"id": [f"row-{i:06d}" for i in range(rows)], "prompt": sample_prompts(rows, 0)}),
        folder / "prompts.parquet",
    )
    return str(folder)


def config_for(run: str, concurrency: int, input_uri: str, output_uri: str) -> dict:
    from tinykit import kit_paths

    kit = kit_paths()
    speculative = {"enabled": run != "off", "drafter": kit["drafter_eagle31"], "num_speculative_tokens": 3}
    if run == "k=3":
        speculative["trial"] = None
    return {
        "job_name": f"trial-bench-{concurrency}",
        "input_uri": input_uri,
        "output_uri": output_uri,
        "model": {"path": kit["target"]},
        "speculative": speculative,
        "engine": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": concurrency, "enforce_eager": True},
        "sampling": {"max_tokens": SETTINGS[concurrency]["max_tokens"], "temperature": 0.0, "ignore_eos": True},
        "resources": {"replicas": 1, "rows_per_unit": concurrency, "units_in_flight": 1},
    }


def run_job_process(config: dict, workdir: Path) -> dict:
    import yaml

    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), "--restart"], cwd=ROOT, capture_output=True, text=True
    )
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"specbatch run exited {done.returncode}:\n{done.stderr[-3000:]}")
    manifest = json.loads((Path(config["output_uri"]) / "_job.json").read_text())
    trial = manifest.get("trial") or {}
    return {
        "wall": wall,
        "tokens": manifest["totals"]["generated_tokens"],
        "trial": trial.get("reason"),
        "outcome": trial.get("outcome"),
        "starts": len(manifest["attempts"][-1]["start"]["engine_starts"]),
    }


def med(values: list[float]) -> str:
    return (
        f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
        if len(values) > 1
        else f"{values[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows4", type=int, default=800, help="rows of the 4-sequence job (128 tokens each)")
    parser.add_argument("--rows64", type=int, default=6000, help="rows of the 64-sequence job (64 tokens each)")
    parser.add_argument("--concurrency", default="4,64")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specbatch-trial-bench-"))
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        rows = args.rows4 if concurrency == 4 else args.rows64
        input_uri = build_input(work / f"in-{concurrency}", rows)
        walls: dict[str, list[float]] = {run: [] for run in RUNS}
        verdicts, starts = [], []
        for round_ in range(args.rounds):
            order = RUNS[round_ % 3 :] + RUNS[: round_ % 3]
            for run in order:
                folder = work / f"{concurrency}-{run}"
                folder.mkdir(exist_ok=True)
                result = run_job_process(config_for(run, concurrency, input_uri, str(folder / "out")), folder)
                walls[run].append(result["wall"])
                print(
                    f"  {concurrency} sequences, round {round_ + 1}, {run}: {result['wall']:.1f} s, "
                    f"{result['tokens']:,} tokens, {result['starts']} engine start(s)",
                    flush=True,
                )
                if run == "trial":
                    verdicts.append(result["trial"])
                    starts.append(result["starts"])
        print(
            f"\n== {concurrency} sequences at once, {rows:,} rows x {SETTINGS[concurrency]['max_tokens']} tokens, "
            f"{args.rounds} rounds: whole-process wall seconds, median (min-max)"
        )
        for run in RUNS:
            print(f"  {run:6s} {med(walls[run])}")
        for verdict, n in zip(verdicts, starts):
            print(f"  trial said: {verdict} ({n} engine starts)")
        best = min(statistics.median(walls["off"]), statistics.median(walls["k=3"]))
        ratio = statistics.median(walls["trial"]) / best
        print(
            f"  trial / the better of off and k=3: {ratio:.3f} ({'within' if ratio <= 1.05 else 'NOT within'} 5%)\n",
            flush=True,
        )


if __name__ == "__main__":
    main()
