"""The batch job end to end on real components: moto S3 on loopback, a real local Ray, vLLM's
CPU build with tiny local models. Each job run starts one engine; runs are module-scoped and
shared by the tests that read them."""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
import s3fs

from pipeline.commit.outputs import OutputLocation
from pipeline.config import parse_config
from pipeline.job.runner import run_job
from pipeline.storage import Storage
from pipeline.storage.model_cache import remote_files
from tests.conftest import job_config, record_s3_requests, write_prompts

GOOD_PROMPTS = [f"def function_{i}(x):\n    return" for i in range(12)]
GOOD_CHATS = [[{"role": "user", "content": f"import os{i}"}] for i in range(6)]

# id -> (error_kind, field) expected for each bad row
BAD_ROWS = {
    "bad-empty": ("empty_prompt", "prompt"),
    "bad-null": ("empty_prompt", "prompt"),
    "bad-long": ("prompt_too_long", "prompt"),
    "bad-max-tokens": ("invalid_sampling", "max_tokens"),
    "bad-temperature": ("invalid_sampling", "temperature"),
    "bad-top-p": ("invalid_sampling", "top_p"),
    "bad-chat-empty": ("malformed_messages", "messages"),
    "bad-chat-no-content": ("malformed_messages", "messages"),
}


def mixed_input(write) -> list[str]:
    """Two shards: plain prompts and chat messages, each with good and bad rows."""
    prompt_ids = [f"p-{i}" for i in range(len(GOOD_PROMPTS))] + [
        "bad-empty",
        "bad-null",
        "bad-long",
        "bad-max-tokens",
        "bad-temperature",
        "bad-top-p",
    ]
    n_good = len(GOOD_PROMPTS)
    write(
        "prompts-000.parquet",
        {
            "id": prompt_ids,
            "prompt": GOOD_PROMPTS + ["   ", None, "x = 1\n" * 400, "ok", "ok", "ok"],
            "max_tokens": [None] * n_good + [None, None, None, 0, None, None],
            "temperature": [None] * n_good + [None, None, None, None, -1.0, None],
            "top_p": [None] * n_good + [None, None, None, None, None, 2.0],
            "metadata": [{"n": str(i)} for i in range(len(prompt_ids))],
        },
    )
    chat_ids = [f"c-{i}" for i in range(len(GOOD_CHATS))] + ["bad-chat-empty", "bad-chat-no-content"]
    write(
        "prompts-001.parquet",
        {
            "id": chat_ids,
            "messages": GOOD_CHATS + [[], [{"role": "user", "content": None}]],
            "metadata": [{"n": str(100 + i)} for i in range(len(chat_ids))],
        },
    )
    return prompt_ids + chat_ids


@pytest.fixture(scope="module")
def s3_config(s3_endpoint, trained_kit, tmp_path_factory):
    """Spec on with the trained EAGLE-3.1 drafter; its input, its outputs, its target and its
    drafter in object storage (moto). Each process copies the models into the node's model
    cache (here a folder of the module's own, storage.model_cache_dir)."""
    from tests.test_model_cache import upload

    models = {
        "target": upload(s3_endpoint, trained_kit["target"], "models-e2e/target"),
        "drafter": upload(s3_endpoint, trained_kit["drafter"], "models-e2e/drafter-eagle31"),
    }
    cache = tmp_path_factory.mktemp("model-cache")
    return parse_config(
        job_config(
            "s3://specbatch/mixed/",
            "s3://specbatch/out-mixed/",
            models,
            storage={"endpoint_url": s3_endpoint, "model_cache_dir": str(cache)},
            retries={"max_error_fraction": 0.5},  # 8 of its 26 rows are bad on purpose
        )
    )


@pytest.fixture(scope="module")
def s3_run(s3_endpoint, ray_local, s3_config):
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    ids = mixed_input(lambda name, cols: write_prompts(f"specbatch/mixed/{name}", cols, filesystem=fs))
    manifest = run_job(s3_config, progress=False)
    return ids, manifest, OutputLocation(Storage.from_config(s3_config.storage), s3_config.output_uri)


