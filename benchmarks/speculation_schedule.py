"""Whole-job tokens/s with speculation off, at the best static depth and with the calibrated
depth schedule, on a job with a realistic tail, side by side in one run (issue 13, "Benchmark"):

    python benchmarks/speculation_schedule.py [--rows 512] [--rounds 2] [--quick]

1. The input: `--rows` prompts (pipeline.tools.demo.sample_prompts) in one Parquet file with a
   per-row `max_tokens`: a random (seeded) `--long-fraction` of the rows (default 20%) get
   `--long-tokens` (128), the rest `--short-tokens` (16). The long rows keep the engine busy at
   falling concurrency once the short ones are done: the tail of an offline job.
2. The job config: the trained tiny kit (target + EAGLE-3.1 drafter), fp32, eager,
   max_model_len 512, greedy; the drafter probe and the acceptance guard are off, so that the
   three runs differ in the speculation depth only.
3. `specbatch calibrate` on the job's own prompts (depth x concurrency); its table is printed.
4. The job, run three ways with `run_job` in this process (one local Ray), each into its own
   output folder: (a) speculation off, (b) the best static depth (calibration's
   recommended_depth; when that is 0, (b) is (a) again and (b') the best depth > 0 at the
   highest concurrency is run as well), (c) the calibrated schedule (speculative.depth_schedule).
   The order alternates over `--rounds` (a b c, then c b a, ...) so that drift on a shared
   machine hits every run; the median over rounds is reported.
5. Figures per run: whole-job tokens/s (generated tokens / wall seconds of run_job, engine
   start included), tokens/s without the start (first unit entering the engine to the last
   commit), and "where each one wins": the steady part (until the last unit enters the engine)
   and the tail (from then on: nothing new arrives, the engine drains). Units overlap in the
   engine, so a unit's tokens are shared between the two parts in proportion to its time in
   each (an approximation: it assumes a unit generates at an even rate).

Ray workers' logs (vLLM's) stay in /tmp/ray/session_latest/logs unless --worker-logs. No
assertion on the figures: the target, (c) >= max((a), (b)) in whole-job tokens/s, is printed
as met or not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    VLLM_CPU_KVCACHE_SPACE="1",
    VLLM_HOST_IP="127.0.0.1",
    TOKENIZERS_PARALLELISM="false",
    RAY_DATA_DISABLE_PROGRESS_BARS="1",
)
# The calibration's measuring processes run `python -m pipeline.tools.calibrate`: make sure they
# import this checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

B_PRIME = "b'"  # the extra row: the best depth > 0, when the best static depth is 0


# ---------------------------------------------------------------- the job


def build_input(folder: Path, n: int, seed: int, short: int, long: int, long_fraction: float) -> set[str]:
    """prompts.parquet with id, prompt, max_tokens; returns the ids of the long rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.tools.demo import sample_prompts

    prompts = sample_prompts(n, seed)
    ids = [f"row-{i:05d}" for i in range(n)]
    long_rows = set(random.Random(seed).sample(range(n), round(n * long_fraction)))
    max_tokens = [long if i in long_rows else short for i in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({"id": ids, "prompt": prompts, "max_tokens": pa.array(max_tokens, pa.int64())}),
        folder / "prompts.parquet",
    )
    return {ids[i] for i in long_rows}


def job_config(input_uri: str, output_uri: str, args: argparse.Namespace) -> dict:
    """Like tests/conftest.py `job_config`, on the trained kit at this benchmark's settings."""
    from tinykit import kit_paths

    kit = kit_paths()
    return {
        "job_name": "speculation-schedule-bench",
        "input_uri": input_uri,
        "output_uri": output_uri,
        "model": {"path": kit["target"]},
        "speculative": {
            "enabled": True,
            "drafter": kit["drafter_eagle31"],
            "num_speculative_tokens": 3,
            "probe": {"rows": 0},
            "guard": None,
        },
        "engine": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": args.max_num_seqs, "enforce_eager": True},
        "sampling": {"max_tokens": args.short_tokens, "temperature": 0.0, "ignore_eos": args.ignore_eos},
        "resources": {"replicas": 1, "rows_per_unit": args.rows_per_unit, "units_in_flight": 2},
    }


def with_speculation(config: dict, output_uri: str, speculative: dict) -> dict:
    spec = {k: v for k, v in config["speculative"].items() if k not in ("num_speculative_tokens", "depth_schedule")}
    return {**config, "output_uri": output_uri, "speculative": {**spec, **speculative}}


# ---------------------------------------------------------------- calibration


