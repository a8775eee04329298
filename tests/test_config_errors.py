"""What a newcomer meets first: a config loading, its refusals, and those of `specbatch run`
before any engine starts (a model, an input, a chat template, lengths, the YAML itself). Each
names the field and ends with what to do. No engine, no Ray."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from pipeline import cli
from pipeline import config as config_module
from pipeline.config import ConfigError, JobConfig, load_config, output_inside_input, parse_config
from pipeline.config import messages as config_messages
from pipeline.stages import sampling
from tests.conftest import job_config

KIT = {"target": "/models/t", "drafter": "/models/d"}


def refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def full_config() -> dict:
    """A valid config in which every section is present, to put a typo into."""
    return job_config(
        "in",
        "out",
        KIT,
        speculative={"guard": {"min_mean_acceptance_length": 1.3}, "probe": {"rows": 0}, "num_speculative_tokens": 1},
        sampling={
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
        },
        resources={"replicas": {"min": 1, "max": 2}},
        lora={"adapters": {"a": "/adapters/a"}},
    )


def _sections() -> dict[str, type]:
    return config_messages._sections()


def _put(data: dict, path: str, key: str, value) -> None:
    node = data
    for part in [p for p in path.split(".") if p]:
        node = node.setdefault(part, {})  # a section left to its defaults is written out empty
    node[key] = value


def test_the_full_config_is_valid_and_has_every_section():
    parse_config(full_config())
    assert {
        "",
        "engine.",
        "speculative.",
        "speculative.guard.",
        "speculative.probe.",
        "sampling.",
        "sampling.response_format.",
        "sampling.response_format.json_schema.",
        "resources.",
        "resources.replicas.",
        "lora.",
        "storage.",
        "retries.",
        "lease.",
        "chat.",
        "model.",
    } <= set(_sections())


@pytest.mark.parametrize("section", sorted(_sections()))
def test_a_mistyped_key_suggests_the_closest_in_every_section(section):
    keys = config_messages._keys(_sections()[section])
    # A typo of the section's longest key (doubled last letter), which is no key anywhere.
    key = max(keys, key=len)
    typo = key + key[-1]
    data = full_config()
    _put(data, section.rstrip("."), typo, 1)
    message = refusal(data)
    assert f"{section}{typo}: unknown key; did you mean {key!r}?" in message, message


def test_the_messages_of_the_brief():
    message = refusal(job_config("in", "out", KIT, engine={"max_num_seq": 8}))
    assert "  engine.max_num_seq: unknown key; did you mean 'max_num_seqs'?" in message.splitlines()
    data = job_config("in", "out", KIT)
    data["specualtive"] = data.pop("speculative")
    assert "specualtive: unknown key; did you mean 'speculative'?" in refusal(data)


def test_a_key_in_the_wrong_section_names_its_own():
    assert "max_tokens: unknown key here; did you mean 'sampling.max_tokens'?" in refusal(
        job_config("in", "out", KIT, max_tokens=5)
    )
    assert "engine.temperature: unknown key here; did you mean 'sampling.temperature'?" in refusal(
        job_config("in", "out", KIT, engine={"temperature": 0.5})
    )


def test_a_key_like_none_lists_what_the_section_takes():
    message = refusal(job_config("in", "out", KIT, lease={"zzz": 1}))
    assert "lease.zzz: unknown key; lease takes: heartbeat_seconds, stale_after_seconds" in message


def test_a_union_section_reports_its_own_keys_only():
    """`replicas: {min, mx}`: no 'should be a valid integer' for the number replicas may also be,
    nor pydantic's member tags in the path."""
    message = refusal(job_config("in", "out", KIT, resources={"replicas": {"min": 1, "mx": 3}}))
    missing, unknown = message.splitlines()[1:]
    assert missing.startswith("  resources.replicas.max: required, and not set: ")  # then what the key is for
    assert unknown == "  resources.replicas.mx: unknown key; did you mean 'max'?"


def test_one_did_you_mean_for_config_keys_row_overrides_and_lora_names():
    from pipeline.stages import preprocess

    assert sampling.closest is config_module.closest and preprocess.closest is config_module.closest
    assert "difflib" not in open(sampling.__file__).read() and "difflib" not in open(preprocess.__file__).read()
    row = {"id": "x", "prompt": "p", "sampling": '{"top_kk": 3}'}
    defaults = JobConfig.model_validate(job_config("in", "out", KIT)).sampling
    with pytest.raises(sampling.RowError, match=r"did you mean 'top_k'\?"):
        sampling.resolve(row, defaults, defaults.model_dump())