@pytest.mark.engine
def test_a_finished_job_leaves_no_actor_behind(s3_run, ray_local):
    """The job's engine actors and its job board end with it, without waiting for Python's
    garbage collector (a reference cycle around the dataset held the board, which then sat idle
    but polling until the collector ran: one more per job run in the same process)."""
    deadline = time.time() + 30
    while True:
        alive = sorted(
            a["ActorClassName"]
            for a in ray_local._private.state.actors().values()
            if a["State"] != "DEAD" and (a["ActorClassName"] == "JobBoard" or "MapWorker" in a["ActorClassName"])
        )
        if not alive or time.time() > deadline:
            break
        time.sleep(1)
    assert not alive, alive


@pytest.mark.engine
def test_every_input_id_lands_exactly_once(s3_run):
    ids, manifest, location = s3_run
    outputs, errors = location.read_table("outputs"), location.read_table("errors")
    landed = outputs.column("id").to_pylist() + errors.column("id").to_pylist()
    assert Counter(landed) == Counter(ids), "every id exactly once across outputs/ and errors/"
    assert set(errors.column("id").to_pylist()) == set(BAD_ROWS)
    assert manifest.status == "succeeded"
    assert manifest.totals.output_rows == outputs.num_rows == len(ids) - len(BAD_ROWS)
    assert manifest.totals.error_rows == len(BAD_ROWS)


@pytest.mark.engine
def test_bad_rows_carry_file_row_field_and_reason(s3_run):
    ids, _, location = s3_run
    for row in location.read_table("errors").to_pylist():
        kind, field = BAD_ROWS[row["id"]]
        assert (row["error_kind"], row["field"], row["stage"]) == (kind, field, "validate"), row
        shard = "prompts-001" if row["id"].startswith("bad-chat") else "prompts-000"
        assert row["source"] == f"s3://specbatch/mixed/{shard}.parquet"
        shard_ids = (
            [i for i in ids if i.startswith("bad-chat") or i.startswith("c-")]
            if shard == "prompts-001"
            else [i for i in ids if not (i.startswith("bad-chat") or i.startswith("c-"))]
        )
        assert shard_ids[row["row"]] == row["id"]  # the row's position in its file
        assert row["message"]


@pytest.mark.engine
def test_a_rerun_reads_no_output_file_and_no_input_footer(s3_run, s3_config, monkeypatch):
    """A finished job rerun: the listings, its own documents and stats, nothing else. Every
    S3 request s3fs sends is recorded at its one entry point."""
    _, manifest, location = s3_run
    calls = record_s3_requests(monkeypatch)
    rerun = run_job(s3_config, progress=False)
    assert rerun.attempts[-1].units_skipped == rerun.attempts[-1].units_planned == manifest.attempts[-1].units_planned
    assert rerun.attempts[-1].footers_read == 0 and rerun.totals.output_rows == manifest.totals.output_rows
    read = [key for method, key in calls if method == "get_object"]
    assert not [k for k in read if "/outputs/" in k or "/errors/" in k or "/_commits/" in k or "mixed/prompts" in k], (
        read
    )


@pytest.mark.engine
def test_outputs_follow_contract_and_pass_metadata_through(s3_run):
    _, manifest, location = s3_run
    outputs = location.read_table("outputs")
    rows = {r["id"]: r for r in outputs.to_pylist()}
    assert rows["p-3"]["metadata"] == {"n": "3"} and rows["c-1"]["metadata"] == {"n": "101"}
    for row in rows.values():
        assert row["generated_tokens"] == 16 and row["finish_reason"] == "length"
        assert row["unit_id"].startswith(("prompts-000-r", "prompts-001-r")) and row["source"].endswith(".parquet")
        assert row["prompt_tokens"] > 0 and row["text"]
        assert row["model"].startswith("target@") and row["drafter"].startswith("drafter-eagle31@")
    # chat rows are rendered with the template, so they are longer than their content
    assert rows["c-0"]["prompt_tokens"] > 4


