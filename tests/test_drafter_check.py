"""Refusing a drafter that does not belong to its target (issue 4), before any engine starts.

No engine: configs and the d2t tensor only. Mismatches are purpose-built from copies of the
tiny kit's drafters (config.json / d2t edited in tmp_path).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import cli
from pipeline.speculation.drafter_check import CHECKS, DrafterMismatch, check_drafter, inspect_drafter
from tinykit import KIT_DIR, kit_paths
from pipeline.tools.check_drafter import main
from schemas.drafter import DrafterReport

KIT = kit_paths()
TARGET = KIT["target"]
OTHER_TARGET = str(Path(KIT_DIR) / "other-target")


@pytest.fixture
def drafter(tmp_path):
    """A copy of the kit's EAGLE-3.1 drafter; `edit(fn)` changes its config.json."""
    path = tmp_path / "drafter"
    shutil.copytree(KIT["drafter_eagle31"], path)
    return path


def edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def edit_d2t(path: Path, fn) -> None:
    weights = load_file(str(path / "model.safetensors"))
    weights["d2t"] = fn(weights["d2t"].clone())
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def status(report: DrafterReport) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


def refused(target: str, drafter_dir, **kwargs) -> DrafterMismatch:
    with pytest.raises(DrafterMismatch) as info:
        check_drafter(target, str(drafter_dir), **kwargs)
    return info.value


def to_speculators(path: Path, verifier: str = "specbatch-tiny-stdlib-llama") -> None:
    """Rewrite a plain EAGLE-3 drafter config in the speculators format."""
    plain = json.loads((path / "config.json").read_text())
    layer_keys = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_hidden_layers",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "hidden_act",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
    )
    spec = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": {k: plain[k] for k in layer_keys if k in plain},
        "draft_vocab_size": plain["draft_vocab_size"],
        "target_hidden_size": plain["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": plain["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "norm_before_residual": False,
        "fc_norm": plain["fc_norm"],
        "norm_output": plain["norm_output"],
    }
    (path / "config.json").write_text(json.dumps(spec, indent=2))


# ---------------------------------------------------------------- matched pairs


@pytest.mark.parametrize("key, version", [("drafter_eagle31", "3.1"), ("drafter_eagle3", "3")])
def test_the_kits_matched_drafters_pass_and_report_their_version(key, version):
    report = check_drafter(TARGET, KIT[key])
    assert report.ok and not report.warnings
    assert report.drafter.eagle_version == version
    assert report.drafter.format == "eagle3"
    assert report.drafter.declared_target_name == "specbatch-tiny-stdlib-llama"
    assert status(report)["target_fingerprint"] == "pass"
    assert report.drafter.aux_layer_ids == [1, 2, 4] and report.drafter.aux_states_expected == 3
    assert report.drafter.vocab_map.source == "d2t" and report.drafter.vocab_map.size == 1024
    assert report.drafter.vocab_map.max_target_id < report.target.vocab_size == 2048
    assert (report.target.hidden_size, report.target.num_hidden_layers) == (256, 4)
    assert report.drafter.max_position_embeddings == report.target.max_position_embeddings == 1024
    assert report.drafter.dtype == "float32"
    assert set(status(report)) == set(CHECKS)


# ---------------------------------------------------------------- each refusal


def test_the_kits_mismatched_drafter_is_refused_by_its_declared_target():
    exc = refused(TARGET, KIT["drafter_mismatched"])
    assert [c.name for c in exc.failures] == ["target_fingerprint"]
    assert "specbatch_target.config_fingerprint" in str(exc)
    assert exc.report.drafter.declared_target_fingerprint in str(exc)
    assert exc.report.target.config_fingerprint in str(exc)
    # ... and it does belong to the target it was built for
    assert status(check_drafter(OTHER_TARGET, KIT["drafter_mismatched"]))["target_fingerprint"] == "pass"


def test_hidden_size_mismatch(drafter):
    edit_config(drafter, lambda c: c.update(target_hidden_size=512))
    exc = refused(TARGET, drafter)
    (failure,) = [c for c in exc.failures if c.name == "hidden_size"]
    assert failure.field == "target_hidden_size"
    assert (failure.drafter_value, failure.target_value) == ("512", "256")
    assert "target_hidden_size (512)" in str(exc) and "hidden_size (256)" in str(exc)


def test_hidden_size_falls_back_to_the_drafters_hidden_size(drafter):
    def drop(c):
        del c["target_hidden_size"]
        c["hidden_size"] = 128

    edit_config(drafter, drop)
    exc = refused(TARGET, drafter)
    assert "hidden_size" in [c.name for c in exc.failures]


@pytest.mark.parametrize(
    "ids, why", [([1, 2, 5], "outside"), ([-1, 2, 4], "outside"), ([2, 2, 1], "repeats"), ([1, 2], "fc")]
)
def test_aux_layer_ids_refused(drafter, ids, why):
    edit_config(drafter, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids))
    exc = refused(TARGET, drafter)
    (failure,) = exc.failures
    assert failure.name == "aux_layer_ids" and why in failure.message
    assert failure.field == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert failure.target_value == "0..4" and str(ids) in failure.message