def test_a_missing_field_says_what_it_is():
    data = job_config("in", "out", KIT)
    del data["model"]
    assert "model: required, and not set: The target model: model.path, a local folder with config.json" in refusal(
        data
    )


def test_a_refusal_names_its_field():
    with pytest.raises(ConfigError, match=r"speculative\.num_speculative_tokens"):
        parse_config(job_config("in", "out", KIT, speculative={"num_speculative_tokens": 0}))
    with pytest.raises(ConfigError, match=r"drafter is required"):
        parse_config(job_config("in", "out", KIT, speculative={"drafter": None}))
    with pytest.raises(ConfigError, match=r"gpus_per_replica"):
        parse_config(
            job_config("in", "out", KIT, engine={"tensor_parallel_size": 2}, resources={"gpus_per_replica": 1})
        )


def test_credentials_in_the_config_are_refused():
    with pytest.raises(ConfigError, match=r"storage\.aws_secret_access_key"):
        parse_config(job_config("in", "out", KIT, storage={"aws_secret_access_key": "x"}))
    with pytest.raises(ConfigError, match="must not carry credentials"):
        parse_config(job_config("in", "out", KIT, storage={"endpoint_url": "http://key:secret@127.0.0.1:9000"}))


def test_a_config_loads_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config("in", "out", KIT)))
    config = load_config(str(path), {"output_uri": "s3://b/outputs/2026-11-29/"})
    assert config.output_uri == "s3://b/outputs/2026-11-29/" and config.engine.max_model_len == 256


# ---------------------------------------------------------------- speculative is optional


def test_no_speculative_section_means_no_speculation():
    data = job_config("in", "out", KIT)
    del data["speculative"]
    job = parse_config(data)
    assert job.speculation is None and not job.speculative.enabled
    data["speculative"] = None  # `speculative:` with nothing under it
    assert parse_config(data).speculation is None
    described = JobConfig.model_fields["speculative"].description
    assert "Left out (or null): no speculation" in described


def test_a_speculative_section_without_drafter_says_what_to_set():
    message = refusal(job_config("in", "out", KIT, speculative={"drafter": None}))
    assert "set it to the EAGLE-3 drafter's folder" in message and "speculative.enabled: false" in message


# ---------------------------------------------------------------- output_uri inside input_uri


@pytest.mark.parametrize(
    "input_uri, output_uri, refused",
    [
        ("/data/prompts", "/data/prompts", True),
        ("/data/prompts", "/data/prompts/out", True),
        ("/data/prompts/", "/data/./prompts//run-1/", True),
        ("file:///data/prompts", "/data/prompts/out", True),
        ("s3://bucket/prompts", "s3://bucket/prompts/out/2026-11-29/", True),
        ("s3://bucket/prompts/", "S3://bucket//prompts/out", True),
        ("s3://bucket/prompts?versionId=1", "s3://bucket/prompts/out", True),
        ("s3://bucket/prompts/**/*.parquet", "s3://bucket/prompts/out", True),  # a recursive glob reaches it
        ("s3://bucket/prompts/*.parquet", "s3://bucket/prompts", True),  # _job.json would sit among the matches
        ("s3://bucket/prompts/*.parquet", "s3://bucket/prompts/out", False),  # the glob does not reach subfolders
        ("/data/prompts", "/data/prompts-out", False),
        ("/data/prompts", "/data/out", False),
        ("s3://bucket/prompts", "s3://bucket/prompts-out", False),
        ("s3://bucket/prompts", "/bucket/prompts/out", False),
    ],
)
def test_output_inside_input(input_uri, output_uri, refused):
    assert bool(output_inside_input(input_uri, output_uri)) == refused
    if refused:
        message = refusal(job_config(input_uri, output_uri, KIT))
        assert f"output_uri ({output_uri})" in message and f"input_uri ({input_uri})" in message
        assert "Set output_uri to a folder outside input_uri" in message


def test_output_inside_input_is_refused_at_load_with_relative_paths(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config("./prompts", "./prompts/output", KIT)))
    with pytest.raises(
        ConfigError, match=r"output_uri \(.*/prompts/output\) is inside the folder input_uri \(.*/prompts\) reads from"
    ):
        load_config(str(path))
    path.write_text(yaml.safe_dump(job_config("./prompts", "./output", KIT)))
    load_config(str(path))


