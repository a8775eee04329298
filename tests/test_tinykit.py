"""The tiny model kit (issue 3): layout, target fingerprints, the training-side drafter
against vLLM's drafter module, and the committed kit in vLLM's engine. No training here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline.fingerprint import target_config_fingerprint  # noqa: E402
from tinykit import KIT_DIR, kit_paths  # noqa: E402
from tinykit.random_kit import build_random_kit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PATHS = kit_paths()


def _cfg(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# ------------------------------------------------------------------ random kit
@pytest.fixture(scope="module")
def random_kits(tmp_path_factory):
    root = tmp_path_factory.mktemp("random_kit")
    return {
        "plain": build_random_kit(str(root / "a")),
        "zero": build_random_kit(str(root / "z"), zero_lm_head=True),
        "eagle3": build_random_kit(str(root / "e3"), eagle31=False, seed=1),
    }


def test_random_kit_builds_in_vllm_layout(random_kits):
    kit = random_kits["plain"]
    t, d = Path(kit["target"]), Path(kit["drafter"])
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (t / f).is_file(), f
    tcfg, dcfg = _cfg(t), _cfg(d)
    assert tcfg["architectures"] == ["LlamaForCausalLM"] and tcfg["max_position_embeddings"] >= 1024
    assert tcfg["vocab_size"] == 2048 and tcfg["hidden_size"] == 256 and tcfg["num_hidden_layers"] == 4
    assert "chat_template" in json.loads((t / "tokenizer_config.json").read_text())
    assert dcfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert dcfg["fc_norm"] is True and dcfg["norm_output"] is True and dcfg["norm_before_residual"] is False
    assert dcfg["specbatch_target"]["config_fingerprint"] == target_config_fingerprint(t)
    w = load_file(str(d / "model.safetensors"))
    assert "embed_tokens.weight" not in w and w["fc.weight"].shape == (256, 768)
    assert {"fc_norm.0.weight", "fc_norm.2.weight", "midlayer.self_attn.q_proj.weight", "d2t"} <= set(w)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (256, 512)  # q/k/v take [embed, hidden]
    assert w["lm_head.weight"].shape == (dcfg["draft_vocab_size"], 256)
    e3 = _cfg(random_kits["eagle3"]["drafter"])
    assert e3["fc_norm"] is False and e3["norm_output"] is False
    assert not any(
        k.startswith("fc_norm") for k in load_file(str(Path(random_kits["eagle3"]["drafter"]) / "model.safetensors"))
    )


def test_zero_lm_head_kit_always_picks_an_ordinary_token_0(random_kits):
    kit = random_kits["zero"]
    tw, dw = (load_file(str(Path(kit[k]) / "model.safetensors")) for k in ("target", "drafter"))
    assert torch.count_nonzero(tw["lm_head.weight"]) == 0 and torch.count_nonzero(dw["lm_head.weight"]) == 0
    assert int(dw["d2t"][0]) == 0  # draft id 0 -> target id 0
    tok = json.loads((Path(kit["target"]) / "tokenizer.json").read_text())
    specials = {t["id"] for t in tok["added_tokens"]}
    assert 0 not in specials and _cfg(kit["target"])["eos_token_id"] != 0  # argmax 0 is not EOS


def test_random_kit_is_deterministic(random_kits, tmp_path):
    again = build_random_kit(str(tmp_path / "again"))
    for k in ("target", "drafter"):
        a = load_file(str(Path(random_kits["plain"][k]) / "model.safetensors"))
        b = load_file(str(Path(again[k]) / "model.safetensors"))
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert (Path(again["target"]) / "tokenizer.json").read_bytes() == (
        Path(random_kits["plain"]["target"]) / "tokenizer.json"
    ).read_bytes()


# ------------------------------------------------------------------ fingerprint
def test_fingerprint_covers_architecture_and_vocab(random_kits, tmp_path):
    t = random_kits["plain"]["target"]
    cfg = _cfg(t)
    fp = target_config_fingerprint(t)
    assert fp.startswith("sha256:") and len(fp) == 71
    assert fp == target_config_fingerprint(Path(t) / "config.json")
    assert target_config_fingerprint(cfg) != fp  # a bare dict has no tokenizer vocab
    # the same architecture with another seed has the same fingerprint (weights are not in it)
    assert target_config_fingerprint(random_kits["eagle3"]["target"]) == fp
    for key, val in (
        ("num_hidden_layers", 5),
        ("hidden_size", 512),
        ("vocab_size", 4096),
        ("intermediate_size", 1024),
        ("num_key_value_heads", 4),
    ):
        assert target_config_fingerprint({**cfg, key: val}) != target_config_fingerprint(cfg), key
    # rope given the old way (rope_theta) or the new way (rope_parameters) is the same rope
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    old["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    assert target_config_fingerprint(old) == target_config_fingerprint(cfg)
    assert target_config_fingerprint({**old, "rope_theta": 500000.0}) != target_config_fingerprint(cfg)
    # another tokenizer vocab -> another fingerprint
    tokjs = json.loads((Path(t) / "tokenizer.json").read_text())
    v = tokjs["model"]["vocab"]
    a, b = list(v)[100:102]
    v[a], v[b] = v[b], v[a]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokjs))
    assert target_config_fingerprint(tmp_path) != fp


# ------------------------------------------------------------------ committed kit
def test_committed_kit_layout_and_manifest():
    root = Path(KIT_DIR)
    for p in PATHS.values():
        assert (Path(p) / "config.json").is_file() and (Path(p) / "model.safetensors").is_file(), p
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert total <= 20 * 1024 * 1024, total
    m = json.loads((root / "RECIPE.json").read_text())
    assert m["recipe_hash"].startswith("sha256:") and m["build"]["seconds"] > 0
    rows = {(r["drafter"], r["k"], r["set"]): r for r in m["measured"]["rows"]}
    assert rows[("eagle31", 3, "held-out")]["mal"] >= 3.0
    assert rows[("eagle31", 6, "held-out")]["mal"] >= 4.0
    assert all(r["lossless"].split("/")[0] == r["lossless"].split("/")[1] for r in rows.values() if r["lossless"])


def test_committed_kit_is_built_from_the_current_recipe():
    """The kit is cached by a content hash of the recipe (RECIPE, the stdlib corpus and the
    training code). A different hash means the committed kit is stale: rebuild it with
    `python -m tinykit.build models/tinykit` and re-run the benchmark."""
    from tinykit import build, corpus

    m = json.loads((Path(KIT_DIR) / "RECIPE.json").read_text())
    assert m["recipe"] == build.RECIPE
    if m["corpus"]["python"] != sys.version.split()[0]:
        pytest.skip("the corpus is this Python's stdlib; the kit was built with another version")
    desc = corpus.corpus_description(corpus.stdlib_files())
    assert build.recipe_hash(build.RECIPE, desc["sha256"]) == m["recipe_hash"]


def test_the_recipe_hash_follows_training_code_not_its_prose(tmp_path):
    """A docstring, comment or `--help` edit leaves the committed kit current; a code change does not."""
    from tinykit import build

    source = Path(build.__file__).read_text()
    assert '"""Build the whole tiny model kit' in source and r"example:\n" in source
    prose = tmp_path / "prose" / "build.py"
    prose.parent.mkdir()
    prose.write_text(
        source.replace(
            '"""Build the whole tiny model kit', '"""Build, deterministically, the whole tiny model kit'
        ).replace(r"example:\n", r"examples:\n")
        + "\n# a comment\n"
    )
    code = tmp_path / "code" / "build.py"
    code.parent.mkdir()
    code.write_text(source.replace("intermediate_size=768", "intermediate_size=512"))
    assert code.read_text() != source
    assert build.training_code(prose) == build.training_code(Path(build.__file__))
    assert build.training_code(code) != build.training_code(Path(build.__file__))


