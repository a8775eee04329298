"""Saving in the layout vLLM loads (one definition, used by the random and trained kits).

target/   HF Llama dir: config.json, model.safetensors, generation_config.json, tokenizer files.
drafter/  EAGLE-3 dir (plain vLLM format, architecture LlamaForCausalLMEagle3):
          config.json with eagle_config.eagle_aux_hidden_state_layer_ids, fc_norm /
          norm_output (3.1 switches), norm_before_residual set explicitly, and
          ``specbatch_target`` = {name, config_fingerprint}; model.safetensors with fc,
          fc_norm.*, midlayer.*, norm, lm_head, d2t, t2d (no embed_tokens: vLLM shares the
          target's embedding).
Weights are stored in a small float dtype (fp16 by default) for size; configs say
``torch_dtype: float32`` (fp32 is what runs fastest on CPU), vLLM upcasts at load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from .drafter import DrafterConfig, Eagle3Drafter
from pipeline.fingerprint import target_config_fingerprint

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _cast(sd: dict, dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}


def save_target(
    model: LlamaForCausalLM, tokenizer_dir_writer, out_dir: str | os.PathLike, store_dtype: str = "float16"
) -> str:
    """tokenizer_dir_writer(out_dir) writes the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["use_cache"] = True
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"),
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(_cast(model.state_dict(), DTYPES[store_dtype]), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer_dir_writer(out)
    return str(out)


def load_target(path: str | os.PathLike) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def drafter_hf_config(
    c: DrafterConfig, target_dir: str | os.PathLike, target_name: str, extra: dict | None = None
) -> dict:
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    base = LlamaConfig(
        bos_token_id=tcfg.get("bos_token_id"),
        eos_token_id=tcfg.get("eos_token_id"),
        pad_token_id=tcfg.get("pad_token_id"),
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=False,
    ).to_dict()
    base.pop("transformers_version", None)
    base.update(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "torch_dtype": "float32",
            "dtype": "float32",
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": sorted(set(c.aux_layer_ids)),
                "use_aux_hidden_state": True,
            },
            "fc_norm": c.fc_norm,
            "norm_output": c.norm_output,
            "norm_before_residual": c.norm_before_residual,
            "norm_before_fc": False,
            "specbatch_target": {
                "name": target_name,
                "config_fingerprint": target_config_fingerprint(target_dir),
            },
            "specbatch_drafter": {
                "variant": "eagle3.1" if (c.fc_norm and c.norm_output) else "eagle3",
                **(extra or {}),
            },
        }
    )
    return base


def save_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    target_name: str,
    store_dtype: str = "float16",
    extra: dict | None = None,
) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter_hf_config(drafter.c, target_dir, target_name, extra)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(
        _cast(drafter.state_dict(), DTYPES[store_dtype]), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return str(out)


def drafter_config_from_hf(cfg: dict) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=cfg["max_position_embeddings"],
        vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
        aux_layer_ids=tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )


def load_drafter(path: str | os.PathLike) -> Eagle3Drafter:
    cfg = json.loads((Path(path) / "config.json").read_text())
    d = Eagle3Drafter(drafter_config_from_hf(cfg))
    sd = load_file(str(Path(path) / "model.safetensors"))
    d.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()})
    return d.eval()