def calibrate(config_path: Path, out: Path, args: argparse.Namespace):
    from pipeline.tools import calibrate as calibration
    from schemas.report import CalibrationReport

    argv = [
        str(config_path),
        "--sample",
        str(args.sample),
        "--depths",
        args.depths,
        "--concurrency",
        args.concurrency,
        "--repeats",
        str(args.repeats),
        "--job-check",
        str(args.job_check),
        "--out",
        str(out),
    ]
    printed = io.StringIO()  # its wide table; the short one below is what matters here
    started = time.time()
    with contextlib.redirect_stdout(printed):
        code = calibration.main(argv)
    if code != 0:
        raise SystemExit(f"specbatch calibrate {' '.join(argv)} exited {code}:\n{printed.getvalue()}")
    report = CalibrationReport.model_validate_json((out / "calibration.json").read_text())
    return report, time.time() - started


def print_calibration(report, seconds: float) -> None:
    depths = sorted({r.depth for r in report.rows if not r.schedule}) + (
        ["schedule"] if report.schedule_candidate else []
    )
    cell = {("schedule" if r.schedule else r.depth, r.concurrency): r for r in report.rows}
    print(
        f"\ncalibration ({seconds:.0f} s): {report.sample_measured} of the job's prompts, tokens/s by depth x "
        "concurrency (x vs off; * best at that concurrency; MAL = mean acceptance length)"
    )
    print(f"{'depth':<8}" + "".join(f"{'conc ' + str(c):>22}" for c in report.concurrencies))
    for d in depths:
        line = f"{'off' if d == 0 else d:<8}"
        for c in report.concurrencies:
            r = cell.get((d, c))
            if r is None:
                line += f"{'-':>22}"
                continue
            text = f"{r.tokens_per_second:,.0f}"
            if d != 0:
                text += f" {r.speedup_vs_off:.2f}x" if r.speedup_vs_off is not None else ""
                text += f" MAL {r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else ""
            line += f"{text + (' *' if r.recommended else '  '):>22}"
        print(line)
    print(
        f"recommended_depth {report.recommended_depth} (best at concurrency {report.concurrencies[-1]}); "
        f"schedule candidate {report.schedule_candidate}, recommended_schedule {report.recommended_schedule}"
    )
    for row in report.job_check:
        print(
            f"job check (through the job, start excluded): {row.setting:<32} {row.tokens_per_second:9,.1f} tok/s"
            + ("  <- recommended" if row.chosen else "")
        )
    for warning in report.warnings:
        print(f"calibration warning: {warning}")


def best_positive_depth(report) -> int | None:
    top = max(r.concurrency for r in report.rows)
    rows = [r for r in report.rows if r.concurrency == top and r.depth > 0]
    return max(rows, key=lambda r: (r.tokens_per_second, -r.depth)).depth if rows else None


# ---------------------------------------------------------------- one run and its figures


def run_once(config: dict) -> dict:
    from pipeline.commit.outputs import OutputLocation
    from pipeline.config import parse_config
    from pipeline.job.runner import run_job
    from pipeline.storage import Storage

    parsed = parse_config(config)
    started = time.time()
    manifest = run_job(parsed, progress=False)
    done = time.time()
    location = OutputLocation(Storage(), config["output_uri"])
    stats = location.read_table("stats").to_pylist()
    outputs = location.read_table("outputs", ["id", "text", "generated_tokens"]).to_pylist()
    t = manifest.totals
    units = [
        (
            s["started_at"],
            s["started_at"] + s["engine_seconds"],
            s["started_at"] + s["wall_seconds"],
            s["generated_tokens"],
        )
        for s in stats
    ]
    first_start = min(u[0] for u in units)
    last_start = max(u[0] for u in units)
    last_commit = max(u[2] for u in units)
    tail_tokens = sum(tok * overlap(s, e, last_start, e) / (e - s) if e > s else 0 for s, e, _, tok in units)
    steady_tokens = t.generated_tokens - tail_tokens
    return {
        "status": manifest.status,
        "rows": t.output_rows,
        "errors": t.error_rows,
        "tokens": t.generated_tokens,
        "wall": done - started,
        "start_cost": first_start - started,
        "work_seconds": last_commit - first_start,
        "steady_seconds": last_start - first_start,
        "steady_tokens": steady_tokens,
        "tail_seconds": last_commit - last_start,
        "tail_tokens": tail_tokens,
        "units": len(stats),
        "num_drafts": t.num_drafts,
        "mal": t.mean_acceptance_length,
        "schedule": sorted({str(s["depth_schedule"]) for s in stats if s["depth_schedule"]}),
        "texts": {o["id"]: o["text"] for o in outputs},
        "lengths": {o["id"]: o["generated_tokens"] for o in outputs},
    }


