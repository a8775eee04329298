"""Refuse a drafter that does not belong to its target, before any engine starts (issue 4).

Reads the EAGLE-3 / EAGLE-3.1 drafter (plain vLLM config or the speculators format, read
the way vLLM 0.32 reads it) and the target's config, and runs named checks:

  hidden_size         drafter target_hidden_size (hidden_size when it shares the target's
                      embedding) vs the target's hidden_size
  aux_layer_ids       auxiliary layer ids distinct, within 0..num_hidden_layers, as many as
                      the drafter's fc takes
  draft_vocab_map     every target id = draft id + d2t[draft id] inside the target's vocab
  vocab_size          drafter vocab_size vs the target's vocab_size
  tokenizer           a tokenizer shipped with the drafter vs the target's tokenizer
  target_name         the target the drafter declares, by name
  target_fingerprint  the target the drafter declares, by config fingerprint

A failed check refuses the drafter unless its name is in ``warn_only`` (the job's
``speculative.checks_as_warnings``, ``--warn-only`` on the command line): then it is a
warning. Only the ``d2t`` tensor and a few weight shapes are read, never the weights.

Models in object storage are copied into the model cache (pipeline/storage/model_cache.py) where the
check runs (the driver): the target's config and tokenizer files only, and the whole drafter,
whose safetensors files hold ``d2t`` and the shapes (a drafter is one decoder layer: MBs to a
few GB, and on a node that also runs an engine the engine reuses the copy).

    specbatch check-drafter --model TARGET --drafter DRAFTER [--warn-only CHECK ...]
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from pipeline.config import validate_check_names
from schemas.drafter import CHECKS, CheckResult, DrafterInfo, DrafterReport, DraftVocabMap, TargetInfo



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
    cfg = {**raw["text_config"], "model_type": raw.get("model_type")} if "text_config" in raw and "hidden_size" not in raw else raw
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
        raise DrafterMismatch(f"{where}: speculators_model_type is {raw.get('speculators_model_type')!r}, expected 'eagle3'")
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
    view["architectures"] = [{"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}.get(model_type, f"Eagle3<{model_type}>")]
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
        return shape[1] // target_hidden if len(shape) == 2 and target_hidden and shape[1] % target_hidden == 0 else None
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
        architectures=[a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}" for a in view.get("architectures") or []],
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


# ---------------------------------------------------------------- the checks


def _result(name: str, ok: bool, field: str, drafter_value: Any, target_value: Any, message: str) -> CheckResult:
    return CheckResult(
        name=name, status="pass" if ok else "fail", field=field,
        drafter_value=None if drafter_value is None else str(drafter_value),
        target_value=None if target_value is None else str(target_value),
        message=message,
    )


def _skip(name: str, field: str, message: str) -> CheckResult:
    return CheckResult(name=name, status="skip", field=field, message=message)


def check_hidden_size(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    if d.target_hidden_size != t.hidden_size:
        return _result("hidden_size", False, "target_hidden_size", d.target_hidden_size, t.hidden_size,
                       f"drafter target_hidden_size ({d.target_hidden_size}) does not match the target's "
                       f"hidden_size ({t.hidden_size}): the drafter's fc takes hidden states of another model")
    if not d.has_embed_tokens and d.hidden_size != t.hidden_size:
        return _result("hidden_size", False, "hidden_size", d.hidden_size, t.hidden_size,
                       f"drafter hidden_size ({d.hidden_size}) does not match the target's hidden_size "
                       f"({t.hidden_size}), and the drafter has no embed_tokens: it shares the target's embedding")
    return _result("hidden_size", True, "target_hidden_size", d.target_hidden_size, t.hidden_size,
                   f"target_hidden_size {d.target_hidden_size} = target hidden_size")


def check_aux_layer_ids(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    field = {"config": "eagle_aux_hidden_state_layer_ids", "eagle_config": "eagle_config.eagle_aux_hidden_state_layer_ids",
             "vllm_default": "eagle_aux_hidden_state_layer_ids (unset: vLLM's default 2, L//2, L-3)"}[d.aux_layer_ids_source]
    valid = f"0..{t.num_hidden_layers}"
    if not d.use_aux_hidden_state:
        return _skip("aux_layer_ids", field, "eagle_config.use_aux_hidden_state is false: no auxiliary states")
    outside = [i for i in d.aux_layer_ids if not 0 <= i <= t.num_hidden_layers]
    if outside:
        return _result("aux_layer_ids", False, field, d.aux_layer_ids, valid,
                       f"drafter {field} {d.aux_layer_ids} has {outside} outside the target's layers: valid ids are "
                       f"{valid} (num_hidden_layers {t.num_hidden_layers}; id i is the input of layer i, id L the last output)")
    distinct = sorted(set(d.aux_layer_ids))
    if len(distinct) != len(d.aux_layer_ids):
        return _result("aux_layer_ids", False, field, d.aux_layer_ids, valid,
                       f"drafter {field} {d.aux_layer_ids} repeats ids: the engine de-duplicates them to {distinct}, "
                       f"{len(distinct)} states for a drafter that takes {d.aux_states_expected or len(d.aux_layer_ids)}")
    if d.aux_states_expected is not None and d.aux_states_expected != len(distinct):
        return _result("aux_layer_ids", False, field, d.aux_layer_ids, valid,
                       f"drafter {field} {d.aux_layer_ids} gives {len(distinct)} auxiliary states but the drafter's fc "
                       f"takes {d.aux_states_expected} (fc.weight in-features / target_hidden_size)")
    return _result("aux_layer_ids", True, field, d.aux_layer_ids, valid, f"aux layer ids {d.aux_layer_ids} within {valid}")


def check_draft_vocab_map(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    m = d.vocab_map
    if m is None:
        if d.draft_vocab_size == t.vocab_size:
            return _skip("draft_vocab_map", "d2t", "no safetensors weights to read; draft vocab is the target's")
        return _skip("draft_vocab_map", "d2t", f"no safetensors weights to read d2t from (draft_vocab_size {d.draft_vocab_size})")
    field = "d2t" if m.source == "d2t" else "draft_vocab_size"
    span = f"target ids {m.min_target_id}..{m.max_target_id}"
    if d.draft_vocab_size > t.vocab_size:
        return _result("draft_vocab_map", False, "draft_vocab_size", d.draft_vocab_size, t.vocab_size,
                       f"drafter draft_vocab_size ({d.draft_vocab_size}) is larger than the target's vocab_size ({t.vocab_size})")
    if m.source == "d2t" and m.size != d.draft_vocab_size:
        return _result("draft_vocab_map", False, "d2t", f"{m.size} entries", f"draft_vocab_size {d.draft_vocab_size}",
                       f"drafter d2t has {m.size} entries but draft_vocab_size is {d.draft_vocab_size}")
    if m.size and (m.min_target_id < 0 or m.max_target_id >= t.vocab_size):
        return _result("draft_vocab_map", False, field, span, f"vocab 0..{t.vocab_size - 1}",
                       f"drafter {field} maps draft ids to {span}, outside the target's vocab (vocab_size {t.vocab_size})")
    if m.distinct_target_ids != m.size:
        return _result("draft_vocab_map", False, field, f"{m.distinct_target_ids} distinct of {m.size}", f"vocab_size {t.vocab_size}",
                       f"drafter {field} maps {m.size} draft ids to only {m.distinct_target_ids} distinct target ids")
    return _result("draft_vocab_map", True, field, span, f"vocab 0..{t.vocab_size - 1}",
                   f"{m.size} draft ids map to {span} ({m.source})")


def check_vocab_size(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    if d.vocab_size != t.vocab_size:
        return _result("vocab_size", False, "vocab_size", d.vocab_size, t.vocab_size,
                       f"drafter vocab_size ({d.vocab_size}) does not match the target's vocab_size ({t.vocab_size}): "
                       "it was trained under another tokenizer")
    return _result("vocab_size", True, "vocab_size", d.vocab_size, t.vocab_size, f"vocab_size {d.vocab_size} = target's")


def check_tokenizer(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    if d.tokenizer_vocab_sha256 is None:
        return _skip("tokenizer", "tokenizer.json", "the drafter ships no tokenizer (it uses the target's)")
    if t.tokenizer_vocab_sha256 is None:
        return _skip("tokenizer", "tokenizer.json", "the target has no tokenizer.json to compare with")
    same = d.tokenizer_vocab_sha256 == t.tokenizer_vocab_sha256
    return _result("tokenizer", same, "tokenizer.json", d.tokenizer_vocab_sha256[:16], t.tokenizer_vocab_sha256[:16],
                   "the drafter's tokenizer has the target tokenizer's vocabulary" if same else
                   f"the drafter's tokenizer.json vocabulary (sha256 {d.tokenizer_vocab_sha256[:16]}...) differs from "
                   f"the target's (sha256 {t.tokenizer_vocab_sha256[:16]}...)")


def _name_forms(name: str) -> set[str]:
    name = name.strip().rstrip("/").lower()
    return {name, name.rsplit("/", 1)[-1]}


def check_target_name(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    field = "speculators_config.verifier.name_or_path" if d.format == "speculators" else "specbatch_target.name"
    if not d.declared_target_name:
        return _skip("target_name", field, "the drafter declares no target name")
    declared = _name_forms(d.declared_target_name)
    known = _name_forms(t.path) | {str(Path(t.path).resolve()).lower()}
    if t.name:
        known |= _name_forms(t.name)
    if declared & known:
        return _result("target_name", True, field, d.declared_target_name, t.name or t.path,
                       f"declared target {d.declared_target_name!r} is this target")
    if not t.name:
        return _skip("target_name", field,
                     f"the drafter declares target {d.declared_target_name!r}; the target records no name "
                     "(config _name_or_path), so only its path and fingerprint can be compared")
    return _result("target_name", False, field, d.declared_target_name, t.name,
                   f"drafter {field} ({d.declared_target_name!r}) is not this target ({t.name!r})")


def check_target_fingerprint(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    field = "specbatch_target.config_fingerprint"
    if not d.declared_target_fingerprint:
        return _skip("target_fingerprint", field, "the drafter declares no target config fingerprint")
    same = d.declared_target_fingerprint == t.config_fingerprint
    return _result("target_fingerprint", same, field, d.declared_target_fingerprint, t.config_fingerprint,
                   "the target's config fingerprint is the declared one" if same else
                   f"drafter {field} ({d.declared_target_fingerprint}) is not this target's "
                   f"({t.config_fingerprint}): the drafter was built for a target with another architecture "
                   "or tokenizer (pipeline.fingerprint.ARCH_FIELDS, rope, tokenizer vocab)")


CHECK_FUNCTIONS = {
    "hidden_size": check_hidden_size,
    "aux_layer_ids": check_aux_layer_ids,
    "draft_vocab_map": check_draft_vocab_map,
    "vocab_size": check_vocab_size,
    "tokenizer": check_tokenizer,
    "target_name": check_target_name,
    "target_fingerprint": check_target_fingerprint,
}
assert list(CHECK_FUNCTIONS) == list(CHECKS)


# ---------------------------------------------------------------- the report


def _notes(d: DrafterInfo, t: TargetInfo) -> list[str]:
    notes = []
    if d.fc_norm != d.norm_output:
        notes.append(f"only one EAGLE-3.1 switch is set (fc_norm {d.fc_norm}, norm_output {d.norm_output}): reported as EAGLE-3")
    if d.norm_before_fc:
        notes.append("norm_before_fc: a single RMSNorm over the concatenated states (gpt-oss style), not EAGLE-3.1")
    if d.max_position_embeddings and t.max_position_embeddings and d.max_position_embeddings < t.max_position_embeddings:
        notes.append(f"drafter max_position_embeddings ({d.max_position_embeddings}) is below the target's "
                     f"({t.max_position_embeddings})")
    if d.dtype and t.dtype and d.dtype != t.dtype:
        notes.append(f"drafter dtype {d.dtype}, target dtype {t.dtype}: the engine runs both in the job's dtype")
    return notes


def inspect_drafter(target_path: str, drafter_path: str, warn_only: Iterable[str] = (),
                    target_name: Optional[str] = None, storage=None) -> DrafterReport:
    """The report, without raising on failed checks (see `check_drafter`). Paths may be URIs
    of `storage` (pipeline.storage.Storage); the report names them, not the cached copies."""
    from pipeline.storage.model_cache import localize

    warn_only = set(validate_check_names(warn_only))
    target = read_target(localize(target_path, storage, weights=False), target_name).model_copy(update={"path": target_path})
    drafter = read_drafter(localize(drafter_path, storage), target.num_hidden_layers).model_copy(update={"path": drafter_path})
    checks = []
    for name, check in CHECK_FUNCTIONS.items():
        result = check(drafter, target)
        if result.status == "fail" and name in warn_only:
            result = result.model_copy(update={"status": "warn"})
        checks.append(result)
    return DrafterReport(
        ok=all(c.status != "fail" for c in checks),
        target_identity=target_identity(checks),
        target=target,
        drafter=drafter,
        checks=checks,
        warnings=[f"{c.name}: {c.message}" for c in checks if c.status == "warn"],
        notes=_notes(drafter, target),
    )


IDENTITY_CHECKS = ("target_name", "target_fingerprint")


def target_identity(checks: list[CheckResult]) -> str:
    """verified / mismatch / unverified, from the checks of the target the drafter declares."""
    statuses = {c.status for c in checks if c.name in IDENTITY_CHECKS}
    if statuses & {"fail", "warn"}:
        return "mismatch"
    return "verified" if "pass" in statuses else "unverified"


def check_drafter(target_path: str, drafter_path: str, warn_only: Iterable[str] = (),
                  target_name: Optional[str] = None, storage=None) -> DrafterReport:
    """The report when the drafter belongs to the target (warnings included); otherwise
    DrafterMismatch listing every refused check. ValueError for unknown check names."""
    report = inspect_drafter(target_path, drafter_path, warn_only, target_name, storage)
    if not report.ok:
        failed = [c for c in report.checks if c.status == "fail"]
        lines = [f"drafter {drafter_path} does not belong to target {target_path}:"]
        lines += [f"  {c.name}: {c.message}" for c in failed]
        lines.append(f"(an expert may downgrade a check to a warning: speculative.checks_as_warnings / "
                     f"--warn-only {' '.join(c.name for c in failed)})")
        raise DrafterMismatch("\n".join(lines), report)
    return report
