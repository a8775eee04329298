"""Acceptance of the tiny kit's drafters, measured by vLLM's CPU build itself.

For each drafter (EAGLE-3.1, plain EAGLE-3; the mismatched one at k=3) and each k, one
engine: greedy (temperature 0, ignore_eos) generation of --max-tokens tokens for
  * held-out: 64-token windows of stdlib files never used in training, and
  * perturbed: the same kind of prompts (a) wrapped in the chat template with a system
    message, (b) with odd whitespace (tabs for indentation, trailing spaces, doubled
    blank lines), (c) after a long unrelated prefix (~512 tokens of another held-out file).
Reads vLLM's counters (vllm:spec_decode_num_drafts / _num_draft_tokens /
_num_accepted_tokens / _num_accepted_tokens_per_pos, differences around each generate
call): mean acceptance length = 1 + accepted / drafts, per-position rate = per_pos[i] / drafts.
Lossless: every output equals the output of the same target without a drafter.

    python benchmarks/tinykit_acceptance.py [--kit DIR] [--ks 1,2,3,4,5,6] [--write-manifest]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def make_prompts(tokenizer, n_heldout: int, n_perturbed: int, prompt_len: int, seed: int) -> dict:
    """{set name: list of token-id lists}. Held-out files only (every 10th stdlib file)."""
    from tinykit import corpus

    _, held_files = corpus.split_files(corpus.stdlib_files())
    rng = random.Random(seed)
    docs = [tokenizer.encode(t, add_special_tokens=False) for t in corpus.read_texts(held_files)]
    docs = [d for d in docs if len(d) > 4 * prompt_len]

    def window(exclude=None):
        i = rng.choice([j for j in range(len(docs)) if j != exclude])
        s = rng.randrange(0, len(docs[i]) - prompt_len)
        return i, docs[i][s : s + prompt_len]

    sets = {"held-out": [window()[1] for _ in range(n_heldout)]}
    chat, ws, prefix = [], [], []
    for _ in range(n_perturbed):
        _, w = window()
        text = tokenizer.decode(w)
        chat.append(
            tokenizer.apply_chat_template(
                [
                    {"role": "system", "content": "You are a careful Python assistant. Continue the code."},
                    {"role": "user", "content": text},
                ],
                add_generation_prompt=True,
                tokenize=False,
            )
        )
        lines = [ln.replace("    ", "\t") + "  " for ln in text.split("\n")]
        ws.append("\n".join(ln if ln.strip() else ln + "\n" for ln in lines))
        i, w2 = window()
        j, far = window(exclude=i)
        pre = docs[j][:512]
        prefix.append(tokenizer.decode(pre) + "\n\n" + tokenizer.decode(w2))
    sets["perturbed:chat-template"] = [tokenizer.encode(t, add_special_tokens=False) for t in chat]
    sets["perturbed:odd-whitespace"] = [tokenizer.encode(t, add_special_tokens=False) for t in ws]
    sets["perturbed:long-prefix"] = [tokenizer.encode(t, add_special_tokens=False) for t in prefix]
    return sets


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name] = out.get(m.name, 0) + m.value
        elif m.name == PER_POS:
            prev = out.get(m.name)
            out[m.name] = list(m.values) if prev is None else [a + b for a, b in zip(prev, m.values)]
    return out


def run_engine(target: str, drafter: str | None, k: int, sets: dict, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    spec = None if drafter is None else {"method": "eagle3", "model": drafter, "num_speculative_tokens": k}
    llm = LLM(
        model=target,
        speculative_config=spec,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        seed=0,
        disable_log_stats=False,
        enable_prefix_caching=False,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res = {}
    for name, prompts in sets.items():
        before = counters(llm)
        t0 = time.time()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dt = time.time() - t0
        after = counters(llm)
        r = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "seconds": dt,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        }
        if drafter is not None:
            drafts = after[SPEC_COUNTERS[0]] - before.get(SPEC_COUNTERS[0], 0)
            acc = after[SPEC_COUNTERS[2]] - before.get(SPEC_COUNTERS[2], 0)
            pp = [a - b for a, b in zip(after[PER_POS], before.get(PER_POS, [0] * k))]
            r.update(
                num_drafts=drafts,
                accepted=acc,
                per_pos=pp,
                mal=1 + acc / max(drafts, 1),
                per_pos_rate=[p / max(drafts, 1) for p in pp],
            )
        res[name] = r
    del llm
    gc.collect()
    return res


def main(argv=None) -> int:
    from tinykit import KIT_DIR, kit_paths

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kit", default=KIT_DIR)
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--perturbed", type=int, default=32, help="prompts per perturbation kind")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-mismatched", action="store_true")
    ap.add_argument("--write-manifest", action="store_true", help="store the figures in KIT/RECIPE.json")
    ap.add_argument("--json", help="also write all figures to this file")
    args = ap.parse_args(argv)
    ks = [int(x) for x in args.ks.split(",")]
    paths = kit_paths(args.kit)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["target"])
    sets = make_prompts(tok, args.heldout, args.perturbed, args.prompt_len, args.seed)
    t_all = time.time()
    base = run_engine(paths["target"], None, 0, sets, args.max_tokens)
    runs = []
    plan = [(v, k) for k in ks for v in ("eagle31", "eagle3")]
    if not args.no_mismatched:
        plan.append(("mismatched", 3))
    for variant, k in plan:
        res = run_engine(paths["target"], paths[f"drafter_{variant}"], k, sets, args.max_tokens)
        for name, r in res.items():
            same = sum(a == b for a, b in zip(r["outputs"], base[name]["outputs"]))
            runs.append(
                {
                    "drafter": variant,
                    "k": k,
                    "set": name,
                    "mal": r["mal"],
                    "per_pos_rate": r["per_pos_rate"],
                    "num_drafts": r["num_drafts"],
                    "lossless": f"{same}/{len(r['outputs'])}",
                    "tok_per_s": r["tokens"] / r["seconds"],
                }
            )
        # perturbed, pooled
        pert = [n for n in res if n.startswith("perturbed")]
        drafts = sum(res[n]["num_drafts"] for n in pert)
        pp = [sum(res[n]["per_pos"][i] for n in pert) for i in range(k)]
        runs.append(
            {
                "drafter": variant,
                "k": k,
                "set": "perturbed:all",
                "mal": 1 + sum(pp) / max(drafts, 1),
                "per_pos_rate": [p / max(drafts, 1) for p in pp],
                "num_drafts": drafts,
                "lossless": "",
                "tok_per_s": None,
            }
        )
        print_row(runs[-len(res) - 1 :], header=(len(runs) == len(res) + 1))

    base_tps = {n: base[n]["tokens"] / base[n]["seconds"] for n in base}
    print("\nno-drafter throughput (tok/s, warm, this CPU): " + ", ".join(f"{n} {v:.0f}" for n, v in base_tps.items()))
    print(f"benchmark wall time {time.time() - t_all:.0f}s")
    print("\n=== full table ===")
    print_row(runs, header=True)
    summary = {
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "heldout_prompts": args.heldout,
        "perturbed_prompts_per_kind": args.perturbed,
        "vllm": __import__("vllm").__version__,
        "rows": [
            {
                **r,
                "mal": round(r["mal"], 3),
                "per_pos_rate": [round(x, 3) for x in r["per_pos_rate"]],
                "tok_per_s": None if r["tok_per_s"] is None else round(r["tok_per_s"], 1),
            }
            for r in runs
        ],
        "no_drafter_tok_per_s": {n: round(v, 1) for n, v in base_tps.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.write_manifest:
        mf = Path(args.kit) / "RECIPE.json"
        m = json.loads(mf.read_text())
        m["measured"] = summary
        mf.write_text(json.dumps(m, indent=2) + "\n")
    ok = all(r["lossless"] in ("",) or r["lossless"].split("/")[0] == r["lossless"].split("/")[1] for r in runs)
    print("lossless:", "all outputs identical to the no-drafter outputs" if ok else "MISMATCH")
    return 0 if ok else 1


def print_row(rows, header=False):
    if header:
        print(
            f"{'drafter':<11}{'k':>2}  {'prompts':<25}{'mean acc len':>12}  "
            + " ".join(f"{'pos' + str(i + 1):>6}" for i in range(6))
            + f"  {'drafts':>6}  {'lossless':>8}"
        )
    for r in rows:
        pos = " ".join(f"{x:6.3f}" for x in r["per_pos_rate"]) + " " * 7 * (6 - len(r["per_pos_rate"]))
        print(
            f"{r['drafter']:<11}{r['k']:>2}  {r['set']:<25}{r['mal']:>12.3f}  {pos}  {r['num_drafts']:>6}  "
            f"{r['lossless']:>8}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