def overlap(s: float, e: float, a: float, b: float) -> float:
    return max(0.0, min(e, b) - max(s, a))


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def figures(r: dict) -> dict:
    return {
        "whole": rate(r["tokens"], r["wall"]),
        "no_start": rate(r["tokens"], r["work_seconds"]),
        "steady": rate(r["steady_tokens"], r["steady_seconds"]),
        "tail": rate(r["tail_tokens"], r["tail_seconds"]),
    }


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, help="input rows (default 512; --quick: 128)")
    parser.add_argument(
        "--rounds", type=int, help="rounds of the three runs, order alternating (default 2; --quick: 1)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="128 rows, 1 round, 32 rows per unit, calibration sample 64"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--long-fraction", type=float, default=0.2)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="rows always run to their max_tokens (default: they may stop at EOS)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rows-per-unit", type=int, help="default 128; --quick: 32")
    parser.add_argument("--sample", type=int, help="calibration prompts (default 128; --quick: 64)")
    parser.add_argument("--depths", default="0,1,2,3")
    parser.add_argument("--concurrency", default="1,4,16,max")
    parser.add_argument("--repeats", type=int, default=1, help="calibration repeats per depth and concurrency")
    parser.add_argument(
        "--job-check",
        type=int,
        default=256,
        help="rows calibrate runs through the job to choose between off, depth and schedule (default 256)",
    )
    parser.add_argument("--workdir", help="default: a new temporary folder")
    parser.add_argument(
        "--worker-logs",
        action="store_true",
        help="show the Ray workers' (vLLM's) logs here; by default they stay in /tmp/ray/session_latest/logs",
    )
    args = parser.parse_args()
    quick = args.quick
    args.rows = args.rows or (128 if quick else 512)
    args.rounds = args.rounds or (1 if quick else 2)
    args.rows_per_unit = args.rows_per_unit or (32 if quick else 128)
    args.sample = args.sample or (64 if quick else 128)

    import ray
    import yaml

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        _node_ip_address="127.0.0.1",
        log_to_driver=args.worker_logs,
    )
    began = time.time()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="specbatch-schedule-"))
    long_ids = build_input(
        workdir / "in", args.rows, args.seed, args.short_tokens, args.long_tokens, args.long_fraction
    )
    base = job_config(str(workdir / "in"), str(workdir / "out-calibration-job"), args)
    config_path = workdir / "job.yaml"
    config_path.write_text(yaml.safe_dump(base, sort_keys=False))
    print(
        f"{args.rows} rows: {len(long_ids)} with max_tokens {args.long_tokens}, the rest {args.short_tokens}; "
        f"max_num_seqs {args.max_num_seqs}, {args.rows_per_unit} rows per unit x 2 in flight; workdir {workdir}",
        flush=True,
    )

    report, calibration_seconds = calibrate(config_path, workdir / "calibration", args)
    print_calibration(report, calibration_seconds)

    runs: dict[str, tuple[str, dict]] = {"a": ("(a) speculation off", {"enabled": False})}
    from pipeline.stages.engine import schedule_text
    from pipeline.tools.calibration_choice import best_depths

    depth = best_depths(report.rows)[max(report.concurrencies)]  # the sweep's best static depth (vLLM alone)
    if depth == 0:
        print(
            "\nthe best static depth at the highest concurrency is 0 (off): (b) is (a) again, run as enabled false "
            "(the a/b difference shows the noise)"
        )
        runs["b"] = ("(b) best static depth: off", {"enabled": False})
        extra = best_positive_depth(report)
        if extra:
            print(f"(b') the best depth > 0 at the highest concurrency, {extra}, runs as an extra row")
            runs[B_PRIME] = (f"(b') static depth {extra}", {"enabled": True, "num_speculative_tokens": extra})
    else:
        runs["b"] = (f"(b) best static depth {depth}", {"enabled": True, "num_speculative_tokens": depth})
    # (c): what calibration recommends after its job check: the schedule, a single depth, or off.
    schedule = report.recommended_schedule
    if schedule:
        runs["c"] = (
            f"(c) calibrated: schedule {schedule_text(schedule)}",
            {"enabled": True, "depth_schedule": [list(r) for r in schedule]},
        )
    elif report.recommended_depth:
        runs["c"] = (
            f"(c) calibrated: depth {report.recommended_depth}",
            {"enabled": True, "num_speculative_tokens": report.recommended_depth},
        )
    else:
        runs["c"] = ("(c) calibrated: off", {"enabled": False})
    print(f"\n{runs['c'][0]} (schedule candidate {report.schedule_candidate})")

    results: dict[str, list[dict]] = {key: [] for key in runs}
    order = list(runs)
    for rnd in range(args.rounds):
        for key in order if rnd % 2 == 0 else order[::-1]:
            label, spec = runs[key]
            out = workdir / f"out-{key.replace(B_PRIME, 'b-prime')}-round{rnd + 1}"
            r = run_once(with_speculation(base, str(out), spec))
            results[key].append(r)
            f = figures(r)
            print(
                f"round {rnd + 1} {label:<36} {r['status']:<10} {r['tokens']:>7} tokens in {r['wall']:6.1f} s = "
                f"{f['whole']:7,.1f} tok/s whole job; {f['no_start']:7,.1f} without the {r['start_cost']:.1f} s start"
                + (f"; MAL {r['mal']:.2f}" if r["mal"] is not None else ""),
                flush=True,
            )

    # ---- summary
    reference = results["a"][0]
    print(
        f"\n{'run (median over ' + str(args.rounds) + ' rounds)':<44}{'whole tok/s':>12}{'start s':>9}{'no start':>10}"
        f"{'steady tok/s':>14}{'tail tok/s':>12}{'tail s':>8}{'drafts':>9}{'MAL':>6}"
    )
    medians = {}
    for key, (label, _) in runs.items():
        figs = [figures(r) for r in results[key]]
        m = {name: statistics.median(f[name] for f in figs) for name in figs[0]}
        m["tail_seconds"] = statistics.median(r["tail_seconds"] for r in results[key])
        m["start_cost"] = statistics.median(r["start_cost"] for r in results[key])
        medians[key] = m
        last = results[key][-1]
        mal = f"{last['mal']:.2f}" if last["mal"] is not None else "-"
        print(
            f"{label:<44}{m['whole']:>12,.1f}{m['start_cost']:>9.1f}{m['no_start']:>10,.1f}{m['steady']:>14,.1f}{m['tail']:>12,.1f}"
            f"{m['tail_seconds']:>8.1f}{last['num_drafts']:>9}{mal:>6}"
        )
    share = statistics.median(r["start_cost"] / r["wall"] for rs in results.values() for r in rs)
    print(
        f"the start (run_job called -> first unit in the engine: Ray Data, engine and drafter load) is {share:.0%} "
        "of a run's wall time (median)"
    )
    print(
        "per run, whole-job tok/s: "
        + "; ".join(f"{key}: " + ", ".join(f"{figures(r)['whole']:,.1f}" for r in results[key]) for key in runs)
    )

    lengths = reference["lengths"]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print(
        f"generated tokens per row in (a): long rows {mean([lengths[i] for i in long_ids if i in lengths]):.1f} "
        f"(max_tokens {args.long_tokens}), short rows {mean([v for i, v in lengths.items() if i not in long_ids]):.1f} "
        f"(max_tokens {args.short_tokens})"
    )
    for key in runs:
        for r in results[key]:
            if r["status"] != "succeeded" or r["rows"] != args.rows:
                print(f"note: {runs[key][0]}: status {r['status']}, {r['rows']} output rows, {r['errors']} errors")
    if "c" in results and schedule:
        print(f"schedule recorded in the stats of (c): {results['c'][0]['schedule']}")
    differ = {
        key: sum(r["texts"].get(i) != t for i, t in reference["texts"].items())
        for key in runs
        for r in results[key][:1]
    }
    print("greedy outputs differing from (a) round 1, rows: " + ", ".join(f"{k} {v}" for k, v in differ.items()))

    print("\nwhere each one wins (median tok/s):")
    for part, name in (
        ("steady", "steady part (until the last unit enters the engine)"),
        ("tail", "tail (the engine drains)"),
        ("whole", "whole job"),
    ):
        best = max(medians, key=lambda k: medians[k][part])
        print(f"  {name:<52} " + "  ".join(f"{k} {medians[k][part]:,.1f}" for k in medians) + f"   -> {best}")
    a, b, c = medians["a"]["whole"], medians["b"]["whole"], medians["c"]["whole"]
    print(
        f"(c)/(a) {c / a:.3f}   (c)/(b) {c / b:.3f}"
        + (f"   (c)/(b') {c / medians[B_PRIME]['whole']:.3f}" if B_PRIME in medians else "")
    )
    same = [k for k in ("a", "b") if runs[k][1] == runs["c"][1]]
    if same:
        print(
            f"(c) is the same setting as {' and '.join(f'({k})' for k in same)}: calibration chose it; "
            "their difference is run-to-run noise"
        )
    met = c >= max(a, b)
    print(
        f"target (c) >= max((a), (b)) in whole-job tokens/s: {'met' if met else 'NOT met'}"
        + (
            f"; against (b') too: {'met' if c >= medians[B_PRIME]['whole'] else 'NOT met'}"
            if B_PRIME in medians
            else ""
        )
    )
    print(f"benchmark wall time {time.time() - began:.0f} s")
    ray.shutdown()


if __name__ == "__main__":
    main()