def test_committed_drafters_record_their_target():
    fp = target_config_fingerprint(PATHS["target"])
    name = json.loads((Path(KIT_DIR) / "RECIPE.json").read_text())["target_name"]
    for key, is31 in (("drafter_eagle31", True), ("drafter_eagle3", False)):
        c = _cfg(PATHS[key])
        assert c["specbatch_target"] == {"name": name, "config_fingerprint": fp}, key
        assert c["fc_norm"] is is31 and c["norm_output"] is is31 and c["norm_before_residual"] is False
        assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
        assert c["eagle_config"]["use_aux_hidden_state"] is True
        d2t = load_file(str(Path(PATHS[key]) / "model.safetensors"))["d2t"]
        ids = torch.arange(d2t.numel()) + d2t
        assert ids.unique().numel() == ids.numel() and int(ids.max()) < c["vocab_size"]


def test_mismatched_drafter_records_another_target():
    c = _cfg(PATHS["drafter_mismatched"])
    other = Path(KIT_DIR) / "other-target"
    assert c["specbatch_target"]["config_fingerprint"] != target_config_fingerprint(PATHS["target"])
    assert c["specbatch_target"]["config_fingerprint"] == target_config_fingerprint(other)
    assert c["specbatch_target"]["name"] != _cfg(PATHS["drafter_eagle31"])["specbatch_target"]["name"]
    # still loadable next to the kit's target (same hidden size and vocab): only the check can refuse it
    assert c["hidden_size"] == _cfg(PATHS["target"])["hidden_size"]
    assert max(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) <= _cfg(PATHS["target"])["num_hidden_layers"]


