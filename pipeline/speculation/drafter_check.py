"""Refuse a drafter that does not belong to its target, before any engine starts.

Reads the EAGLE-3 / EAGLE-3.1 drafter (plain vLLM config or the speculators format, read
the way vLLM 0.32 reads it: pipeline/speculation/drafter_read.py) and the target's config, and
runs named checks:

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

from pathlib import Path
from typing import Any, Iterable, Optional

from pipeline.config import validate_check_names
from pipeline.speculation.drafter_read import DrafterMismatch, read_drafter, read_target
from schemas.drafter import CHECKS, CheckResult, DrafterInfo, DrafterReport, TargetInfo

# ---------------------------------------------------------------- the checks


def _result(name: str, ok: bool, field: str, drafter_value: Any, target_value: Any, message: str) -> CheckResult:
    return CheckResult(
        name=name,
        status="pass" if ok else "fail",
        field=field,
        drafter_value=None if drafter_value is None else str(drafter_value),
        target_value=None if target_value is None else str(target_value),
        message=message,
    )


def _skip(name: str, field: str, message: str) -> CheckResult:
    return CheckResult(name=name, status="skip", field=field, message=message)


def check_hidden_size(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    if d.target_hidden_size != t.hidden_size:
        return _result(
            "hidden_size",
            False,
            "target_hidden_size",
            d.target_hidden_size,
            t.hidden_size,
            f"drafter target_hidden_size ({d.target_hidden_size}) does not match the target's "
            f"hidden_size ({t.hidden_size}): the drafter's fc takes hidden states of another model",
        )
    if not d.has_embed_tokens and d.hidden_size != t.hidden_size:
        return _result(
            "hidden_size",
            False,
            "hidden_size",
            d.hidden_size,
            t.hidden_size,
            f"drafter hidden_size ({d.hidden_size}) does not match the target's hidden_size "
            f"({t.hidden_size}), and the drafter has no embed_tokens: it shares the target's embedding",
        )
    return _result(
        "hidden_size",
        True,
        "target_hidden_size",
        d.target_hidden_size,
        t.hidden_size,
        f"target_hidden_size {d.target_hidden_size} = target hidden_size",
    )


def check_aux_layer_ids(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    field = {
        "config": "eagle_aux_hidden_state_layer_ids",
        "eagle_config": "eagle_config.eagle_aux_hidden_state_layer_ids",
        "vllm_default": "eagle_aux_hidden_state_layer_ids (unset: vLLM's default 2, L//2, L-3)",
    }[d.aux_layer_ids_source]
    valid = f"0..{t.num_hidden_layers}"
    if not d.use_aux_hidden_state:
        return _skip("aux_layer_ids", field, "eagle_config.use_aux_hidden_state is false: no auxiliary states")
    outside = [i for i in d.aux_layer_ids if not 0 <= i <= t.num_hidden_layers]
    if outside:
        return _result(
            "aux_layer_ids",
            False,
            field,
            d.aux_layer_ids,
            valid,
            f"drafter {field} {d.aux_layer_ids} has {outside} outside the target's layers: valid ids are "
            f"{valid} (num_hidden_layers {t.num_hidden_layers}; id i is the input of layer i, id L the last output)",
        )
    distinct = sorted(set(d.aux_layer_ids))
    if len(distinct) != len(d.aux_layer_ids):
        return _result(
            "aux_layer_ids",
            False,
            field,
            d.aux_layer_ids,
            valid,
            f"drafter {field} {d.aux_layer_ids} repeats ids: the engine de-duplicates them to {distinct}, "
            f"{len(distinct)} states for a drafter that takes {d.aux_states_expected or len(d.aux_layer_ids)}",
        )
    if d.aux_states_expected is not None and d.aux_states_expected != len(distinct):
        return _result(
            "aux_layer_ids",
            False,
            field,
            d.aux_layer_ids,
            valid,
            f"drafter {field} {d.aux_layer_ids} gives {len(distinct)} auxiliary states but the drafter's fc "
            f"takes {d.aux_states_expected} (fc.weight in-features / target_hidden_size)",
        )
    return _result(
        "aux_layer_ids", True, field, d.aux_layer_ids, valid, f"aux layer ids {d.aux_layer_ids} within {valid}"
    )


def check_draft_vocab_map(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    m = d.vocab_map
    if m is None:
        return _unread_vocab_map(d, t)
    field = "d2t" if m.source == "d2t" else "draft_vocab_size"
    span = f"target ids {m.min_target_id}..{m.max_target_id}"
    failed = _vocab_map_failure(d, t, field, span)
    if failed is not None:
        return failed
    return _result(
        "draft_vocab_map",
        True,
        field,
        span,
        f"vocab 0..{t.vocab_size - 1}",
        f"{m.size} draft ids map to {span} ({m.source})",
    )


def _unread_vocab_map(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    if d.draft_vocab_size == t.vocab_size:
        return _skip("draft_vocab_map", "d2t", "no safetensors weights to read; draft vocab is the target's")
    return _skip(
        "draft_vocab_map", "d2t", f"no safetensors weights to read d2t from (draft_vocab_size {d.draft_vocab_size})"
    )


def _vocab_map_failure(d: DrafterInfo, t: TargetInfo, field: str, span: str) -> Optional[CheckResult]:
    """The first way the drafter's map from draft ids to target ids does not fit the target."""
    m = d.vocab_map
    if d.draft_vocab_size > t.vocab_size:
        return _result(
            "draft_vocab_map",
            False,
            "draft_vocab_size",
            d.draft_vocab_size,
            t.vocab_size,
            f"drafter draft_vocab_size ({d.draft_vocab_size}) is larger than the target's vocab_size ({t.vocab_size})",
        )
    if m.source == "d2t" and m.size != d.draft_vocab_size:
        return _result(
            "draft_vocab_map",
            False,
            "d2t",
            f"{m.size} entries",
            f"draft_vocab_size {d.draft_vocab_size}",
            f"drafter d2t has {m.size} entries but draft_vocab_size is {d.draft_vocab_size}",
        )
    if m.size and (m.min_target_id < 0 or m.max_target_id >= t.vocab_size):
        return _result(
            "draft_vocab_map",
            False,
            field,
            span,
            f"vocab 0..{t.vocab_size - 1}",
            f"drafter {field} maps draft ids to {span}, outside the target's vocab (vocab_size {t.vocab_size})",
        )
    if m.distinct_target_ids != m.size:
        return _result(
            "draft_vocab_map",
            False,
            field,
            f"{m.distinct_target_ids} distinct of {m.size}",
            f"vocab_size {t.vocab_size}",
            f"drafter {field} maps {m.size} draft ids to only {m.distinct_target_ids} distinct target ids",
        )
    return None


