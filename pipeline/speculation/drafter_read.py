"""A target's and an EAGLE-3 / EAGLE-3.1 drafter's folders read the way vLLM 0.32 reads them
(plain vLLM config or the speculators format): the fields the drafter checks compare
(pipeline/speculation/drafter_check.py), the drafter's ``d2t`` map and a few weight shapes,
never the weights."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from schemas.drafter import DrafterInfo, DrafterReport, DraftVocabMap, TargetInfo


class DrafterMismatch(ValueError):
    """The drafter does not belong to the target. ``failures`` are the refused checks
    (empty when the drafter could not be read as an EAGLE-3 drafter at all)."""

    def __init__(self, message: str, report: Optional[DrafterReport] = None):
        super().__init__(message)
        self.report = report
        self.failures = [c for c in report.checks if c.status == "fail"] if report else []


# ---------------------------------------------------------------- reading the target


def _read_config(model_dir: Path, what: str) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{what} {model_dir}: no config.json (a model folder is expected)")
    return json.loads(path.read_text(encoding="utf-8"))


def _required(cfg: dict, key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise DrafterMismatch(f"{where}: config has no {key}")
    return cfg[key]


def _config_dtype(cfg: dict) -> Optional[str]:
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return str(dtype) if dtype is not None else None


def _tokenizer_sha(model_dir: Path) -> Optional[str]:
    from pipeline.fingerprint import tokenizer_vocab_sha256

    path = model_dir / "tokenizer.json"
    return tokenizer_vocab_sha256(path) if path.is_file() else None


def _recorded_name(raw: dict) -> Optional[str]:
    """`_name_or_path` when it is a name (hub id), not a path on the machine that saved it."""
    name = raw.get("_name_or_path") or ""
    return name if name and not name.startswith(("/", ".", "~")) and ":\\" not in name else None


def read_target(target_path: str, target_name: Optional[str] = None) -> TargetInfo:
    from pipeline.fingerprint import target_config_fingerprint

    model_dir = Path(target_path)
    raw = _read_config(model_dir, "target")
    cfg = (
        {**raw["text_config"], "model_type": raw.get("model_type")}
        if "text_config" in raw and "hidden_size" not in raw
        else raw
    )
    where = f"target {target_path}"
    return TargetInfo(
        path=str(target_path),
        name=target_name or _recorded_name(raw),
        architectures=list(raw.get("architectures") or []),
        model_type=cfg.get("model_type"),
        hidden_size=_required(cfg, "hidden_size", where),
        num_hidden_layers=_required(cfg, "num_hidden_layers", where),
        vocab_size=_required(cfg, "vocab_size", where),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        dtype=_config_dtype(cfg) or _config_dtype(raw),
        config_fingerprint=target_config_fingerprint(model_dir),
        tokenizer_vocab_sha256=_tokenizer_sha(model_dir),
    )


# ---------------------------------------------------------------- reading the drafter


def _speculators_view(raw: dict, where: str) -> dict:
    """The config vLLM builds from the speculators format
    (vllm/transformers_utils/configs/speculators/algos.py: update_eagle3)."""
    if raw.get("speculators_model_type") != "eagle3":
        raise DrafterMismatch(
            f"{where}: speculators_model_type is {raw.get('speculators_model_type')!r}, expected 'eagle3'"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterMismatch(f"{where}: speculators format without a transformer_layer_config mapping")
    view = dict(layer)
    view["draft_vocab_size"] = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        view["target_hidden_size"] = raw["target_hidden_size"]
    view["norm_before_residual"] = raw.get("norm_before_residual", True)
    view["norm_before_fc"] = raw.get("norm_before_fc", False)
    view["fc_norm"] = raw.get("fc_norm", False)
    view["norm_output"] = raw.get("norm_output", False)
    model_type = view.get("model_type", "llama")
    view["architectures"] = [
        {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}.get(model_type, f"Eagle3<{model_type}>")
    ]
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        view["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    return view


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


class _Weights:
    """Names, shapes and dtypes from safetensors headers; tensors only on request."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self._open = safe_open
        self.where: dict[str, Path] = {}
        for path in _weight_files(model_dir):
            with safe_open(str(path), framework="np") as f:
                self.where.update({name: path for name in f.keys()})

    def find(self, pattern: str) -> Optional[str]:
        """The first weight name matching `pattern` as a whole or as a dotted suffix."""
        regex = re.compile(rf"(^|\.){pattern}$")
        return next((n for n in sorted(self.where) if regex.search(n)), None)

    def slice_info(self, name: str) -> tuple[list[int], str]:
        with self._open(str(self.where[name]), framework="np") as f:
            part = f.get_slice(name)
            return list(part.get_shape()), str(part.get_dtype())

    def tensor(self, name: str):
        with self._open(str(self.where[name]), framework="np") as f:
            return f.get_tensor(name)


