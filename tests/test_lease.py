"""The lease on an output location and the layout version, without an engine: a second run
is refused while the owner's heartbeat is fresh, a stale lease is taken over only when asked,
and a location of another output layout is refused before anything is written."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from pipeline.config import LeaseConfig, parse_config
from pipeline.lease import LeaseHeld, OutputLease
from pipeline.outputs import LayoutMismatch, OutputLocation
from pipeline.runner import run_job
from pipeline.storage import Storage
from tests.conftest import job_config

FAST = LeaseConfig(heartbeat_seconds=0.2, stale_after_seconds=1.0)


def test_a_live_lease_refuses_a_second_run_even_with_take_over(location):
    first = OutputLease(location, FAST, "job-1", 1)
    first.acquire()
    try:
        time.sleep(1.5)  # longer than stale_after: only the heartbeat keeps it live
        second = OutputLease(location, FAST, "job-1", 2)
        with pytest.raises(LeaseHeld, match=r"leased to run .*job-1, attempt 1.*alive.*--take-over") as err:
            second.acquire(take_over=True)
        assert first.lease.owner in str(err.value)
    finally:
        first.release()
    assert first.current() is None  # released: the next run just takes it
    third = OutputLease(location, FAST, "job-1", 3)
    third.acquire()
    third.release()


def test_a_stale_lease_is_taken_over_only_when_asked(location):
    dead = OutputLease(location, FAST, "job-1", 1)
    dead._write()  # a run that wrote its lease and was killed: no heartbeat follows
    time.sleep(1.2)
    successor = OutputLease(location, FAST, "job-1", 2)
    with pytest.raises(LeaseHeld, match="which is stale.*--take-over"):
        successor.acquire()
    successor.acquire(take_over=True)
    try:
        assert successor.current().owner == successor.lease.owner and successor.current().attempt == 2
    finally:
        successor.release()


def test_a_location_of_another_layout_is_refused_untouched(tmp_path):
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    old = {"job_id": "old", "status": "succeeded", "input_files": ["a.parquet"]}  # layout 1 wrote no version
    location.write_manifest(old)
    config = parse_config(job_config(str(tmp_path / "in"), str(tmp_path / "out"), {"target": "/m/t", "drafter": "/m/d"}))
    with pytest.raises(LayoutMismatch, match=r"output layout 1; this specbatch writes layout 2.*--restart"):
        run_job(config, progress=False)
    assert location.read_manifest() == old and not location.storage.exists(location.path("_lease.json"))


def test_a_manifest_that_breaks_the_contract_is_refused_naming_its_fields(tmp_path, capsys):
    """A `_job.json` of this layout that is not a manifest (a hand edit, another tool) is a refusal
    (exit 2) that names its fields, for the run, status and the report; it was a crash."""
    import yaml

    from pipeline.cli import run_from_config
    from pipeline.tools.report import ReportError, read_job
    from pipeline.tools.status import StatusError, job_status

    location = OutputLocation(Storage(), str(tmp_path / "out"))
    broken = {"layout_version": 2, "job_id": "j", "status": "finished-ish"}
    location.write_manifest(broken)
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(job_config(str(tmp_path / "in"), location.uri, {"target": "/m/t", "drafter": "/m/d"})))
    assert run_from_config(str(config_path)) == 2
    said = capsys.readouterr().err
    assert "_job.json does not match the job manifest contract" in said and "status" in said, said
    for read, error in ((lambda: job_status(location.storage, location.uri), StatusError),
                        (lambda: read_job(location.storage, location.uri), ReportError)):
        with pytest.raises(error, match=r"_job\.json does not match the job manifest contract: .*status"):
            read()
    assert location.read_manifest() == broken and not location.storage.exists(location.path("_lease.json"))


def test_a_drafter_rewritten_in_place_is_refused_on_resume(tmp_path, random_kit):
    """Same config, same size, new bytes (a retrained drafter copied over the old one): a resume
    would mix two drafters' outputs under one output location, so it is refused, naming the
    file, before any engine starts. The manifest is the one a finished job writes."""
    import shutil
    from pathlib import Path

    from pipeline.inputs import inspect_inputs
    from pipeline.job_plan import ResultsChanged, model_fingerprint, plan_job, results_fingerprint
    from pipeline.runner import versions
    from schemas import LAYOUT_VERSION, JobManifest, JobTotals
    from tests.conftest import write_prompts
    from tests.test_outputs import stats as outputs_stats

    kit = {name: str(shutil.copytree(path, tmp_path / "kit" / name)) for name, path in random_kit.items()}
    write_prompts(tmp_path / "in" / "p.parquet", {"id": ["a", "b"], "prompt": ["x", "y"]})
    config = parse_config(job_config(str(tmp_path / "in"), str(tmp_path / "out"), kit))
    location = OutputLocation(Storage(), config.output_uri)
    target, drafter = model_fingerprint(config.model.path), model_fingerprint(config.speculative.drafter)
    location.write_manifest(JobManifest(
        layout_version=LAYOUT_VERSION, job_id="j", status="succeeded", started_at="2026-12-03T00:00:00+00:00",
        config=config.redacted(), results_fingerprint=results_fingerprint(config, target, drafter), versions=versions(),
        model=target, drafter=drafter, accelerator="cpu", input_files=inspect_inputs(config.input_uri, location.storage).files,
        totals=JobTotals(input_rows=2), attempts=[],
    ).model_dump(mode="json"))
    plan = plan_job(config)
    assert plan.previous.job_id == "j" and plan.todo  # the same drafter: a resume
    location.commit(plan.todo[0].unit_id, {"outputs": pa.table({"id": ["a"]})}, outputs_stats(plan.todo[0].unit_id, rows=1, outputs=1))
    weights = Path(kit["drafter"]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    with pytest.raises(ResultsChanged, match=r"drafter files: model\.safetensors"):
        plan_job(config)


# ---------------------------------------------------------------- refused before any engine starts


def refused(capsys, config_path, *flags) -> str:
    from pipeline.cli import run_from_config

    assert run_from_config(str(config_path), *flags) == 2
    return capsys.readouterr().err


def write_job(tmp_path, kit: dict, columns: dict, **overrides):
    import yaml

    from tests.conftest import write_prompts

    write_prompts(tmp_path / "in" / "chat.parquet", columns)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config(str(tmp_path / "in"), str(tmp_path / "out"), kit, **overrides)))
    return path


def test_chat_input_without_a_chat_template_is_refused_naming_model_and_file(tmp_path, capsys):
    import json
    import shutil

    from pipeline.tinykit import kit_paths

    kit = kit_paths()
    target = shutil.copytree(kit["target"], tmp_path / "target-no-template")
    tokenizer_config = target / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({k: v for k, v in json.loads(tokenizer_config.read_text()).items() if k != "chat_template"}))
    path = write_job(tmp_path, {"target": str(target), "drafter": kit["drafter_eagle31"]},
                     {"id": ["c1"], "messages": [[{"role": "user", "content": "hi"}]]}, speculative={"enabled": False})
    err = refused(capsys, path)
    assert "chat.parquet" in err and str(target) in err and "no chat template" in err
    assert not (tmp_path / "out" / "_job.json").exists()  # nothing started, nothing written


@pytest.mark.parametrize("overrides, expected", [
    ({"sampling": {"max_tokens": 256}}, r"sampling.max_tokens \(256\) leaves no room .* engine.max_model_len \(256\)"),
    ({"engine": {"max_model_len": 2048}}, r"engine.max_model_len \(2048\) is above what .* allows \(max_position_embeddings 1024\)"),
])
def test_lengths_the_model_cannot_hold_are_refused(tmp_path, capsys, overrides, expected):
    import re

    from pipeline.tinykit import kit_paths

    kit = kit_paths()
    path = write_job(tmp_path, {"target": kit["target"], "drafter": kit["drafter_eagle31"]}, {"id": ["p"], "prompt": ["x = 1"]},
                     **overrides)
    assert re.search(expected, refused(capsys, path))


def test_malformed_yaml_and_a_file_as_output_are_refused_by_name(tmp_path, capsys):
    import re

    from pipeline.tinykit import kit_paths

    bad = tmp_path / "bad.yaml"
    bad.write_text("job_name: x\nmodel:\n  path: [unclosed\n")
    assert re.search(rf"{re.escape(str(bad))}, line \d+, column \d+: not valid YAML", refused(capsys, bad))

    kit = kit_paths()
    path = write_job(tmp_path, {"target": kit["target"], "drafter": kit["drafter_eagle31"]}, {"id": ["p"], "prompt": ["x = 1"]})
    (tmp_path / "out").write_text("not a folder")
    assert "is a file" in refused(capsys, path)


def test_a_changed_setting_blocks_a_resume_only_when_something_was_committed(tmp_path, capsys):
    """The earlier attempt committed nothing: the changed config goes ahead (here to the next
    check, which refuses its max_tokens). Once a unit is committed, the change is refused,
    naming the setting and the flag that starts over."""
    from pipeline.job_plan import model_fingerprint
    from pipeline.runner import versions
    from pipeline.tinykit import kit_paths
    from schemas import LAYOUT_VERSION, JobManifest, JobTotals

    kit = kit_paths()
    path = write_job(tmp_path, {"target": kit["target"], "drafter": kit["drafter_eagle31"]}, {"id": ["p"], "prompt": ["x = 1"]},
                     sampling={"max_tokens": 300})
    earlier = parse_config(job_config(str(tmp_path / "in"), str(tmp_path / "out"), {"target": kit["target"], "drafter": kit["drafter_eagle31"]}))
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    location.write_manifest(JobManifest(
        layout_version=LAYOUT_VERSION, job_id="earlier", status="failed", started_at="2026-11-30T00:00:00+00:00",
        config=earlier.redacted(), results_fingerprint="0" * 64, versions=versions(), model=model_fingerprint(kit["target"]),
        drafter=model_fingerprint(kit["drafter_eagle31"]), accelerator="cpu", input_files=[], totals=JobTotals(),
    ).model_dump(mode="json"))
    assert "sampling.max_tokens (300) leaves no room" in refused(capsys, path)

    location.storage.write_json(location.path("_commits", "u.json"), {})
    err = refused(capsys, path)
    assert "holds results of job earlier made with other settings (sampling: " in err and "--restart" in err