def check_vocab_size(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    if d.vocab_size != t.vocab_size:
        return _result(
            "vocab_size",
            False,
            "vocab_size",
            d.vocab_size,
            t.vocab_size,
            f"drafter vocab_size ({d.vocab_size}) does not match the target's vocab_size ({t.vocab_size}): "
            "it was trained under another tokenizer",
        )
    return _result(
        "vocab_size", True, "vocab_size", d.vocab_size, t.vocab_size, f"vocab_size {d.vocab_size} = target's"
    )


def check_tokenizer(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    if d.tokenizer_vocab_sha256 is None:
        return _skip("tokenizer", "tokenizer.json", "the drafter ships no tokenizer (it uses the target's)")
    if t.tokenizer_vocab_sha256 is None:
        return _skip("tokenizer", "tokenizer.json", "the target has no tokenizer.json to compare with")
    same = d.tokenizer_vocab_sha256 == t.tokenizer_vocab_sha256
    return _result(
        "tokenizer",
        same,
        "tokenizer.json",
        d.tokenizer_vocab_sha256[:16],
        t.tokenizer_vocab_sha256[:16],
        "the drafter's tokenizer has the target tokenizer's vocabulary"
        if same
        else f"the drafter's tokenizer.json vocabulary (sha256 {d.tokenizer_vocab_sha256[:16]}...) differs from "
        f"the target's (sha256 {t.tokenizer_vocab_sha256[:16]}...)",
    )


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
        return _result(
            "target_name",
            True,
            field,
            d.declared_target_name,
            t.name or t.path,
            f"declared target {d.declared_target_name!r} is this target",
        )
    if not t.name:
        return _skip(
            "target_name",
            field,
            f"the drafter declares target {d.declared_target_name!r}; the target records no name "
            "(config _name_or_path), so only its path and fingerprint can be compared",
        )
    return _result(
        "target_name",
        False,
        field,
        d.declared_target_name,
        t.name,
        f"drafter {field} ({d.declared_target_name!r}) is not this target ({t.name!r})",
    )


def check_target_fingerprint(d: DrafterInfo, t: TargetInfo) -> CheckResult:
    field = "specbatch_target.config_fingerprint"
    if not d.declared_target_fingerprint:
        return _skip("target_fingerprint", field, "the drafter declares no target config fingerprint")
    same = d.declared_target_fingerprint == t.config_fingerprint
    return _result(
        "target_fingerprint",
        same,
        field,
        d.declared_target_fingerprint,
        t.config_fingerprint,
        "the target's config fingerprint is the declared one"
        if same
        else f"drafter {field} ({d.declared_target_fingerprint}) is not this target's "
        f"({t.config_fingerprint}): the drafter was built for a target with another architecture "
        "or tokenizer (pipeline.fingerprint.ARCH_FIELDS, rope, tokenizer vocab)",
    )


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
        notes.append(
            f"only one EAGLE-3.1 switch is set (fc_norm {d.fc_norm}, norm_output {d.norm_output}): reported as EAGLE-3"
        )
    if d.norm_before_fc:
        notes.append("norm_before_fc: a single RMSNorm over the concatenated states (gpt-oss style), not EAGLE-3.1")
    if (
        d.max_position_embeddings
        and t.max_position_embeddings
        and d.max_position_embeddings < t.max_position_embeddings
    ):
        notes.append(
            f"drafter max_position_embeddings ({d.max_position_embeddings}) is below the target's "
            f"({t.max_position_embeddings})"
        )
    if d.dtype and t.dtype and d.dtype != t.dtype:
        notes.append(f"drafter dtype {d.dtype}, target dtype {t.dtype}: the engine runs both in the job's dtype")
    return notes


def inspect_drafter(
    target_path: str, drafter_path: str, warn_only: Iterable[str] = (), target_name: Optional[str] = None, storage=None
) -> DrafterReport:
    """The report, without raising on failed checks (see `check_drafter`). Paths may be URIs
    of `storage` (pipeline.storage.Storage); the report names them, not the cached copies."""
    from pipeline.storage.model_cache import localize

    warn_only = set(validate_check_names(warn_only))
    target = read_target(localize(target_path, storage, weights=False), target_name).model_copy(
        update={"path": target_path}
    )
    drafter = read_drafter(localize(drafter_path, storage), target.num_hidden_layers).model_copy(
        update={"path": drafter_path}
    )
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


def check_drafter(
    target_path: str, drafter_path: str, warn_only: Iterable[str] = (), target_name: Optional[str] = None, storage=None
) -> DrafterReport:
    """The report when the drafter belongs to the target (warnings included); otherwise
    DrafterMismatch listing every refused check. ValueError for unknown check names."""
    report = inspect_drafter(target_path, drafter_path, warn_only, target_name, storage)
    if not report.ok:
        failed = [c for c in report.checks if c.status == "fail"]
        lines = [f"drafter {drafter_path} does not belong to target {target_path}:"]
        lines += [f"  {c.name}: {c.message}" for c in failed]
        lines.append(
            f"(an expert may downgrade a check to a warning: speculative.checks_as_warnings / "
            f"--warn-only {' '.join(c.name for c in failed)})"
        )
        raise DrafterMismatch("\n".join(lines), report)
    return report
