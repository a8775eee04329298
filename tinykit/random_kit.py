"""A random (untrained) kit in seconds: the real tokenizer, a random Llama target and a
random EAGLE-3.1 drafter, in exactly the layout of the trained kit (layout.py).

With ``zero_lm_head=True`` the lm_head of target and drafter are zero: both always pick
token 0, so every draft is accepted (acceptance 100 %, mean acceptance length k + 1).
A random drafter otherwise accepts (almost) nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import corpus, layout
from .drafter import DrafterConfig, Eagle3Drafter
from .model import new_target, target_config

AUX_LAYER_IDS = (1, 2, 4)


def build_random_kit(out_dir: str, *, zero_lm_head: bool = False, eagle31: bool = True, seed: int = 0) -> dict:
    out = Path(out_dir)
    train_files, _ = corpus.split_files(corpus.stdlib_files())
    tok = corpus.train_tokenizer(corpus.read_texts(train_files), vocab_size=2048)
    eos = tok.token_to_id(corpus.EOS)
    cfg = target_config(vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos)
    target = new_target(cfg, seed)
    dcfg = DrafterConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        target_hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        draft_vocab_size=min(1024, cfg.vocab_size),
        aux_layer_ids=AUX_LAYER_IDS,
        fc_norm=eagle31,
        norm_output=eagle31,
    )
    torch.manual_seed(seed + 1)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_draft_vocab(torch.arange(dcfg.draft_vocab_size))  # identity on the first ids
    if zero_lm_head:
        with torch.no_grad():
            target.lm_head.weight.zero_()
            drafter.lm_head.weight.zero_()
    name = f"specbatch-tiny-random-target-seed{seed}" + ("-zero-lm-head" if zero_lm_head else "")
    tdir = layout.save_target(
        target,
        lambda d: corpus.save_tokenizer(tok, d, cfg.max_position_embeddings),
        out / "target",
        store_dtype="float32",
    )
    ddir = layout.save_drafter(
        drafter,
        out / "drafter",
        tdir,
        name,
        store_dtype="float32",
        extra={"trained": False, "seed": seed, "zero_lm_head": zero_lm_head},
    )
    return {"target": tdir, "drafter": ddir}
