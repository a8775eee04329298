"""Which target a drafter belongs to: a fingerprint of the target's config.

``target_config_fingerprint`` is a sha256 over
  * the architecture-defining fields of the target's HF config (ARCH_FIELDS below;
    rope settings from either ``rope_parameters`` or ``rope_theta``/``rope_scaling``,
    normalised to one form), and
  * when the argument is a model directory (or its config.json) that has a
    ``tokenizer.json``: a sha256 of the tokenizer's vocabulary (token -> id, added tokens
    included), because a drafter predicts token ids and is useless under another vocab.

Weights are not part of it: two targets with the same architecture and tokenizer but
different weights get the same fingerprint (the drafter config also records the
target's name for that). Pass the model directory for the canonical value; a bare dict
gives the config-only value unless ``tokenizer_vocab_sha256`` is passed.
Format: ``"sha256:<64 hex>"``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "rms_norm_eps",
    "tie_word_embeddings",
)
FINGERPRINT_VERSION = 1


def _rope(cfg: Mapping[str, Any]) -> dict:
    rp = cfg.get("rope_parameters")
    if isinstance(rp, Mapping):
        rope = dict(rp)
    else:
        rope = dict(cfg.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        if cfg.get("rope_theta") is not None:
            rope["rope_theta"] = cfg["rope_theta"]
    rope.setdefault("rope_type", "default")
    if "rope_theta" in rope:
        rope["rope_theta"] = float(rope["rope_theta"])
    return rope


def tokenizer_vocab_sha256(tokenizer_json: str | os.PathLike) -> str:
    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    vocab = dict(data.get("model", {}).get("vocab", {}))
    for t in data.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def fingerprint_fields(
    config_dict_or_path: Mapping[str, Any] | str | os.PathLike, tokenizer_vocab: str | None = None
) -> dict:
    """The canonical dict that is hashed (useful in error messages)."""
    if isinstance(config_dict_or_path, Mapping):
        cfg = dict(config_dict_or_path)
        model_dir = None
    else:
        p = Path(config_dict_or_path)
        cfg_path = p / "config.json" if p.is_dir() else p
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        model_dir = cfg_path.parent
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg.get("model_type")}
    fields: dict[str, Any] = {k: cfg.get(k) for k in ARCH_FIELDS}
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields["head_dim"] is None and fields["hidden_size"] and fields["num_attention_heads"]:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["tie_word_embeddings"] is None:
        fields["tie_word_embeddings"] = False
    fields["rope"] = _rope(cfg)
    if tokenizer_vocab is None and model_dir is not None and (model_dir / "tokenizer.json").exists():
        tokenizer_vocab = tokenizer_vocab_sha256(model_dir / "tokenizer.json")
    fields["tokenizer_vocab_sha256"] = tokenizer_vocab
    fields["fingerprint_version"] = FINGERPRINT_VERSION
    return fields


def target_config_fingerprint(
    config_dict_or_path: Mapping[str, Any] | str | os.PathLike, tokenizer_vocab_sha256: str | None = None
) -> str:
    fields = fingerprint_fields(config_dict_or_path, tokenizer_vocab_sha256)
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()
