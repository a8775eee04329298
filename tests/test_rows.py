"""A data set as it is (issue 44): columns mapped by the config's `rows` section, prompts from
templates over the row's columns, columns copied to the outputs, and an Arrow type spelled two
ways read as one. On real Parquet files; one job on the kit's engine."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, parse_config
from pipeline.inputs import InputError
from pipeline.job.plan import ResultsChanged, plan_job
from tests.conftest import job_config


def readme_excerpt(marker: str) -> dict:
    """The README's YAML excerpt holding `marker` ("Bring your own data"): the jobs below run it as written."""
    import re
    from pathlib import Path

    import yaml

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if marker in b]
    return yaml.safe_load(block)


def readme_rows() -> dict:
    return readme_excerpt("id_column")["rows"]


PASSAGE_TEMPLATE = readme_rows()["prompt_template"]


def passage_table(folder, nulls=()) -> list[int]:
    """A passage-and-question table as published: integer `uid`s, `context`, `question`,
    `topic`, in two files; rows in `nulls` have a null context."""
    folder.mkdir(parents=True, exist_ok=True)
    uids = list(range(100, 112))
    for name, part in (("a", uids[:6]), ("b", uids[6:])):
        pq.write_table(
            pa.table(
                {
                    "uid": pa.array(part, pa.int64()),
                    "context": [None if u in nulls else f"The river {u} runs north past the mill." for u in part],
                    "question": [f"Where does river {u} run?" for u in part],
                    "topic": [f"rivers-{u % 3}" for u in part],
                }
            ),
            folder / f"{name}.parquet",
        )
    return uids


def rows_config(tmp_path, kit, **rows) -> dict:
    return job_config(
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        kit,
        rows=rows,
        sampling={"max_tokens": 4},
        resources={"rows_per_unit": 4},
    )


def test_a_template_that_does_not_parse_two_templates_or_a_taken_column_name_are_refused_naming_the_field(
    tmp_path, trained_kit
):
    with pytest.raises(ConfigError, match=r"rows.prompt_template does not parse \(line 1"):
        parse_config(rows_config(tmp_path, trained_kit, prompt_template="Passage: {{ context "))
    with pytest.raises(ConfigError, match=r"rows.messages_template\[1\].content does not parse"):
        parse_config(
            rows_config(
                tmp_path,
                trained_kit,
                messages_template=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{% if %}"}],
            )
        )
    with pytest.raises(ConfigError, match="give one of them, not both"):
        parse_config(
            rows_config(
                tmp_path, trained_kit, prompt_template="a", messages_template=[{"role": "user", "content": "b"}]
            )
        )
    with pytest.raises(ConfigError, match="rows.copy_columns: 'text' is a column every output row has"):
        parse_config(rows_config(tmp_path, trained_kit, copy_columns=["text"]))


def test_a_template_or_copy_naming_a_column_no_file_has_is_refused_before_any_engine(tmp_path, trained_kit):
    passage_table(tmp_path / "in")
    config = rows_config(
        tmp_path,
        trained_kit,
        id_column="uid",
        prompt_template="{{ context }} {{ answer }}",
        copy_columns=["topic", "source_url"],
    )
    with pytest.raises(InputError) as refused:
        plan_job(parse_config(config))
    message = str(refused.value)
    for file in ("a.parquet", "b.parquet"):
        assert f"{tmp_path / 'in' / file}: missing column 'answer' (rows.prompt_template)" in message, message
        assert f"{tmp_path / 'in' / file}: missing column 'source_url' (rows.copy_columns)" in message, message
    assert "missing column 'context'" not in message and "missing column 'topic'" not in message  # the files have them