def test_aux_layer_ids_zero_and_num_layers_are_valid(drafter):
    edit_config(drafter, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 4]))
    assert status(check_drafter(TARGET, str(drafter)))["aux_layer_ids"] == "pass"


def test_unset_aux_layer_ids_fall_back_to_vllms_default_which_collapses_on_four_layers(drafter):
    edit_config(drafter, lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids"))
    exc = refused(TARGET, drafter)
    assert exc.report.drafter.aux_layer_ids_source == "vllm_default"
    assert exc.report.drafter.aux_layer_ids == [2, 2, 1]
    assert [c.name for c in exc.failures] == ["aux_layer_ids"]


def test_draft_vocab_map_outside_the_targets_vocab(drafter):
    edit_d2t(drafter, lambda d2t: d2t.index_put_((torch.tensor([1023]),), torch.tensor(2048 - 1023)))
    exc = refused(TARGET, drafter)
    (failure,) = exc.failures
    assert failure.name == "draft_vocab_map" and failure.field == "d2t"
    assert "2048" in failure.message and failure.target_value == "vocab 0..2047"


def test_draft_vocab_map_length_must_be_draft_vocab_size(drafter):
    edit_d2t(drafter, lambda d2t: d2t[:512].contiguous())
    assert [c.name for c in refused(TARGET, drafter).failures] == ["draft_vocab_map"]


def test_declared_target_name_is_compared_with_the_targets_name(drafter):
    assert (
        status(check_drafter(TARGET, str(drafter), target_name="specbatch-tiny-stdlib-llama"))["target_name"] == "pass"
    )
    exc = refused(TARGET, drafter, target_name="some-org/another-llama")
    (failure,) = exc.failures
    assert failure.name == "target_name" and failure.field == "specbatch_target.name"
    assert "'specbatch-tiny-stdlib-llama'" in failure.message and "'some-org/another-llama'" in failure.message


def test_a_target_recording_its_name_in_its_config_is_checked(tmp_path, drafter):
    target = tmp_path / "target"
    shutil.copytree(TARGET, target, ignore=shutil.ignore_patterns("*.safetensors"))
    edit_config(target, lambda c: c.update(_name_or_path="some-org/another-llama"))
    assert "target_name" in [c.name for c in refused(str(target), drafter).failures]
    edit_config(target, lambda c: c.update(_name_or_path="specbatch/specbatch-tiny-stdlib-llama"))
    assert status(check_drafter(str(target), str(drafter)))["target_name"] == "pass"


def test_declared_fingerprint_of_another_config(drafter):
    edit_config(drafter, lambda c: c["specbatch_target"].update(config_fingerprint="sha256:" + "0" * 64))
    exc = refused(TARGET, drafter)
    assert [c.name for c in exc.failures] == ["target_fingerprint"]
    assert "sha256:" + "0" * 64 in str(exc)


def test_vocab_size_mismatch(drafter):
    edit_config(drafter, lambda c: c.update(vocab_size=4096))
    exc = refused(TARGET, drafter)
    (failure,) = exc.failures
    assert failure.name == "vocab_size" and "vocab_size (4096)" in failure.message and "(2048)" in failure.message


def test_tokenizer_shipped_with_the_drafter_is_compared(drafter):
    shutil.copy(Path(TARGET) / "tokenizer.json", drafter / "tokenizer.json")
    assert status(check_drafter(TARGET, str(drafter)))["tokenizer"] == "pass"
    tok = json.loads((drafter / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (drafter / "tokenizer.json").write_text(json.dumps(tok))
    (failure,) = refused(TARGET, drafter).failures
    assert failure.name == "tokenizer" and "tokenizer.json" in failure.message


def test_every_refused_check_is_listed(drafter):
    edit_config(drafter, lambda c: c.update(target_hidden_size=512, vocab_size=4096))
    edit_config(drafter, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]))
    exc = refused(TARGET, drafter)
    assert {c.name for c in exc.failures} == {"hidden_size", "aux_layer_ids", "vocab_size"}
    for name in ("hidden_size", "aux_layer_ids", "vocab_size"):
        assert f"  {name}: " in str(exc)


# ---------------------------------------------------------------- speculators format


def test_speculators_format_passes_and_is_read_like_vllm_reads_it(drafter):
    to_speculators(drafter)
    report = check_drafter(TARGET, str(drafter), target_name="specbatch-tiny-stdlib-llama")
    d = report.drafter
    assert d.format == "speculators" and d.eagle_version == "3.1"
    assert d.architectures == ["Eagle3LlamaForCausalLM"]
    assert d.declared_target_name == "specbatch-tiny-stdlib-llama" and d.num_speculative_tokens == 3
    assert (d.hidden_size, d.target_hidden_size, d.vocab_size, d.draft_vocab_size) == (256, 256, 2048, 1024)
    assert d.aux_layer_ids == [1, 2, 4] and d.aux_layer_ids_source == "config"
    assert status(report)["target_name"] == "pass" and status(report)["target_fingerprint"] == "skip"


def test_speculators_format_refusals_name_the_speculators_fields(drafter):
    to_speculators(drafter, verifier="meta-llama/Llama-3.1-8B-Instruct")
    edit_config(drafter, lambda c: c.update(target_hidden_size=4096))
    edit_config(drafter, lambda c: c["transformer_layer_config"].update(vocab_size=128256))
    exc = refused(TARGET, drafter, target_name="specbatch-tiny-stdlib-llama")
    assert {c.name for c in exc.failures} == {"hidden_size", "vocab_size", "target_name"}
    assert "speculators_config.verifier.name_or_path" in str(exc)


def test_speculators_norm_before_residual_defaults_true(drafter):
    to_speculators(drafter)
    edit_config(drafter, lambda c: c.pop("norm_before_residual"))
    assert inspect_drafter(TARGET, str(drafter)).drafter.norm_before_residual is True


# ---------------------------------------------------------------- downgrading and the CLI


def test_a_downgraded_check_is_a_warning(drafter):
    report = check_drafter(TARGET, KIT["drafter_mismatched"], warn_only=["target_fingerprint"])
    assert report.ok and status(report)["target_fingerprint"] == "warn"
    assert len(report.warnings) == 1 and report.warnings[0].startswith("target_fingerprint: ")
    # downgrading one check leaves the others refusing
    edit_config(drafter, lambda c: c.update(vocab_size=4096, target_hidden_size=512))
    exc = refused(TARGET, drafter, warn_only=["vocab_size"])
    assert [c.name for c in exc.failures] == ["hidden_size"]
    assert status(exc.report)["vocab_size"] == "warn"


def test_unknown_check_names_are_an_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match="valid checks: hidden_size, aux_layer_ids") as info:
        check_drafter(TARGET, KIT["drafter_eagle31"], warn_only=["hiden_size"])
    assert not isinstance(info.value, DrafterMismatch) and "'hiden_size'" in str(info.value)


def test_cli_exit_codes(capsys, tmp_path):
    args = ["--model", TARGET, "--drafter"]
    assert main(args + [KIT["drafter_eagle31"]]) == 0
    out = capsys.readouterr().out
    assert "EAGLE-3.1" in out and "OK" in out
    assert main(args + [KIT["drafter_mismatched"]]) == 1
    assert "REFUSED: target_fingerprint" in capsys.readouterr().out
    assert main(args + [KIT["drafter_mismatched"], "--warn-only", "target_fingerprint"]) == 0
    assert "WARN" in capsys.readouterr().out
    assert main(args + [KIT["drafter_eagle31"], "--warn-only", "nope"]) == 2
    assert "valid checks" in capsys.readouterr().err
    assert main(args + [str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_json_is_the_report_contract(capsys):
    assert cli.main(["check-drafter", "--model", TARGET, "--drafter", KIT["drafter_eagle3"], "--json"]) == 0
    report = DrafterReport.model_validate_json(capsys.readouterr().out)
    assert report.ok and report.drafter.eagle_version == "3"
