"""Build the whole tiny model kit, deterministically, on a CPU:

  1. tokenizer: byte-level BPE (vocab 2048) on the stdlib's top-level *.py files (train split)
  2. target:    Llama, hidden 256, 4 layers, trained as a next-token LM on that corpus
  3. drafter-eagle31: EAGLE-3.1 (fc_norm + norm_output), trained on the target's aux states
                and greedy continuations, unrolled over several draft steps (training-time test)
  4. drafter-eagle3:  the same without the 3.1 switches, trained the same way
  5. drafter-mismatched: trained for ANOTHER target (2 layers, other seed; only its config
                and tokenizer are kept, in other-target/) -- for drafter-compatibility checks
  6. RECIPE.json: the recipe, its hash, training stats, build time

    python -m tinykit.build OUT [--seed 0] [--threads 2] [--smoke]

The committed kit (models/tinykit/) was made by this command with the defaults.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import corpus, layout
from .drafter import DrafterConfig, Eagle3Drafter
from .model import new_target, round_weights_, target_config
from .train import choose_draft_vocab, log, make_drafter_data, train_drafter, train_target

TARGET_NAME = "specbatch-tiny-stdlib-llama"
OTHER_TARGET_NAME = "specbatch-tiny-stdlib-llama-other"

RECIPE = {
    "kit_version": 1,
    "seed": 0,
    "store_dtype": "float16",
    "tokenizer": {"vocab_size": 2048},
    "target": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
        "max_position_embeddings": 1024,
        "train": {"steps": 300, "batch": 16, "seq": 256, "lr": 3e-3, "amp": "bfloat16"},
    },
    "drafter_data": {"n": 1024, "prompt_len": 64, "gen_len": 128, "topk": 16},
    "drafter": {
        "aux_layer_ids": [1, 2, 4],
        "draft_vocab_size": 1024,
        "train": {"steps": 250, "batch": 16, "lr": 2e-3, "ttt_steps": 3, "step_decay": 0.8, "amp": "bfloat16"},
    },
    "mismatched": {
        "target": {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 512,
            "max_position_embeddings": 1024,
            "train": {"steps": 60, "batch": 16, "seq": 256, "lr": 3e-3, "amp": "bfloat16"},
        },
        "drafter_data": {"n": 128, "prompt_len": 64, "gen_len": 64, "topk": 16},
        "drafter": {
            "aux_layer_ids": [0, 1, 2],
            "draft_vocab_size": 1024,
            "train": {"steps": 60, "batch": 16, "lr": 2e-3, "ttt_steps": 2, "step_decay": 0.8, "amp": "bfloat16"},
        },
    },
}


def smoke(recipe: dict) -> dict:
    """A seconds-long version of the recipe (same code path), for tests and CI."""
    r = copy.deepcopy(recipe)
    for t in (r["target"], r["mismatched"]["target"]):
        t["train"]["steps"] = 3
    for d in (r["drafter"], r["mismatched"]["drafter"]):
        d["train"]["steps"] = 3
    r["drafter_data"].update(n=8, gen_len=16)
    r["mismatched"]["drafter_data"].update(n=8, gen_len=16)
    return r


HERE = Path(__file__).parent
# The code the kit is built by; the fingerprint is the runtime's own (pipeline/fingerprint.py).
SOURCES = tuple(HERE / n for n in ("corpus.py", "model.py", "drafter.py", "train.py", "layout.py", "build.py")) + (
    HERE.parent / "pipeline" / "fingerprint.py",
)


def recipe_hash(recipe: dict, corpus_sha: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(recipe, sort_keys=True).encode())
    h.update(corpus_sha.encode())
    for path in SOURCES:
        h.update(path.name.encode())
        h.update(training_code(path).encode())
    return "sha256:" + h.hexdigest()


def training_code(path: Path) -> str:
    """What of a source can change the kit: its syntax tree without docstrings, comments,
    layout, and the command line (`main`, which only fills the recipe and the thread count,
    both recorded). Its form follows the Python version, as the stdlib corpus already does."""
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name == "main")]
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _target_cfg(spec: dict, tok):
    eos = tok.token_to_id(corpus.EOS)
    kw = {k: v for k, v in spec.items() if k != "train"}
    return target_config(vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos, **kw)


def _drafter(spec: dict, tcfg, eagle31: bool, seed: int, draft_ids: torch.Tensor) -> Eagle3Drafter:
    c = DrafterConfig(
        hidden_size=tcfg.hidden_size,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=tcfg.hidden_size // 4,
        rms_norm_eps=tcfg.rms_norm_eps,
        max_position_embeddings=tcfg.max_position_embeddings,
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=spec["draft_vocab_size"],
        target_hidden_size=tcfg.hidden_size,
        aux_layer_ids=tuple(spec["aux_layer_ids"]),
        fc_norm=eagle31,
        norm_output=eagle31,
        norm_before_residual=False,
    )
    torch.manual_seed(seed)
    d = Eagle3Drafter(c)
    d.set_draft_vocab(draft_ids)
    return d


def build(out_dir: str, recipe: dict, threads: int) -> dict:
    t_start = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(recipe["seed"])
    seed = recipe["seed"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = recipe["store_dtype"]
    stats: dict = {}

    # 1. corpus + tokenizer
    files = corpus.stdlib_files()
    train_files, held_files = corpus.split_files(files)
    tok = corpus.train_tokenizer(corpus.read_texts(train_files), recipe["tokenizer"]["vocab_size"])
    stream = torch.tensor([t for ids in corpus.encode_files(tok, corpus.read_texts(train_files)) for t in ids])
    held = torch.tensor([t for ids in corpus.encode_files(tok, corpus.read_texts(held_files)) for t in ids])
    desc = corpus.corpus_description(files)
    rhash = recipe_hash(recipe, desc["sha256"])
    log(
        f"corpus: {len(train_files)} train files ({stream.numel()} tokens), {len(held_files)} held out "
        f"({held.numel()} tokens); recipe {rhash[:19]}"
    )
    write_tok = lambda d, mpe: corpus.save_tokenizer(tok, d, mpe)  # noqa: E731

    # 2. target
    tcfg = _target_cfg(recipe["target"], tok)
    target = new_target(tcfg, seed)
    stats["target"] = train_target(target, stream, seed=seed, eval_stream=held, **recipe["target"]["train"])
    stats["target"]["params"] = sum(p.numel() for p in target.parameters())
    round_weights_(target, layout.DTYPES[store])  # the drafters are trained on what is saved
    tdir = layout.save_target(target, lambda d: write_tok(d, tcfg.max_position_embeddings), out / "target", store)
    stats["target"]["seconds"] = round(time.time() - t_start, 1)

    # 3.-4. drafters: same data, same seed, with and without the EAGLE-3.1 switches
    dd = recipe["drafter_data"]
    data = make_drafter_data(
        target,
        stream,
        n=dd["n"],
        prompt_len=dd["prompt_len"],
        gen_len=dd["gen_len"],
        aux_layer_ids=recipe["drafter"]["aux_layer_ids"],
        seed=seed + 1,
        topk=dd["topk"],
    )
    draft_ids, coverage = choose_draft_vocab(data, stream, recipe["drafter"]["draft_vocab_size"])
    stats["draft_vocab_coverage_of_greedy_predictions"] = round(coverage, 5)
    for name, eagle31 in (("drafter-eagle31", True), ("drafter-eagle3", False)):
        t0 = time.time()
        d = _drafter(recipe["drafter"], tcfg, eagle31, seed + 2, draft_ids)
        stats[name] = train_drafter(d, target.model.embed_tokens, data, seed=seed + 3, **recipe["drafter"]["train"])
        stats[name]["params"] = sum(p.numel() for p in d.parameters())
        round_weights_(d, layout.DTYPES[store])
        layout.save_drafter(
            d,
            out / name,
            tdir,
            TARGET_NAME,
            store,
            extra={"trained": True, "recipe_hash": rhash, "ttt_steps": recipe["drafter"]["train"]["ttt_steps"]},
        )
        stats[name]["seconds"] = round(time.time() - t0, 1)
    del data

    # 5. the mismatched drafter: trained for another target (config + tokenizer kept, not weights)
    t0 = time.time()
    m = recipe["mismatched"]
    ocfg = _target_cfg(m["target"], tok)
    other = new_target(ocfg, seed + 100)
    stats["other-target"] = train_target(other, stream, seed=seed + 100, **m["target"]["train"])
    round_weights_(other, layout.DTYPES[store])
    odir = out / "other-target"
    layout.save_target(other, lambda d: write_tok(d, ocfg.max_position_embeddings), odir, store)
    (odir / "model.safetensors").unlink()  # keep the kit small: config + tokenizer only
    (odir / "README.txt").write_text(
        "Config and tokenizer of the target drafter-mismatched was trained for; "
        "weights not kept (kit size). Rebuild with tinykit.build.\n"
    )
    od = m["drafter_data"]
    odata = make_drafter_data(
        other,
        stream,
        n=od["n"],
        prompt_len=od["prompt_len"],
        gen_len=od["gen_len"],
        aux_layer_ids=m["drafter"]["aux_layer_ids"],
        seed=seed + 101,
        topk=od["topk"],
    )
    oids, _ = choose_draft_vocab(odata, stream, m["drafter"]["draft_vocab_size"])
    d = _drafter(m["drafter"], ocfg, True, seed + 102, oids)
    stats["drafter-mismatched"] = train_drafter(
        d, other.model.embed_tokens, odata, seed=seed + 103, **m["drafter"]["train"]
    )
    round_weights_(d, layout.DTYPES[store])
    layout.save_drafter(
        d,
        out / "drafter-mismatched",
        odir,
        OTHER_TARGET_NAME,
        store,
        extra={"trained": True, "recipe_hash": rhash, "mismatched_on_purpose": True},
    )
    stats["drafter-mismatched"]["seconds"] = round(time.time() - t0, 1)

    seconds = round(time.time() - t_start, 1)
    manifest = {
        "recipe_hash": rhash,
        "recipe": recipe,
        "corpus": desc,
        "target_name": TARGET_NAME,
        "build": {
            "seconds": seconds,
            "threads": threads,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
        },
        "train_stats": stats,
        "files": {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()},
    }
    manifest["total_bytes"] = sum(manifest["files"].values())
    old = out / "RECIPE.json"
    if old.exists():  # keep figures measured for this very recipe
        prev = json.loads(old.read_text())
        if prev.get("recipe_hash") == rhash and "measured" in prev:
            manifest["measured"] = prev["measured"]
    old.write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"kit built in {seconds}s at {out} ({manifest['total_bytes'] / 1e6:.1f} MB)")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="specbatch tiny-models build",
        description=__doc__.split("\n\n")[0],
        epilog="example:\n  specbatch tiny-models build /tmp/kit --smoke      # seconds: the same code path, untrained",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("out", metavar="OUT", help="output directory (target/, drafter-*/, RECIPE.json)")
    ap.add_argument("--seed", type=int, default=RECIPE["seed"])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it)")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path")
    args = ap.parse_args(argv)
    recipe = copy.deepcopy(RECIPE)
    recipe["seed"] = args.seed
    if args.smoke:
        recipe = smoke(recipe)
    build(args.out, recipe, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