@pytest.mark.engine
def test_stats_rows_add_up_to_outputs(s3_run):
    ids, manifest, location = s3_run
    stats, outputs = location.read_table("stats"), location.read_table("outputs")
    assert sum(stats.column("rows").to_pylist()) == len(ids)
    assert sum(stats.column("output_rows").to_pylist()) == outputs.num_rows
    assert sum(stats.column("generated_tokens").to_pylist()) == sum(outputs.column("generated_tokens").to_pylist())
    assert sum(stats.column("draft_tokens").to_pylist()) == sum(outputs.column("draft_tokens").to_pylist())
    for row in stats.to_pylist():
        assert row["source"] and row["actor_id"] and row["node_id"]
        assert row["engine_seconds"] > 0
        assert row["tokens_per_second"] > 0 or not row["output_rows"]  # a unit of bad rows generates nothing


@pytest.mark.engine
def test_the_job_says_where_its_start_went_and_how_fast_its_engine_ran(s3_run):
    """One engine start; the start-up phases in their order on one time line, ending at the
    first commit; speeds of engine time and of wall time, and the engines' busy share."""
    _, manifest, location = s3_run
    (attempt,) = manifest.attempts
    start = attempt.start
    (engine,) = start.engine_starts
    assert engine.init_started_at <= engine.vllm_imported_at <= engine.engine_ready_at
    names = [p.name for p in start.phases]
    for before, after in [
        ("Ray start", "engine actor start"),
        ("engine actor start", "import vllm"),
        ("import vllm", "first unit"),
    ]:
        assert names.index(before) < names.index(after), names
    first_unit = start.phases[names.index("first unit")]
    assert first_unit.started_s + first_unit.seconds == pytest.approx(start.to_first_commit_seconds, abs=0.01)
    began = engine.init_started_at - start.phases[names.index("import vllm")].started_s  # the time line's zero
    first_commit = began + start.to_first_commit_seconds
    assert engine.engine_ready_at <= first_commit <= datetime.fromisoformat(attempt.ended_at).timestamp() + 1
    # the wall time begins on the same time line, before the first commit (the summary says both)
    assert (
        0
        < start.generation_started_s
        <= start.to_first_commit_seconds
        <= start.generation_started_s + attempt.wall_seconds
    )
    t = manifest.totals
    stats = location.read_table("stats").to_pylist()
    assert t.engine_busy_seconds <= sum(r["engine_seconds"] for r in stats) + 1e-6  # units overlap in the engine
    assert t.engine_tokens_per_second == pytest.approx(t.generated_tokens / t.engine_busy_seconds)
    assert t.engine_tokens_per_second > t.tokens_per_second == pytest.approx(t.generated_tokens / t.wall_seconds)
    assert t.engine_busy_share == pytest.approx(t.engine_busy_seconds / t.wall_seconds) and 0 < t.engine_busy_share < 1


@pytest.mark.engine
def test_trained_drafter_is_accepted_and_stats_are_consistent(s3_run):
    _, manifest, location = s3_run
    stats = location.read_table("stats").to_pylist()
    for row in stats:
        if row["num_drafts"]:
            assert row["acceptance_rate"] == pytest.approx(row["accepted_tokens"] / row["draft_tokens"])
            assert row["mean_acceptance_length"] == pytest.approx(1 + row["accepted_tokens"] / row["num_drafts"])
            assert len(row["accepted_per_position"]) == 3
            assert row["accepted_per_position"] == sorted(row["accepted_per_position"], reverse=True)
            assert sum(row["accepted_per_position"]) == row["accepted_tokens"]
    assert manifest.totals.acceptance_rate > 0.2  # a matched drafter: drafts are accepted


@pytest.mark.engine
def test_manifest_records_versions_fingerprints_and_no_secrets(s3_run):
    _, manifest, location = s3_run
    doc = location.read_manifest()
    assert doc["status"] == "succeeded" and doc["ended_at"]
    assert doc["versions"]["vllm"] and doc["versions"]["ray"] and doc["versions"]["torch"]
    assert len(doc["model"]["config_sha256"]) == 64 and doc["drafter"]["architectures"] == ["LlamaForCausalLMEagle3"]
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(doc["model"]["files"])
    assert doc["layout_version"] == 2 and [f["rows"] for f in doc["input_files"]] == [18, 8]
    assert doc["results_fingerprint"] and doc["attempts"][0]["status"] == "succeeded"
    assert doc["totals"]["input_rows"] == len(s3_run[0])
    assert "testing" not in json.dumps(doc)  # the secret key from the environment


