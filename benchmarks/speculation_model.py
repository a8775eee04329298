"""Speculation's speedup as the policy predicts it, against the speedup measured, per workload.

The speculation policy (pipeline/speculation/policy.py) predicts a job's speedup over speculation
off from two things measured apart: a calibration's step costs (the hardware and engine settings)
and the job's own acceptance by draft position (its traffic). This checks that model on four
workloads that accept differently (code, question answering, a judge prompt, random words), at
two concurrencies. Both settings (off and k) run with the job's engine settings
(`pipeline.stages.engine.engine_kwargs`), a fresh engine process per setting and round, the
settings alternating (off, k, k, off, ...); a round measures every workload at every concurrency
once, engine warm. The calibration is one workload's rounds (question answering, or
--calibrate-on); every workload's speedup is predicted from those step costs and its own
acceptance, and printed beside its measured speedup: the median over the rounds with the spread
any pair of rounds allows, as the policy gives every speedup. Speeds are engine time (generated
tokens over the wall time of the generate call, engine warm; start excluded).

    python benchmarks/speculation_model.py [--rounds 3] [--prompts 64] [--max-tokens 64] [--concurrency 4,32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
WORKLOADS = ("code", "question answering", "judge", "random words")
WORDS = "apple river stone cloud seven orange table quickly under paper music green window far before little".split()


def sample_size(at_least: int, concurrency: int) -> int:
    """Prompts measured at a concurrency: enough for four waves, so a run is not its ramp and tail."""
    return max(at_least, 4 * concurrency)


def workload_prompts(n: int, seed: int) -> dict[str, list[str]]:
    """Prompts of each workload, from held-out stdlib files (the kit never trained on them)."""
    from tinykit import corpus

    _, held = corpus.split_files(corpus.stdlib_files())
    rng = random.Random(seed)
    lines = [ln for text in corpus.read_texts(held) for ln in text.splitlines() if 20 < len(ln.strip()) < 90]
    code = [ln for ln in lines if ln.lstrip().startswith(("def ", "class ", "for ", "if ", "return ", "import "))]
    prose = [ln.strip().lstrip("#").strip() for ln in lines if ln.strip().startswith("#")]

    def pick(pool: list[str], k: int) -> str:
        return "\n".join(rng.choice(pool) for _ in range(k))

    return {
        "code": [pick(code, 3) + "\n" for _ in range(n)],
        "question answering": [
            f"Passage: {pick(prose, 2)}\nQuestion: what does the passage say?\nAnswer:" for _ in range(n)
        ],
        "judge": [
            f"Question: {pick(prose, 1)}\nAnswer: {pick(code, 1)}\nIs the answer right? Reply yes or no:"
            for _ in range(n)
        ],
        "random words": [" ".join(rng.choice(WORDS) for _ in range(24)) for _ in range(n)],
    }


def config(depth: int, max_num_seqs: int, max_tokens: int):
    from pipeline.config import parse_config
    from tinykit import kit_paths

    kit = kit_paths()
    return parse_config(
        {
            "input_uri": "/tmp/unused-in",
            "output_uri": "/tmp/unused-out",
            "model": {"path": kit["target"]},
            "speculative": {
                "enabled": depth > 0,
                "drafter": kit["drafter_eagle31"],
                "num_speculative_tokens": depth or 3,
            },
            "engine": {"dtype": "float32", "max_model_len": 512, "max_num_seqs": max_num_seqs, "enforce_eager": True},
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        }
    )


def measure(request: dict) -> dict:
    """In a fresh process: one engine, each workload at each concurrency once, engine warm."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.speculation.measure import timed_runs
    from pipeline.stages.engine import engine_kwargs, prepare_process_env

    job = config(request["depth"], max(request["concurrencies"]), request["max_tokens"])
    prepare_process_env(job)
    llm = LLM(**engine_kwargs(job, speculative=request["depth"] > 0, num_speculative_tokens=request["depth"] or None))
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = {
        name: [TokensPrompt(prompt_token_ids=tokenizer.encode(p)) for p in texts]
        for name, texts in request["prompts"].items()
    }
    llm.generate(prompts["code"][:4], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    results = []
    for name, token_prompts in prompts.items():
        for concurrency in request["concurrencies"]:
            sample = token_prompts[: sample_size(request["prompts_at_least"], concurrency)]
            measured = timed_runs(llm, sample, [params] * len(sample), concurrency, repeats=1)
            results.append({**measured, "workload": name, "concurrency": concurrency})
    llm.llm_engine.engine_core.shutdown()
    return {"depth": request["depth"], "results": results}


def run_round(depth: int, prompts: dict, args: argparse.Namespace, workdir: Path) -> dict:
    request, result = workdir / "request.json", workdir / f"result-{depth}.json"
    payload = {
        "depth": depth,
        "prompts": prompts,
        "prompts_at_least": args.prompts,
        "concurrencies": args.concurrency,
        "max_tokens": args.max_tokens,
    }
    request.write_text(json.dumps(payload))
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(request), str(result)], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"the measuring process exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def calibration_of(runs: dict, workload: str, depth: int, concurrencies: list[int]):
    """The calibration the policy reads, made of one workload's rounds: every round's time kept."""
    from pipeline.tools.calibration_choice import calibration_rows
    from schemas.report import CalibrationReport

    measured = []
    for d in (0, depth):
        for c in concurrencies:
            rounds = [r for r in runs[d] if r["workload"] == workload and r["concurrency"] == c]
            seconds = [r["seconds"] for r in rounds]
            measured.append(
                {
                    **rounds[0],
                    "depth": d,
                    "seconds": statistics.median(seconds),
                    "seconds_runs": seconds,
                }
            )
    return CalibrationReport(
        config_uri="benchmark",
        measured_at=f"{workload} rounds",
        accelerator="cpu",
        gpus_per_replica=1,
        currency="USD",
        price_per_gpu_hour=None,
        max_num_seqs=max(concurrencies),
        sample_requested=0,
        sample_measured=0,
        concurrencies=concurrencies,
        rows=calibration_rows(measured, 1, None),
        recommended_depth=0,
        config_snippet="",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh engines per setting, alternating (default 3)")
    parser.add_argument(
        "--prompts", type=int, default=64, help="prompts per workload, at least 4 x the concurrency (default 64)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[4, 32])
    parser.add_argument("--calibrate-on", default="question answering", choices=WORKLOADS)
    parser.add_argument("--save", help="write every round's figures to this JSON file")
    parser.add_argument("--load", help="print the table from a file --save wrote, measuring nothing")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.child[1]).write_text(json.dumps(measure(json.loads(Path(args.child[0]).read_text()))))
        return

    from pipeline.speculation.speedup import Speedup, Traffic, costs_from, predict
    from pipeline.stages.stats import Acceptance

    if args.load:
        runs = {int(depth): rounds for depth, rounds in json.loads(Path(args.load).read_text()).items()}
    else:
        prompts = workload_prompts(max(sample_size(args.prompts, c) for c in args.concurrency), seed=0)
        runs = {0: [], args.depth: []}
        with tempfile.TemporaryDirectory(prefix="speculation-model-") as workdir:
            for n in range(args.rounds):
                for depth in (0, args.depth) if n % 2 == 0 else (args.depth, 0):
                    print(f"[round {n + 1}/{args.rounds}] depth {depth} ...", file=sys.stderr, flush=True)
                    runs[depth] += run_round(depth, prompts, args, Path(workdir))["results"]
        if args.save:
            Path(args.save).write_text(json.dumps(runs))
    calibration = calibration_of(runs, args.calibrate_on, args.depth, args.concurrency)
    print(
        f"depth {args.depth}, {args.prompts} prompts x {args.max_tokens} tokens per workload, {args.rounds} rounds; "
        f"calibration: the {args.calibrate_on} rounds\n"
    )
    header = "| workload | concurrency | mean acceptance length | predicted | measured | error |"
    print(header + "\n|---|---:|---:|---:|---:|---:|")
    errors = []
    for workload in WORKLOADS:
        for c in args.concurrency:
            pick = lambda d: [r for r in runs[d] if r["workload"] == workload and r["concurrency"] == c]  # noqa: E731
            spec, off = pick(args.depth), pick(0)
            acceptance = Acceptance(
                spec[0]["num_drafts"],
                spec[0]["draft_tokens"],
                spec[0]["accepted_tokens"],
                spec[0]["accepted_per_position"],
            )
            measured = Speedup.of_rates(
                [r["generated_tokens"] / r["seconds"] for r in spec],
                [r["generated_tokens"] / r["seconds"] for r in off],
            )
            costs = costs_from(calibration, args.depth, c)
            generated, completions = spec[0]["generated_tokens"], spec[0]["completions"]
            traffic = Traffic(acceptance.rate_per_position, workload, (generated - completions) / acceptance.num_drafts)
            predicted = predict(costs, traffic)
            error = predicted.median / measured.median - 1
            inside = measured.low <= predicted.median <= measured.high
            own = " (the calibration's own)" if workload == args.calibrate_on else ""
            if not own:
                errors.append(abs(error))
            print(
                f"| {workload}{own} | {c} | {traffic.length(args.depth):.2f} | "
                f"{predicted.median:.2f}x ({predicted.spread}) | {measured.median:.2f}x ({measured.spread}) | "
                f"{error:+.1%}{'' if inside else ' (outside the measured spread)'} |"
            )
    print(
        f"\nmedian absolute error of the predicted workloads: {statistics.median(errors):.1%}; "
        f"largest: {max(errors):.1%}"
    )


if __name__ == "__main__":
    main()
