"""Speculative-decoding acceptance and tokens/s with and without grammar-constrained output,
on the tiny kit (target + EAGLE-3.1 drafter, k=3), greedy, the same prompts, the same engine:

    python benchmarks/structured_acceptance.py [--prompts 128] [--max-tokens 64] [--rounds 3]

1. Two engines from `engine_kwargs(load_config("jobs/configs/local.yaml"))` (fp32, eager, k=3,
   per-request spec-decode metrics): `spec` with the drafter, `base` without it (the same
   kwargs with speculative=False). Both engines set `structured_outputs_config=
   {"backend": "xgrammar", "disable_any_whitespace": True}` (the flag needs a named backend):
   vLLM 0.32's xgrammar backend reads that flag from the engine only
   (`vllm/v1/structured_output/backend_xgrammar.py`), the per-request field is ignored, and with
   free whitespace the kit fills JSON with runs of spaces.
2. Conditions (vllm.sampling_params.StructuredOutputsParams): none, a JSON schema, a choice
   list, a tight regex (a call `name(args)`) and a loose one (three indented lines, what the
   kit writes anyway). Each is run once on both engines to warm up (grammar compilation is
   cached per grammar), then in rounds, conditions alternating (A B C D E A B C D E ...) and
   the engine order flipping every round, so machine noise is shared.
3. Figures per condition: acceptance from the per-request metrics (pipeline/stages/stats.py
   Acceptance, summed over rounds): mean acceptance length 1 + accepted / drafts, acceptance
   rate accepted / draft tokens, per position; "drafted/step": draft tokens verified per
   drafting step (vLLM cuts a draft at its first grammar-invalid token before verification and
   does not count the cut tokens, nor steps whose draft was cut to nothing); "tok/step":
   generated / (generated - accepted) = tokens per target forward pass, every step counted.
   tok/s = generated tokens / seconds of LLM.generate, median over rounds.
4. Lossless: greedy output with the drafter equals the output without it, per condition; and
   constrained outputs that stopped (not cut by max_tokens) satisfy their constraint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CHOICES = ["return None", "return self", "raise ValueError", "pass"]
REGEX_CALL = r"[a-z_]+\([a-z_, ]*\)"
REGEX_LINES = r"(\n {4,8}[^\n]+){3}"
CONDITIONS = {  # name: StructuredOutputsParams kwargs (None: unconstrained)
    "none": None,
    "json": {"json": SCHEMA},
    "choice": {"choice": CHOICES},
    "regex-call": {"regex": REGEX_CALL},
    "regex-lines": {"regex": REGEX_LINES},
}


def satisfies(name: str, text: str) -> bool:
    if name == "json":
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return (
            set(obj) == {"name", "age", "tags"}
            and isinstance(obj["name"], str)
            and isinstance(obj["age"], int)
            and all(isinstance(t, str) for t in obj["tags"])
        )
    if name == "choice":
        return text in CHOICES
    if name == "regex-call":
        return re.fullmatch(REGEX_CALL, text) is not None
    if name == "regex-lines":
        return re.fullmatch(REGEX_LINES, text) is not None
    return True


def run(llm, prompts, params) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "outputs": [o.outputs[0] for o in outs]}


def tokens_per_second(r: dict) -> float:
    """Generated tokens / seconds of one `run`."""
    return sum(len(o.token_ids) for o in r["outputs"]) / r["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "jobs/configs/local.yaml"))
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from pipeline.config import load_config
    from pipeline.stages.engine import engine_kwargs
    from pipeline.stages.stats import Acceptance
    from pipeline.tools.demo import sample_prompts

    config = load_config(args.config)
    so_engine = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    spec_kwargs = {**engine_kwargs(config), **so_engine}
    base_kwargs = {**engine_kwargs(config, speculative=False), **so_engine}
    k = spec_kwargs["speculative_config"]["num_speculative_tokens"]
    print(f"vLLM {vllm.__version__}, {platform.node()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    print(
        f"drafter {spec_kwargs['speculative_config']['model']} (k={k}), dtype {spec_kwargs['dtype']}, "
        f"eager {spec_kwargs['enforce_eager']}, max_num_seqs {spec_kwargs['max_num_seqs']}"
    )
    engines = {"spec": LLM(**spec_kwargs), "base": LLM(**base_kwargs)}

    prompts = sample_prompts(args.prompts, args.seed)
    params = {
        name: SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            structured_outputs=None if so is None else StructuredOutputsParams(**so),
        )
        for name, so in CONDITIONS.items()
    }
    for name in CONDITIONS:  # warm-up: grammar compilation, first-batch costs
        for llm in engines.values():
            run(llm, prompts[:8], params[name])

    results = {(name, e): [] for name in CONDITIONS for e in engines}
    order = list(engines)
    for rnd in range(args.rounds):
        for name in CONDITIONS:
            for e in order if rnd % 2 == 0 else order[::-1]:
                r = run(engines[e], prompts, params[name])
                results[(name, e)].append(r)
        print(
            f"round {rnd + 1}: "
            + ", ".join(f"{n} {tokens_per_second(results[(n, 'spec')][-1]):,.0f}" for n in CONDITIONS)
            + " tok/s (spec)",
            flush=True,
        )

    def tok_s(name, e):
        return statistics.median(tokens_per_second(r) for r in results[(name, e)])

    rows = {}
    for name in CONDITIONS:
        spec_runs, base_runs = results[(name, "spec")], results[(name, "base")]
        acc = Acceptance()
        for r in spec_runs:
            for o in r["outputs"]:
                acc = acc + Acceptance.from_request(o.spec_decode_metrics)
        first = spec_runs[0]["outputs"]
        generated = sum(len(o.token_ids) for o in first)
        generated_all = sum(len(o.token_ids) for r in spec_runs for o in r["outputs"])
        same = sum(list(a.token_ids) == list(b.token_ids) for a, b in zip(first, base_runs[0]["outputs"]))
        stable = all(
            [list(o.token_ids) for o in r["outputs"]] == [list(o.token_ids) for o in first]
            for r in spec_runs + base_runs[:1]
        )  # every spec round equals round 1 (which equals base)
        stopped = [o for o in first if o.finish_reason == "stop"]
        rows[name] = dict(
            rows=len(first),
            generated=generated,
            stopped=len(stopped),
            valid=sum(satisfies(name, o.text) for o in stopped),
            mal=acc.mean_acceptance_length,
            rate=acc.acceptance_rate,
            per_pos=acc.rate_per_position,
            drafted_per_step=acc.draft_tokens / acc.num_drafts if acc.num_drafts else None,
            tok_per_step=generated_all / (generated_all - acc.accepted_tokens),
            spec_tps=tok_s(name, "spec"),
            base_tps=tok_s(name, "base"),
            lossless=f"{same}/{len(first)}",
            stable=stable,
        )

    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    ref = rows["none"]["spec_tps"]
    print(
        f"\n{args.prompts} prompts x max {args.max_tokens} tokens, greedy, k={k}, {args.rounds} rounds (tok/s: median)"
    )
    print(
        f"{'condition':<12}{'rows':>5}{'gen tok':>8}{'stopped':>8}{'MAL':>6}{'acc rate':>9}  {'per position':<16}"
        f"{'drafted/step':>13}{'tok/step':>9}{'spec tok/s':>11}{'x none':>7}"
        f"{'base tok/s':>11}{'spec/base':>10}{'lossless':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<12}{r['rows']:>5}{r['generated']:>8}{r['stopped']:>8}"
            f"{fmt(r['mal'], '.2f'):>6}{fmt(r['rate'], '.3f'):>9}  "
            f"{' '.join(format(x, '.2f') for x in r['per_pos']):<16}{fmt(r['drafted_per_step'], '.2f'):>13}"
            f"{r['tok_per_step']:>9.2f}{r['spec_tps']:>11,.0f}{r['spec_tps'] / ref:>7.2f}{r['base_tps']:>11,.0f}"
            f"{r['spec_tps'] / r['base_tps']:>10.2f}{r['lossless']:>9}"
        )
    print(
        "constraint satisfied by the outputs that stopped (round 1): "
        + ", ".join(f"{n} {r['valid']}/{r['stopped']}" for n, r in rows.items() if n != "none")
    )
    ok = all(r["lossless"] == f"{r['rows']}/{r['rows']}" and r["stable"] for r in rows.values())
    print(
        "lossless: "
        + (
            "greedy output with the drafter equals the output without it under every condition, "
            "and every round repeated round 1"
            if ok
            else "MISMATCH: " + ", ".join(f"{n} {r['lossless']} stable={r['stable']}" for n, r in rows.items())
        )
    )


if __name__ == "__main__":
    main()