def test_parameters_speculation_cannot_run_are_refused_in_the_config():
    kit = {"target": "t", "drafter": "d"}
    with pytest.raises(ConfigError, match=r"sampling\.min_p with speculative\.enabled: vLLM refuses min_p"):
        parse_config(job_config("in", "out", kit, sampling={"min_p": 0.1}))
    with pytest.raises(
        ConfigError, match=r"sampling\.temperature with speculative\.enabled: vLLM's CPU build samples wrongly"
    ):
        parse_config(job_config("in", "out", kit, sampling={"temperature": 0.7}))
    # On GPUs (vLLM's CUDA build) sampling with the drafter is vLLM's own business; without a drafter, anything goes.
    gpu = parse_config(job_config("in", "out", kit, sampling={"temperature": 0.7}, resources={"gpus_per_replica": 1}))
    assert gpu.speculation == "gpu"
    plain = parse_config(
        job_config("in", "out", kit, sampling={"temperature": 0.7, "min_p": 0.1}, speculative={"enabled": False})
    )
    assert plain.speculation is None


# ---------------------------------------------------------------- every refusal says what to do

FIX = re.compile(
    r"\b(set|use|leave|give|remove|swap|raise|lower|make it|did you mean|takes:|copy|move|add|fix|put|wait|rerun|"
    r"must be|should be|at least|extend|end its)\b",
    re.IGNORECASE,
)

INVALID = {
    "relative mount": dict(storage={"shared_mounts": ["mnt"]}),
    "credentials in the endpoint": dict(storage={"endpoint_url": "http://k:s@127.0.0.1:9000"}),
    "hub model": dict(model={"path": "hf://org/model"}),
    "guard without floor": dict(
        speculative={"guard": {"min_mean_acceptance_length": None, "min_tokens_per_target_pass": None}}
    ),
    "unknown check": dict(speculative={"checks_as_warnings": ["hiden_size"]}),
    "no drafter": dict(speculative={"drafter": None}),
    "schedule gap": dict(speculative={"depth_schedule": [[1, 2, 3], [4, 32, 1]]}),
    "schedule backwards": dict(speculative={"depth_schedule": [[1, 4, 3], [5, 3, 1]]}),
    "schedule all zero": dict(speculative={"depth_schedule": [[1, 32, 0]]}),
    "schedule short": dict(speculative={"depth_schedule": [[1, 16, 3]]}),
    "replicas range": dict(resources={"replicas": {"min": 3, "max": 2}}),
    "replicas zero": dict(resources={"replicas": 0}),
    "custom CPU resource": dict(resources={"resources_per_replica": {"CPU": 1}}),
    "lease": dict(lease={"heartbeat_seconds": 100, "stale_after_seconds": 150}),
    "gpus vs parallelism": dict(engine={"tensor_parallel_size": 2}, resources={"gpus_per_replica": 1}),
    "cpus vs parallelism": dict(engine={"tensor_parallel_size": 2}),
    "min_p with speculation": dict(sampling={"min_p": 0.1}),
    "temperature on the CPU build": dict(sampling={"temperature": 0.7}),
    "empty lora": dict(lora={"adapters": {}}),
    "output inside input": dict(output_uri="in/out"),
    "typo": dict(engine={"max_num_seq": 3}),
    "out of range": dict(speculative={"num_speculative_tokens": 0}),
    "not a choice": dict(engine={"dtype": "fp32"}),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_every_config_refusal_ends_with_what_to_do(name):
    overrides = copy.deepcopy(INVALID[name])
    data = job_config(overrides.pop("input_uri", "in"), overrides.pop("output_uri", "out"), KIT, **overrides)
    lines = refusal(data).splitlines()[1:]
    assert lines, name
    for line in lines:
        assert "Value error" not in line and "Extra inputs" not in line, line
        assert FIX.search(line), f"{name}: says what is wrong but not what to do: {line}"


# ---------------------------------------------------------------- `specbatch run` refusals, before any engine


def refused_run(capsys, config_path) -> str:
    assert cli.main(["run", str(config_path)]) == cli.EXIT["refused"]
    err = capsys.readouterr().err
    assert err.startswith("specbatch: refused: ") and "Traceback" not in err
    return err


def run_refusal(tmp_path, capsys, data: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return refused_run(capsys, path)


def write_job(tmp_path, kit: dict, columns: dict, **overrides):
    """A job of one input file with `columns`, its YAML's path."""
    from tests.conftest import write_prompts

    write_prompts(tmp_path / "in" / "chat.parquet", columns)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config(str(tmp_path / "in"), str(tmp_path / "out"), kit, **overrides)))
    return path