def test_integer_ids_and_the_two_spellings_of_one_type_are_one_input(tmp_path, trained_kit):
    """pandas and pyarrow write one logical type two ways (string, large_string): the same
    column. An integer id column is read as strings."""
    from pipeline.inputs.units import read_unit
    from pipeline.inputs.shape import RowShape
    from pipeline.storage import Storage

    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(
        pa.table(
            {
                "qid": pa.array([1, 2], pa.int32()),
                "prompt": ["a", "b"],
                "metadata": pa.array([{"category": "x"}] * 2, pa.struct([("category", pa.string())])),
            }
        ),
        folder / "a.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "qid": pa.array([3, 4], pa.int64()),
                "prompt": pa.array(["c", "d"], pa.large_string()),
                "metadata": pa.array([{"category": "y"}] * 2, pa.struct([("category", pa.large_string())])),
            }
        ),
        folder / "b.parquet",
    )
    config = parse_config(rows_config(tmp_path, trained_kit, id_column="qid"))
    plan = plan_job(config)
    tables = [read_unit(Storage(), unit, RowShape.for_job(config)) for unit in plan.units]
    assert [t.column("id").to_pylist() for t in tables] == [["1", "2"], ["3", "4"]]
    assert {str(t.schema.field("metadata").type) for t in tables} == {"struct<category: string>"}
    assert pa.concat_tables(tables).column("prompt").to_pylist() == ["a", "b", "c", "d"]


def test_a_system_message_from_a_column_reaches_the_prompt_through_the_chat_template(tmp_path, trained_kit):
    from pipeline.inputs.units import read_unit
    from pipeline.inputs.shape import RowShape
    from pipeline.stages.preprocess import Preprocessor
    from pipeline.storage import Storage

    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(
        pa.table({"id": ["p1", "p2"], "persona": ["You are a sailor.", None], "question": ["Where to?", "Why?"]}),
        folder / "a.parquet",
    )
    config = parse_config(
        rows_config(
            tmp_path,
            trained_kit,
            messages_template=[
                {"role": "system", "content": "{{ persona }}"},
                {"role": "user", "content": "Q: {{ question }}"},
            ],
        )
    )
    (unit,) = plan_job(config).units
    assert unit.text_column == "messages"
    table = read_unit(Storage(), unit, RowShape.for_job(config))
    prepared = Preprocessor.for_job(config)(table).to_pylist()
    tokenizer = Preprocessor.for_job(config).tokenizer
    # the kit's chat template: <|role|>\ncontent\n per message, then <|assistant|>
    assert (
        tokenizer.decode(prepared[0]["prompt_token_ids"])
        == "<|system|>\nYou are a sailor.\n<|user|>\nQ: Where to?\n<|assistant|>\n"
    )
    assert (prepared[1]["error_kind"], prepared[1]["error_field"]) == ("template_error", "persona")
    assert "'persona' is null" in prepared[1]["error_message"] and prepared[1]["prompt_token_ids"] is None


def test_the_dry_run_shows_each_files_first_prompt_as_the_template_renders_it(tmp_path, capsys, trained_kit):
    import yaml

    from pipeline.cli import main

    passage_table(tmp_path / "in", nulls=(106,))  # b.parquet's first row has no passage
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(rows_config(tmp_path, trained_kit, id_column="uid", prompt_template=PASSAGE_TEMPLATE))
    )
    assert main(["run", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "first prompt | Passage: The river 100 runs north past the mill.\n"
        "              first prompt | Question: Where does river 100 run?\n"
        "              first prompt | Answer:"
    ) in out, out
    assert "first prompt | Passage: The river 106" not in out and not (tmp_path / "out").exists()


def test_an_id_repeated_in_another_unit_or_file_is_found_before_any_engine_and_is_its_rows_error(
    tmp_path, capsys, trained_kit
):
    """A new user's file with one id at rows 10 and 280 (two units) was generated twice: the
    plan's id check finds it, and every other repeat across files, in input order."""
    import yaml

    from pipeline.cli import main
    from pipeline.inputs.units import read_unit
    from pipeline.inputs.shape import RowShape
    from pipeline.stages.preprocess import Preprocessor, PreprocessSettings
    from pipeline.storage import Storage
    from schemas import DuplicateId

    folder = tmp_path / "in"
    folder.mkdir()
    ids = [f"q{i}" for i in range(300)]
    ids[280] = "q10"
    pq.write_table(pa.table({"id": ids, "prompt": [f"p{i}" for i in range(300)]}), folder / "a.parquet")
    pq.write_table(pa.table({"id": ["q5", "new", None], "prompt": ["x", "y", "z"]}), folder / "b.parquet")
    data = rows_config(tmp_path, trained_kit)
    data["resources"]["rows_per_unit"] = 64
    config = parse_config(data)
    plan = plan_job(config)
    a, b = str(folder / "a.parquet"), str(folder / "b.parquet")
    assert plan.ids.rows == 303 and plan.ids.duplicates == [
        DuplicateId(source=a, row=280, first_source=a, first_row=10),
        DuplicateId(source=b, row=0, first_source=a, first_row=5),
    ]
    preprocessor = Preprocessor(PreprocessSettings.for_job(config, plan.ids.duplicates))
    shape = RowShape.for_job(config)
    errors = {
        (r["source"], r["row"]): r
        for u in plan.units
        for r in preprocessor(read_unit(Storage(), u, shape)).to_pylist()
        if r["error_kind"]
    }
    assert sorted((k, v["error_kind"]) for k, v in errors.items()) == [
        ((a, 280), "duplicate_id"),
        ((b, 0), "duplicate_id"),
        ((b, 2), "invalid_id"),
    ]
    assert f"id 'q5' appears twice in {a} (row 5) and {b} (row 0)" in errors[(b, 0)]["error_message"]
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(data))
    assert main(["run", str(config_file), "--dry-run"]) == 0
    assert "2 rows repeat an earlier row's id" in capsys.readouterr().out