@pytest.mark.engine
def test_models_in_object_storage_are_the_local_models_byte_for_byte_in_each_cache(s3_run, s3_config, trained_kit):
    """The job above read its models from object storage alone: what it generated is checked
    by the tests above; here, that its model is the kit's own (the same config, every file
    fingerprinted by its object's size and ETag) and that the node's cache holds byte-equal
    copies of what the kit ships, the driver's without the weights."""
    from pipeline.job.plan import model_fingerprint

    _, manifest, _ = s3_run
    storage = Storage.from_config(s3_config.storage)
    listed = remote_files(s3_config.model.path, storage)
    assert manifest.model.path == s3_config.model.path
    assert manifest.model.config_sha256 == model_fingerprint(trained_kit["target"]).config_sha256
    assert manifest.model.files == {name: f"{info['size']}:{info['etag']}" for name, info in listed.items()}
    entries = {
        p.name.rsplit("-", 1)[0] + (".config" if p.name.endswith(".config") else ""): p
        for p in Path(s3_config.storage.model_cache_dir).iterdir()
        if p.is_dir()
    }
    assert set(entries) == {"target", "target.config", "drafter-eagle31"}
    for name, local in [("target", trained_kit["target"]), ("drafter-eagle31", trained_kit["drafter"])]:
        shipped = {f.name: f.read_bytes() for f in Path(local).iterdir() if f.is_file()}
        assert {f.name: f.read_bytes() for f in entries[name].iterdir() if f.name in shipped} == shipped, name
    assert not (entries["target.config"] / "model.safetensors").exists()


@pytest.mark.engine
def test_a_changed_model_in_object_storage_refuses_the_resume(s3_endpoint, s3_run, s3_config):
    """The target's weights rewritten in place (a new ETag): the resume is refused before any
    engine, naming the file, as for a local model; the same bytes put back are accepted."""
    from pipeline.job.plan import ResultsChanged
    from tests.test_model_cache import put_object

    config = s3_config
    weights = f"{config.model.path}/model.safetensors"
    original = Storage.from_config(config.storage).read_bytes(weights)
    put_object(s3_endpoint, weights, original + b" ")
    try:
        with pytest.raises(ResultsChanged, match=r"model files: model\.safetensors"):
            run_job(config, progress=False)
    finally:
        put_object(s3_endpoint, weights, original)
    rerun = run_job(config, progress=False)  # nothing left to run: no engine starts
    assert rerun.attempts[-1].units_skipped == rerun.attempts[-1].units_planned and rerun.status == "succeeded"


def test_job_refuses_a_drafter_of_another_target_before_any_engine(tmp_path):
    from pipeline.speculation.drafter_check import DrafterMismatch
    from tinykit import kit_paths

    kit = kit_paths()
    write_prompts(tmp_path / "in" / "p.parquet", {"id": ["a"], "prompt": ["x = 1"]})
    config = parse_config(
        job_config(
            str(tmp_path / "in"), str(tmp_path / "out"), {"target": kit["target"], "drafter": kit["drafter_mismatched"]}
        )
    )
    with pytest.raises(DrafterMismatch, match="target_fingerprint"):
        run_job(config, progress=False)
    assert not (tmp_path / "out").exists()  # nothing written, nothing started


def test_engine_processes_talk_over_loopback(tmp_path):
    """Without VLLM_HOST_IP, vLLM picks the machine's outward interface for its engine's
    message queues; the engine environment pins it to loopback. (A subprocess: the test
    session itself sets the variable.)"""
    import os
    import subprocess
    import sys

    script = (
        "from pipeline.config import parse_config\n"
        "from pipeline.stages.engine import prepare_process_env\n"
        "from vllm.utils.network_utils import get_ip\n"
        f"prepare_process_env(parse_config({{'input_uri': '{tmp_path}/in', 'output_uri': '{tmp_path}/o',"
        " 'model': {'path': 'm'}, 'speculative': {'enabled': False}}))\n"
        "print(get_ip())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_HOST_IP"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "127.0.0.1"