def test_a_missing_model_names_the_field(tmp_path, capsys):
    from tinykit import kit_paths

    kit = kit_paths()
    missing = str(tmp_path / "x" / "y")
    good = {"target": kit["target"], "drafter": kit["drafter_eagle31"]}
    err = run_refusal(
        tmp_path, capsys, job_config(str(tmp_path / "in"), str(tmp_path / "out"), {**good, "target": missing})
    )
    assert f"model.path: {missing}: no such directory (a local folder with config.json, or an s3:// URI)" in err
    err = run_refusal(
        tmp_path, capsys, job_config(str(tmp_path / "in"), str(tmp_path / "out"), {**good, "drafter": missing})
    )
    assert (
        f"speculative.drafter: {missing}: no such directory (a local folder with config.json, or an s3:// URI)" in err
    )
    err = run_refusal(
        tmp_path, capsys, job_config(str(tmp_path / "in"), str(tmp_path / "out"), good, model={"tokenizer": missing})
    )
    assert f"model.tokenizer: {missing}: no such directory" in err and "leave model.tokenizer out" in err
    (tmp_path / "empty").mkdir()
    err = run_refusal(
        tmp_path,
        capsys,
        job_config(str(tmp_path / "in"), str(tmp_path / "out"), {**good, "target": str(tmp_path / "empty")}),
    )
    assert f"model.path: {tmp_path / 'empty'}: no config.json in it" in err


def test_a_missing_model_in_object_storage_names_the_field(s3_endpoint):
    from pipeline.job.plan import model_fingerprint
    from pipeline.storage import Storage

    with pytest.raises(FileNotFoundError, match=r"^model\.path: s3://specbatch/no-such-model/: no such folder"):
        model_fingerprint("s3://specbatch/no-such-model/", Storage(endpoint_url=s3_endpoint), field="model.path")


def test_a_missing_config_file_is_a_refusal(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.yaml")]) == cli.EXIT["refused"]
    assert "nope.yaml: no such config file; give the path of a job YAML" in capsys.readouterr().err


def test_an_input_that_matches_nothing_says_what_input_uri_takes(tmp_path):
    from pipeline.inputs import InputError, inspect_inputs
    from pipeline.storage import Storage

    for uri in (tmp_path / "nothing", tmp_path / "nothing" / "*.parquet"):  # a folder, a glob
        with pytest.raises(
            InputError,
            match="matches no Parquet file.*set input_uri to a Parquet file, a folder holding .parquet files or a glob",
        ):
            inspect_inputs(str(uri), Storage())


def test_chat_input_without_a_chat_template_is_refused_naming_model_and_file(tmp_path, capsys):
    import json
    import shutil

    from tinykit import kit_paths

    kit = kit_paths()
    target = shutil.copytree(kit["target"], tmp_path / "target-no-template")
    tokenizer_config = target / "tokenizer_config.json"
    tokenizer_config.write_text(
        json.dumps({k: v for k, v in json.loads(tokenizer_config.read_text()).items() if k != "chat_template"})
    )
    path = write_job(
        tmp_path,
        {"target": str(target), "drafter": kit["drafter_eagle31"]},
        {"id": ["c1"], "messages": [[{"role": "user", "content": "hi"}]]},
        speculative={"enabled": False},
    )
    err = refused_run(capsys, path)
    assert "chat.parquet" in err and str(target) in err and "no chat template" in err
    assert not (tmp_path / "out" / "_job.json").exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"sampling": {"max_tokens": 256}},
            r"sampling.max_tokens \(256\) leaves no room .* engine.max_model_len \(256\)",
        ),
        (
            {"engine": {"max_model_len": 2048}},
            r"engine.max_model_len \(2048\) is above what .* allows \(max_position_embeddings 1024\)",
        ),
    ],
)
def test_lengths_the_model_cannot_hold_are_refused(tmp_path, capsys, overrides, expected):
    import re

    from tinykit import kit_paths

    kit = kit_paths()
    path = write_job(
        tmp_path,
        {"target": kit["target"], "drafter": kit["drafter_eagle31"]},
        {"id": ["p"], "prompt": ["x = 1"]},
        **overrides,
    )
    assert re.search(expected, refused_run(capsys, path))


def test_malformed_yaml_and_a_file_as_output_are_refused_by_name(tmp_path, capsys):
    import re

    from tinykit import kit_paths

    bad = tmp_path / "bad.yaml"
    bad.write_text("job_name: x\nmodel:\n  path: [unclosed\n")
    assert re.search(rf"{re.escape(str(bad))}, line \d+, column \d+: not valid YAML", refused_run(capsys, bad))

    kit = kit_paths()
    path = write_job(
        tmp_path, {"target": kit["target"], "drafter": kit["drafter_eagle31"]}, {"id": ["p"], "prompt": ["x = 1"]}
    )
    (tmp_path / "out").write_text("not a folder")
    assert "is a file" in refused_run(capsys, path)