def _vocab_map(weights: Optional[_Weights], draft_vocab_size: int) -> Optional[DraftVocabMap]:
    import numpy as np  # not torch: the check runs in the driver, before anything heavy loads

    if weights is None:
        return None
    name = weights.find("d2t")
    if name is None:
        ids = np.arange(draft_vocab_size)
        source = "identity"
    else:
        d2t = weights.tensor(name).astype(np.int64).ravel()
        ids = np.arange(d2t.size) + d2t
        source = "d2t"
    if ids.size == 0:
        return DraftVocabMap(source=source, size=0, min_target_id=0, max_target_id=-1, distinct_target_ids=0)
    return DraftVocabMap(
        source=source,
        size=int(ids.size),
        min_target_id=int(ids.min()),
        max_target_id=int(ids.max()),
        distinct_target_ids=int(np.unique(ids).size),
    )


def _aux_layer_ids(view: dict, target_layers: int) -> tuple[list[int], str]:
    """The ids the engine taps on the target, looked up as vLLM's model runner does."""
    if view.get("eagle_aux_hidden_state_layer_ids"):
        return list(view["eagle_aux_hidden_state_layer_ids"]), "config"
    eagle_config = view.get("eagle_config") or {}
    if eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        return list(eagle_config["eagle_aux_hidden_state_layer_ids"]), "eagle_config"
    n = target_layers
    return [2, n // 2, n - 3], "vllm_default"


def _aux_states_expected(view: dict, weights: Optional[_Weights], target_hidden: int) -> Optional[int]:
    """How many auxiliary states the drafter's fc takes: from fc.weight when it can be read,
    otherwise as vLLM sizes fc (num_aux_hidden_states, eagle_config ids, else 3)."""
    name = weights.find(r"fc\.weight") if weights else None
    if name is not None:
        shape, _ = weights.slice_info(name)
        return (
            shape[1] // target_hidden if len(shape) == 2 and target_hidden and shape[1] % target_hidden == 0 else None
        )
    if view.get("num_aux_hidden_states"):
        return int(view["num_aux_hidden_states"])
    ids = (view.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def _declared(raw: dict, where: str) -> tuple[str, dict, Optional[str], Optional[str], Optional[int]]:
    """(format, the EAGLE-3 view of the config, declared target name, declared target
    fingerprint, declared depth) of a drafter config in EAGLE-3 or speculators format."""
    if "speculators_model_type" not in raw and "speculators_config" not in raw:
        declared = raw.get("specbatch_target") or {}
        return "eagle3", raw, declared.get("name"), declared.get("config_fingerprint"), None
    speculators = raw.get("speculators_config") or {}
    verifier = speculators.get("verifier") or {}
    methods = speculators.get("proposal_methods") or [{}]
    view = _speculators_view(raw, where)
    return "speculators", view, verifier.get("name_or_path"), None, methods[0].get("speculative_tokens")


def read_drafter(drafter_path: str, target_layers: int) -> DrafterInfo:
    model_dir = Path(drafter_path)
    raw = _read_config(model_dir, "drafter")
    where = f"drafter {drafter_path}"
    fmt, view, declared_name, declared_fp, num_spec = _declared(raw, where)
    hidden = _required(view, "hidden_size", where)
    vocab = _required(view, "vocab_size", where)
    target_hidden = view.get("target_hidden_size") or hidden
    draft_vocab = view.get("draft_vocab_size") or vocab
    eagle_config = view.get("eagle_config") or {}
    aux_ids, aux_source = _aux_layer_ids(view, target_layers)
    weights = _Weights(model_dir) if _weight_files(model_dir) else None
    fc_name = weights.find(r"fc\.weight") if weights else None
    fc_norm, norm_output = bool(view.get("fc_norm", False)), bool(view.get("norm_output", False))
    return DrafterInfo(
        path=str(drafter_path),
        format=fmt,
        architectures=[
            a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}"
            for a in view.get("architectures") or []
        ],
        eagle_version="3.1" if fc_norm and norm_output else "3",
        fc_norm=fc_norm,
        norm_output=norm_output,
        norm_before_fc=bool(eagle_config.get("norm_before_fc", view.get("norm_before_fc", False))),
        norm_before_residual=bool(view.get("norm_before_residual", False)),
        declared_target_name=declared_name,
        declared_target_fingerprint=declared_fp,
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        vocab_map=_vocab_map(weights, draft_vocab),
        use_aux_hidden_state=bool(eagle_config.get("use_aux_hidden_state", True)),
        aux_layer_ids=aux_ids,
        aux_layer_ids_source=aux_source,
        aux_states_expected=_aux_states_expected(view, weights, target_hidden),
        max_position_embeddings=view.get("max_position_embeddings"),
        dtype=_config_dtype(view) or _config_dtype(raw),
        weights_dtype=weights.slice_info(fc_name)[1] if fc_name else None,
        has_embed_tokens=bool(weights and weights.find(r"embed_tokens\.weight")),
        num_speculative_tokens=num_spec,
        tokenizer_vocab_sha256=_tokenizer_sha(model_dir),
    )