# ---------------------------------------------------------------- one job on the kit


API_SCRIPT = """
import json, sys, yaml
from pipeline import api

config, config_file = json.loads(sys.argv[1]), sys.argv[2]
with open(config_file, "w") as f:  # the refused run from a file, the real one from a dict
    yaml.safe_dump({**config, "rows": {**config["rows"], "copy_columns": ["no_such_column"]}}, f)
refused = api.run(config_file)
print("REFUSED", json.dumps([refused.status, refused.exit_code, refused.manifest is None, refused.error]))
result = api.run(config)
print("RESULT", json.dumps([result.status, result.exit_code, result.manifest.job_id, \
result.manifest.totals.output_rows]))
table, dataset = api.read_outputs(config["output_uri"]), api.read_dataset(config["output_uri"])
print("READ", json.dumps([sorted(table.column("id").to_pylist()), sorted(r["id"] for r in dataset.take_all())]))
"""


@pytest.fixture(scope="module")
def passage_job(tmp_path_factory, trained_kit):
    """12 passage rows with integer uids, one with a null passage, through a prompt template,
    the topic copied to the outputs: run by the Python API in a fresh process, after a run of
    the same job with a column no file has."""
    import json
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("rows")
    uids = passage_table(root / "in", nulls=(104,))
    data = rows_config(root, trained_kit, **readme_rows())  # uid, the passage template, topic copied
    done = subprocess.run(
        [sys.executable, "-c", API_SCRIPT, json.dumps(data), str(root / "refused.yaml")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in done.stdout.splitlines()
        if line.startswith(("REFUSED ", "RESULT ", "READ "))
    }
    return root, uids, data, said


@pytest.mark.engine
def test_the_python_api_runs_a_job_in_a_fresh_process_and_ends_as_the_cli_does(passage_job):
    root, uids, _, said = passage_job
    status, code, no_manifest, error = said["REFUSED"]
    assert (status, code, no_manifest) == (
        "refused",
        2,
        True,
    ) and "missing column 'no_such_column' (rows.copy_columns)" in error
    status, code, job_id, rows = said["RESULT"]
    assert (status, code, rows) == (
        "completed_with_errors",
        3,
        11,
    )  # 1 of 12 rows an error: above max_error_fraction 0.05
    table_ids, dataset_ids = said["READ"]  # what the committed outputs hold, read back in that process both ways
    assert table_ids == dataset_ids == sorted(str(u) for u in uids if u != 104)
    assert sorted(pq.read_table(root / "out" / "outputs").column("id").to_pylist()) == table_ids


@pytest.mark.engine
def test_the_finished_job_writes_its_data_set_card(passage_job):
    import json

    root, _, _, said = passage_job
    manifest = json.loads((root / "out" / "_job.json").read_text())
    card = (root / "out" / "README.md").read_text()
    assert card.startswith("# test: 11 generated rows\n") and f"job `{manifest['job_id']}`" in card
    assert "| rows | 11 generated (`outputs/`, 11 samples), 1 errors (`errors/`) |" in card
    assert f"(config sha256 `{manifest['model']['config_sha256'][:12]}`)" in card
    assert f"(config sha256 `{manifest['drafter']['config_sha256'][:12]}`), 3 draft tokens" in card
    assert PASSAGE_TEMPLATE in card and "`topic`" in card and "pipeline.api.run(<config of job test>)" in card


@pytest.mark.engine
def test_a_passage_table_runs_through_its_template_with_its_own_ids_and_columns(passage_job):
    root, uids, _, _ = passage_job
    outputs = pq.read_table(root / "out" / "outputs")
    errors = pq.read_table(root / "out" / "errors")
    assert sorted(outputs.column("id").to_pylist()) == sorted(str(u) for u in uids if u != 104)
    by_id = {r["id"]: r for r in outputs.select(["id", "topic", "prompt_tokens", "source", "row"]).to_pylist()}
    assert (
        by_id["107"]["topic"] == "rivers-2"
        and by_id["107"]["row"] == 1
        and by_id["107"]["source"].endswith("b.parquet")
    )
    (error,) = errors.to_pylist()
    assert (error["id"], error["error_kind"], error["field"]) == ("104", "template_error", "context")
    assert error["message"] == "column 'context' is null; the template needs it"
    assert error["source"].endswith("a.parquet") and error["row"] == 4


@pytest.mark.engine
def test_a_changed_template_under_the_finished_job_is_refused_as_a_changed_setting(passage_job):
    root, _, data, _ = passage_job
    changed = {**data, "rows": {**data["rows"], "prompt_template": "Context: {{ context }}\n{{ question }}"}}
    with pytest.raises(ResultsChanged, match="rows: prompt_template"):
        plan_job(parse_config(changed))


# ---------------------------------------------------------------- a chain: a judge job over the passage job's outputs

JUDGE = readme_excerpt("input_uri")  # the README's judge job over the first job's output location
JUDGE_TEMPLATE = JUDGE["rows"]["prompt_template"]


@pytest.mark.engine
def test_a_judge_job_reads_the_finished_jobs_outputs_and_resumes_after_its_driver_is_killed(
    passage_job, ray_local, trained_kit
):
    """The second job's input_uri is the first job's output location: it reads the committed
    output rows (ids, the generated text, the copied topic), renders its judge prompt from them,
    records the job it read, and, its driver SIGKILLed after its first commit, finishes on the
    same command: every first-job output exactly once in the judge's outputs."""
    import json
    import os
    import signal

    import yaml

    from pipeline.commit.outputs import OutputLocation
    from pipeline.job.runner import run_job
    from pipeline.storage import Storage
    from tests.test_resilience import assert_exactly_once, start_job, wait_for_commits

    root, _, _, _ = passage_job
    first = json.loads((root / "out" / "_job.json").read_text())
    judged = pq.read_table(root / "out" / "outputs").column("id").to_pylist()
    data = job_config(
        str(root / "out"),
        str(root / "judge"),
        trained_kit,
        sampling={"max_tokens": 8},
        resources={"rows_per_unit": 1, "units_in_flight": 1},
        rows=JUDGE["rows"],
    )
    config_path = root / "judge.yaml"
    config_path.write_text(yaml.safe_dump(data))
    location = OutputLocation(Storage(), str(root / "judge"))

    proc = start_job(config_path)
    wait_for_commits(location, 1, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
    proc.wait()
    assert len(location.committed_units()) < len(judged)  # the kill left units to run

    manifest = run_job(parse_config(data), progress=False)  # the same job again: it takes over the dead run's lease
    assert manifest.status == "succeeded" and len(manifest.attempts) == 2
    assert_exactly_once(location, judged)
    assert manifest.input_job.job_id == first["job_id"] and manifest.input_job.output_uri == str(root / "out")
    assert manifest.input_job.results_fingerprint == first["results_fingerprint"]
    outputs = {r["id"]: r for r in location.read_table("outputs").to_pylist()}
    first_outputs = {r["id"]: r for r in pq.read_table(root / "out" / "outputs").to_pylist()}
    assert all(outputs[i]["topic"] == first_outputs[i]["topic"] for i in judged)  # copied through both jobs
    assert all(outputs[i]["source"].startswith(str(root / "out" / "outputs")) for i in judged)  # the row it judged
    from pipeline.config.input_rows import template_environment
    from pipeline.stages.preprocess import load_tokenizer

    tokenizer, template = load_tokenizer(trained_kit["target"]), template_environment().from_string(JUDGE_TEMPLATE)
    for i in judged:  # each judge prompt: the template over the first job's output row (its text and topic), tokenized
        assert outputs[i]["prompt_tokens"] == len(tokenizer.encode(template.render(first_outputs[i]))), i


def test_a_job_that_has_not_ended_is_no_input_yet(tmp_path, trained_kit):
    from pipeline.storage import Storage

    (tmp_path / "first").mkdir()
    Storage().write_bytes(str(tmp_path / "first" / "_job.json"), json_manifest("first-1", "running"))
    data = job_config(
        str(tmp_path / "first"), str(tmp_path / "judge"), trained_kit, rows={"prompt_template": JUDGE_TEMPLATE}
    )
    with pytest.raises(InputError, match="is the output of job first-1, which has not ended"):
        plan_job(parse_config(data))


def json_manifest(job_id: str, status: str) -> bytes:
    import json

    from schemas import LAYOUT_VERSION, JobManifest, JobTotals, ModelFingerprint, Versions

    manifest = JobManifest(
        layout_version=LAYOUT_VERSION,
        job_id=job_id,
        status=status,
        started_at="2026-12-07T00:00:00+00:00",
        config={},
        versions=Versions(specbatch="dev", vllm=None, ray="x", torch=None, python="3.11"),
        model=ModelFingerprint(path="/models/t", config_sha256="abc", architectures=[]),
        accelerator="cpu",
        input_files=[],
        totals=JobTotals(),
    )
    return json.dumps(manifest.model_dump(mode="json")).encode()


@pytest.mark.engine
def test_an_incremental_run_on_the_same_location_generates_only_the_new_file_and_says_what_it_added(
    passage_job, ray_local
):
    """A scheduled run that keeps one output location per data set: the input folder gains a
    file, the same job again generates only that file's rows and records what it added; a run
    that adds nothing starts no engine. (Last in this module: the chain above read the job as it was.)"""
    from pipeline import api

    root, uids, data, _ = passage_job
    pq.write_table(
        pa.table(
            {
                "uid": pa.array([200, 201, 202], pa.int64()),
                "context": ["A lake.", "A hill.", "A road."],
                "question": ["What?", "Where?", "Why?"],
                "topic": ["new"] * 3,
            }
        ),
        root / "in" / "c.parquet",
    )
    second = api.run(data)
    assert second.status == "completed_with_errors" and len(second.manifest.attempts) == 2  # 1 error row of 15
    added = second.manifest.attempts[-1].added
    assert (added.new_input_files, added.units, added.rows, added.output_rows, added.error_rows) == (1, 1, 3, 3, 0)
    assert (
        added.generated_tokens > 0 and second.manifest.attempts[-1].units_skipped == 4
    )  # a.parquet and b.parquet: 4 + 2 rows each
    assert sorted(api.read_outputs(str(root / "out")).column("id").to_pylist()) == sorted(
        [str(u) for u in uids if u != 104] + ["200", "201", "202"]
    )
    card = (root / "out" / "README.md").read_text()
    assert (
        "| rows | 14 generated" in card
        and f"| this run | attempt 2: 3 rows added (1 new input files), {added.prompt_tokens:,} prompt and" in card
    )

    third = api.run(data)
    assert (
        third.manifest.attempts[-1].ray_cluster is None and third.manifest.attempts[-1].processed_rows == 0
    )  # no engine