# ------------------------------------------------------------------ mirror of vLLM's drafter
def _mirror(target, *drafters) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tinykit.mirror_check", target, *drafters],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("MIRROR_CHECK ")]
    assert line, out.stderr[-3000:]
    return json.loads(line[0][len("MIRROR_CHECK ") :])


def test_training_drafter_mirrors_vllm_drafter_module():
    """Same weights (loaded by vLLM's loader), same inputs (real target aux states): vLLM's
    Eagle3LlamaForCausalLM and drafter.Eagle3Drafter agree on the first pass and 3 chained steps."""
    res = _mirror(PATHS["target"], PATHS["drafter_eagle31"], PATHS["drafter_eagle3"])
    for path, r in res.items():
        is31 = path.endswith("eagle31")
        assert r["vllm_fc_norm"] is is31 and r["vllm_norm_output"] is is31
        assert max(r["max_abs_diff"].values()) < 1e-3, r["max_abs_diff"]
        assert {"step3_hidden", "step3_aux_output", "first_pass_hidden"} <= set(r["max_abs_diff"])
        assert r["same_inf_mask"] and r["first_pass_argmax_equal"]
        assert r["vllm_drafts"] == r["ours_drafts"]


# ------------------------------------------------------------------ the committed kit in vLLM
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "class Counter(dict):\n    def __init__(self, iterable=None, /, **kwds):\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "def _check_arg(name, value):\n    if not isinstance(value, str):\n        raise TypeError(",
]


@pytest.fixture(scope="module")
def engine31():
    from vllm import LLM

    llm = LLM(
        model=PATHS["target"],
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        seed=0,
        kv_cache_memory_bytes=2**28,
        speculative_config={"method": "eagle3", "model": PATHS["drafter_eagle31"], "num_speculative_tokens": 3},
        per_request_spec_decode_metrics="detailed",
        disable_log_stats=False,
    )
    yield llm
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()  # free the engine's processes and KV cache for the next tests
    del llm


@pytest.mark.engine
def test_vllm_acceptance_equals_offline_simulation(engine31):
    """vLLM's per-step accepted counts equal those of the offline simulator driven by the
    training-side drafter, and the speculative output equals the target's greedy output."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from tinykit.layout import load_drafter, load_target
    from tinykit.simulate import simulate

    tok = AutoTokenizer.from_pretrained(PATHS["target"])
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    outs = engine31.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        use_tqdm=False,
    )
    target, drafter = load_target(PATHS["target"]), load_drafter(PATHS["drafter_eagle31"])
    accepted = drafts = 0
    for p, o in zip(prompts, outs):
        sim = simulate(target, drafter, p, 32, 3)
        m = o.outputs[0].spec_decode_metrics
        assert list(o.outputs[0].token_ids) == sim["output"]  # lossless vs HF greedy
        assert list(m.per_step_accepted) == sim["per_step_accepted"]  # drafter mirrors vLLM's
        accepted, drafts = accepted + sum(m.per_step_accepted), drafts + len(m.per_step_accepted)
    assert 1 + accepted / drafts >= 2.5  # a trained drafter, not a random one
