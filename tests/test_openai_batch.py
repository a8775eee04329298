"""OpenAI batch files: conversion of request lines to the prompt row contract, the job-level
refusal of lines that cannot be run, conversion once per file (local and moto S3), and the
export of an output location, read back through the `openai` package's own types, without an
engine; then one real job over a JSONL file (unsupported lines as error lines included) and its
export."""

from __future__ import annotations

import datetime as dt
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.commit.outputs import OutputLocation
from pipeline.config import ConfigError, parse_config
from pipeline.inputs import InputError
from pipeline.inputs.openai_batch import CONVERTED, LISTED_PROBLEMS, inspect_job_inputs
from pipeline.storage import Storage
from pipeline.tools.export import main as export_main
from schemas import ErrorRow, JobManifest, JobTotals, ModelFingerprint, OutputRow, Versions, arrow_schema
from tests.conftest import job_config, record_s3_requests
from tests.test_outputs import stats

KIT = {"target": "/models/t", "drafter": "/models/d"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

CHAT_1 = {
    "custom_id": "chat-1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "model": "gpt-4o-mini",
        "user": "u-7",
        "metadata": {"team": "a"},
        "store": False,
        "messages": [
            {"role": "system", "content": "You answer in JSON."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Where is"}, {"type": "text", "text": "the Louvre?"}],
            },
        ],
        "max_completion_tokens": 40,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
        "n": 2,
        "stop": "\n\n",
        "logprobs": True,
        "top_logprobs": 3,
        "presence_penalty": 0.5,
        "top_k": 20,
        "min_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}},
        "stream": False,
        "tools": None,
    },
}
CHAT_2 = {
    "custom_id": "chat-2",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Hi"}],
        "stop": ["END", "###"],
        "logprobs": True,
        "max_tokens": 8,
    },
}
COMPLETION_1 = {
    "custom_id": "cmpl-1",
    "method": "POST",
    "url": "/v1/completions",
    "body": {
        "model": "davinci-002",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "logprobs": 2,
        "echo": False,
        "stop": ["."],
        "temperature": 1,
        "frequency_penalty": 0.1,
        "structured_outputs": {"regex": "[a-z ]+"},
    },
}


def write_jsonl(path, lines) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def config_for(input_uri: str, output_uri: str, **storage):
    return parse_config(job_config(input_uri, output_uri, KIT, input_format="openai_batch", storage=storage))


def converted_files(storage: Storage, output_uri: str) -> list[str]:
    return storage.list_files(storage.join(output_uri, CONVERTED), ".parquet")


def test_a_realistic_batch_file_converts_to_the_row_contract_column_by_column(tmp_path):
    source = write_jsonl(tmp_path / "in" / "batch.jsonl", [CHAT_1, COMPLETION_1, CHAT_2, ""])
    config, storage = config_for(source, str(tmp_path / "out")), Storage()
    report = inspect_job_inputs(config, storage)

    assert report.rows == 3 and report.footers_read == 2
    by_kind = {f.uri.rsplit(".", 2)[1]: f for f in report.files}
    assert {k: (f.text_column, f.rows, f.metadata_type) for k, f in by_kind.items()} == {
        "chat": ("messages", 2, "string"),
        "completions": ("prompt", 1, "string"),
    }
    chat = pq.read_table(by_kind["chat"].uri)
    assert chat.schema.field("messages").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert chat.schema.field("stop").type == pa.list_(pa.string()) and chat.schema.field("n").type == pa.int64()
    rows = chat.to_pylist()
    assert [r["id"] for r in rows] == ["chat-1", "chat-2"]
    one, two = rows
    assert one["messages"] == [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "Where is\nthe Louvre?"},
    ]  # text parts joined as vLLM does
    assert (one["max_tokens"], one["temperature"], one["top_p"], one["seed"], one["n"]) == (40, 0.7, 0.9, 11, 2)
    assert one["stop"] == ["\n\n"] and two["stop"] == ["END", "###"]  # a string becomes a list of one
    assert json.loads(one["response_format"]) == {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
    }
    assert json.loads(one["sampling"]) == {"logprobs": 3, "presence_penalty": 0.5, "top_k": 20, "min_tokens": 2}
    assert json.loads(one["metadata"]) == {
        "url": "/v1/chat/completions",
        "model": "gpt-4o-mini",
        "file": source,
        "line": 1,
    }
    assert (two["max_tokens"], two["temperature"], two["n"], two["response_format"]) == (8, None, None, None)
    assert json.loads(two["sampling"]) == {"logprobs": 0}  # logprobs alone: the sampled token's
    assert json.loads(two["metadata"])["line"] == 3

    (cmpl,) = pq.read_table(by_kind["completions"].uri).to_pylist()
    assert "messages" not in cmpl and cmpl["prompt"] == "Once upon a time"
    assert (cmpl["id"], cmpl["max_tokens"], cmpl["temperature"], cmpl["stop"]) == ("cmpl-1", 12, 1.0, ["."])
    assert json.loads(cmpl["sampling"]) == {"logprobs": 2, "frequency_penalty": 0.1}
    assert json.loads(cmpl["response_format"]) == {"type": "regex", "regex": "[a-z ]+"}
    assert json.loads(cmpl["metadata"])["url"] == "/v1/completions"


def bad_lines():
    ok = lambda cid, **body: {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",  # noqa: E731
        "body": {"messages": [{"role": "user", "content": "x"}], **body},
    }
    return [
        ok("good-1"),
        "{not json",  # 2
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},  # 3 no custom_id
        ok("good-1"),  # 4 duplicate of line 1
        {**ok("get"), "method": "GET"},  # 5
        {**ok("emb"), "url": "/v1/embeddings"},  # 6
        ok("streamed", stream=True),  # 7
        ok("tooled", tools=[{"type": "function", "function": {"name": "f"}}]),  # 8
        {
            **ok("image"),
            "body": {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is it"},
                            {"type": "image_url", "image_url": {"url": "http://x"}},
                        ],
                    }
                ]
            },
        },  # 9
        {"custom_id": "prompts", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},  # 10
        {"custom_id": "echo", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "echo": True}},  # 11
        ok("top", top_logprobs=2),  # 12
        ok("hot", temperature="hot"),  # 13
        ok("bias", logit_bias={"50256": -100}),  # 14
        ok("kwargs", chat_template_kwargs={"enable_thinking": False}),  # 15
        ok("good-2"),  # 16
    ]


def test_every_refused_line_is_named_by_file_line_custom_id_and_field(tmp_path):
    source = write_jsonl(tmp_path / "in" / "bad.jsonl", bad_lines())
    config = config_for(source, str(tmp_path / "out"))
    with pytest.raises(InputError) as refused:
        inspect_job_inputs(config, Storage())
    message = str(refused.value)
    expected = {
        2: ("no custom_id", "(line)", "not JSON"),
        3: ("no custom_id", "custom_id", "missing"),
        4: ('custom_id "good-1"', "custom_id", "first on line 1"),
        5: ('custom_id "get"', "method", '"GET"'),
        6: ('custom_id "emb"', "url", '"/v1/embeddings"'),
        7: ('custom_id "streamed"', "body.stream", "only false"),
        8: ('custom_id "tooled"', "body.tools", "not supported"),
        9: ('custom_id "image"', "body.messages[0].content[1]", '"image_url"'),
        10: ('custom_id "prompts"', "body.prompt", "a list of prompts"),
        11: ('custom_id "echo"', "body.echo", "only false"),
        12: ('custom_id "top"', "body.top_logprobs", "requires logprobs"),
        13: ('custom_id "hot"', "body.temperature", "a number"),
        14: ('custom_id "bias"', "body.logit_bias", "not supported"),
        15: ('custom_id "kwargs"', "body.chat_template_kwargs", "not supported"),
    }
    assert f"({len(expected)} problems)" in message
    for line, (who, field, what) in expected.items():
        (found,) = [m for m in message.splitlines() if f"bad.jsonl, line {line}," in m]
        assert found.strip().startswith(f"{source}, line {line}, {who}: {field}: ") and what in found, found
    assert not [m for m in message.splitlines() if ", line 1," in m or ", line 16," in m]
    # a refused file leaves nothing behind: no converted file, no marker, no staging file
    assert Storage().list_files(str(tmp_path / "out")) == []


def test_the_listing_is_capped_and_counts_every_problem_across_files(tmp_path):
    bad = {"custom_id": "x", "method": "PUT", "url": "/v1/completions", "body": {"prompt": "p"}}
    write_jsonl(tmp_path / "in" / "a.jsonl", [{**bad, "custom_id": f"a{i}"} for i in range(25)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{**bad, "custom_id": "b0"}])
    with pytest.raises(InputError) as refused:
        inspect_job_inputs(config_for(str(tmp_path / "in"), str(tmp_path / "out")), Storage())
    lines = str(refused.value).splitlines()
    assert f"(26 problems, the first {LISTED_PROBLEMS})" in lines[0]
    assert len(lines) == 1 + LISTED_PROBLEMS + 1 and all("method" in line for line in lines[1:-1])
    assert lines[-1].startswith("Fix these lines")  # what to do comes last


def test_conversion_happens_once_and_a_changed_file_is_refused_on_resume(tmp_path):
    source = write_jsonl(tmp_path / "in" / "batch.jsonl", [CHAT_1, COMPLETION_1])
    config, storage = config_for(source, str(tmp_path / "out")), Storage()
    first = inspect_job_inputs(config, storage)
    folder = tmp_path / "out" / CONVERTED
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert sorted(n.rsplit(".", 1)[-1] for n in written) == ["json", "parquet", "parquet"]  # no staging file left
    again = inspect_job_inputs(config, storage, known=first.files)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written  # nothing converted, nothing rewritten
    assert again.files == first.files and again.footers_read == 0
    # the batch file rewritten under a job that already ran on it: resuming would mix two inputs
    write_jsonl(tmp_path / "in" / "batch.jsonl", [CHAT_1, CHAT_2, COMPLETION_1])
    with pytest.raises(InputError, match="changed since this job started"):
        inspect_job_inputs(config, storage, known=first.files)
    assert inspect_job_inputs(config, storage).rows == 3  # a new job (--restart) converts it anew


def test_conversion_on_s3_streams_and_happens_once(s3_endpoint, monkeypatch):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    with fs.open("specbatch/batches/day-1.jsonl", "w") as f:
        for i in range(3000):  # several row groups: ROWS_PER_BATCH is lowered below
            f.write(json.dumps({**CHAT_2, "custom_id": f"c-{i}"}) + "\n")
    monkeypatch.setattr("pipeline.inputs.openai_batch.ROWS_PER_BATCH", 1000)
    config = config_for("s3://specbatch/batches/*.jsonl", "s3://specbatch/jobs/oa", endpoint_url=s3_endpoint)
    storage = Storage(endpoint_url=s3_endpoint)
    report = inspect_job_inputs(config, storage)
    (file,) = report.files
    assert file.uri.startswith("s3://specbatch/jobs/oa/_inputs/day-1-") and file.rows == 3000
    with fs.open(file.uri, "rb") as f:
        parquet = pq.ParquetFile(f)
        assert parquet.metadata.num_row_groups == 3
        assert parquet.read(columns=["id"]).column("id").to_pylist()[-1] == "c-2999"
    assert not [k for k in fs.find("specbatch/jobs/oa") if ".tmp-" in k]
    calls = record_s3_requests(monkeypatch)
    assert inspect_job_inputs(config, storage, known=report.files).files == report.files
    writes = [(m, k) for m, k in calls if m in ("put_object", "copy_object", "create_multipart_upload", "upload_part")]
    assert writes == [] and not [k for m, k in calls if m == "get_object" and k.endswith(".jsonl")]


def test_input_format_is_validated_in_the_config():
    with pytest.raises(ConfigError, match="input_format"):
        parse_config(job_config("in", "out", KIT, input_format="jsonl"))
    assert parse_config(job_config("in", "out", KIT)).input_format == "parquet"


def test_unsupported_requests_errors_makes_each_such_line_its_error_row(tmp_path):
    """unsupported_requests: errors. Lines that are not JSON, lack a custom_id or repeat one are
    still refused (only they); every other line that cannot run becomes its row's
    `unsupported_request` at the preprocess stage, naming the field the refusal names, and its
    errors.jsonl line is a 400 in OpenAI's error shape. The default's refusal names the switch."""
    from openai.types import BatchError

    from pipeline.inputs.units import plan_units, read_unit
    from pipeline.stages.preprocess import PreprocessSettings, Preprocessor
    from tinykit import kit_paths
    from pipeline.tools.export import error_line

    lines = bad_lines()
    source = write_jsonl(tmp_path / "in" / "bad.jsonl", lines)
    config = parse_config(
        job_config(source, str(tmp_path / "out"), KIT, input_format="openai_batch", unsupported_requests="errors")
    )
    with pytest.raises(InputError) as refused:
        inspect_job_inputs(config, Storage())
    message = str(refused.value)
    assert "(3 problems)" in message and all(f"bad.jsonl, line {n}," in message for n in (2, 3, 4)), message
    assert "or set unsupported_requests" not in message  # the switch is on: no hint
    with pytest.raises(InputError, match="or set unsupported_requests: errors to run the rest"):
        inspect_job_inputs(config_for(source, str(tmp_path / "out-refused")), Storage())

    write_jsonl(tmp_path / "in" / "bad.jsonl", [lines[0], *lines[4:]])
    report = inspect_job_inputs(config, Storage())
    preprocess = Preprocessor(PreprocessSettings(kit_paths()["target"], 256))
    rows = [r for unit in plan_units(report.files, 100) for r in preprocess(read_unit(Storage(), unit)).to_pylist()]
    by_id = {r["id"]: r for r in rows}
    fields = {
        "get": "method",
        "emb": "url",
        "streamed": "body.stream",
        "tooled": "body.tools",
        "image": "body.messages[0].content[1]",
        "prompts": "body.prompt",
        "echo": "body.echo",
        "top": "body.top_logprobs",
        "hot": "body.temperature",
        "bias": "body.logit_bias",
        "kwargs": "body.chat_template_kwargs",
    }
    assert sorted(by_id) == sorted([*fields, "good-1", "good-2"]) and len(rows) == len(by_id)
    for custom_id, field in fields.items():
        row = by_id[custom_id]
        assert (row["error_kind"], row["error_field"]) == ("unsupported_request", field) and row["error_message"], row
        assert row["prompt_token_ids"] is None
    assert by_id["good-1"]["error_kind"] is None and by_id["good-2"]["prompt_token_ids"]
    error = {
        "id": "bias",
        "error_kind": "unsupported_request",
        "field": "body.logit_bias",
        "stage": "validate",
        "message": by_id["bias"]["error_message"],
        "retryable": False,
    }
    line = error_line(error, "job-1")
    assert line["response"]["status_code"] == 400 and line["response"]["body"]["error"]["param"] == "body.logit_bias"
    assert BatchError.model_validate(line["error"]).code == "unsupported_request"


def test_unsupported_requests_is_for_batch_files_only():
    with pytest.raises(ConfigError, match="unsupported_requests: errors applies to OpenAI batch files only"):
        parse_config(job_config("in", "out", KIT, unsupported_requests="errors"))
    assert parse_config(job_config("in", "out", KIT)).unsupported_requests == "refuse"


# ---------------------------------------------------------------- export


def output_table(rows: list[dict]) -> pa.Table:
    """outputs/ rows of the output contract, as the engine actor writes them."""
    defaults = dict(
        stop_reason=None,
        parsed=None,
        parse_error=None,
        reasoning=None,
        logprobs=None,
        prompt_logprobs=None,
        draft_tokens=0,
        accepted_tokens=0,
        num_drafts=0,
        mean_acceptance_length=1.0,
        max_tokens_clipped=False,
        model="target@abc",
        drafter=None,
        source="in.parquet",
    )
    return pa.Table.from_pylist([{**defaults, **r} for r in rows], schema=arrow_schema(OutputRow, metadata=pa.string()))


def error_table(rows: list[dict]) -> pa.Table:
    defaults = dict(source="in.parquet", field=None, retryable=False)
    return pa.Table.from_pylist([{**defaults, **r} for r in rows], schema=arrow_schema(ErrorRow))


def meta(url: str, line: int, model: str | None = "gpt-4o-mini") -> str:
    return json.dumps({"url": url, "model": model, "file": "batch.jsonl", "line": line})


def token(tid: int, text: str, lp: float, top=()) -> dict:
    return {
        "token_id": tid,
        "token": text,
        "logprob": lp,
        "top_logprobs": [{"token_id": i, "token": t, "logprob": p} for i, t, p in top],
    }


def write_manifest(location: OutputLocation, status: str) -> None:
    manifest = JobManifest(
        layout_version=2,
        job_id="job-7",
        status=status,
        started_at="2026-11-29T10:00:00+00:00",
        ended_at="2026-11-29T11:00:00+00:00",
        config={"input_format": "openai_batch"},
        versions=Versions(specbatch="dev", vllm=None, ray="x", torch=None, python="3.11"),
        model=ModelFingerprint(path="/models/t", config_sha256="abc", architectures=[]),
        accelerator="cpu",
        input_files=[],
        totals=JobTotals(input_rows=6),
    )
    location.write_manifest(manifest.model_dump(mode="json"))


def build_location(location: OutputLocation) -> None:
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    u1 = output_table(
        [
            dict(
                id="chat-1",
                sample_index=1,
                text='{"city": "Lyon"}',
                finish_reason="stop",
                prompt_tokens=20,
                generated_tokens=7,
                row=0,
                unit_id="u1",
                metadata=meta(chat, 1),
                logprobs=[
                    token(5, "{", -0.1, [(5, "{", -0.1), (9, " {", -2.5)]),
                    token(6, "é", -0.3, [(6, "é", -0.3)]),
                ],
            ),
            dict(
                id="chat-1",
                sample_index=0,
                text='{"city": "Paris"}',
                finish_reason="stop",
                stop_reason="\n\n",
                reasoning="The Louvre is in Paris.",
                prompt_tokens=20,
                generated_tokens=8,
                row=0,
                unit_id="u1",
                metadata=meta(chat, 1),
                logprobs=[token(5, "{", -0.05, [(5, "{", -0.05)])],
            ),
            dict(
                id="chat-2",
                sample_index=0,
                text="Hello",
                finish_reason="length",
                prompt_tokens=5,
                generated_tokens=8,
                row=1,
                unit_id="u1",
                metadata=meta(chat, 3, model=None),
            ),
        ]
    )
    u2 = output_table(
        [
            dict(
                id="cmpl-1",
                sample_index=0,
                text=" there was",
                finish_reason="stop",
                prompt_tokens=4,
                generated_tokens=2,
                row=0,
                unit_id="u2",
                metadata=meta("/v1/completions", 2, "davinci-002"),
                logprobs=[token(1, " there", -0.5, [(1, " there", -0.5), (2, " a", -1.5)]), token(3, " was", -0.2, [])],
            ),
        ]
    )
    location.commit(
        "u1",
        {
            "outputs": u1,
            "errors": error_table(
                [
                    dict(
                        id="chat-3",
                        row=2,
                        stage="validate",
                        error_kind="invalid_sampling",
                        field="temperature",
                        message="temperature 7.0 is above 2",
                        unit_id="u1",
                    )
                ]
            ),
        },
        stats("u1", 4, 3),
    )
    location.commit(
        "u2",
        {
            "outputs": u2,
            "errors": error_table(
                [
                    dict(
                        id="cmpl-2",
                        row=1,
                        stage="generate",
                        error_kind="engine_error",
                        message="engine died",
                        retryable=True,
                        unit_id="u2",
                    )
                ]
            ),
        },
        stats("u2", 2, 1),
    )
    location.write_files(
        "u3",
        {
            "outputs": output_table(
                [
                    dict(  # never committed: invisible
                        id="ghost",
                        sample_index=0,
                        text="x",
                        finish_reason="stop",
                        prompt_tokens=1,
                        generated_tokens=1,
                        row=0,
                        unit_id="u3",
                        metadata=meta(cmpl, 9),
                    )
                ]
            )
        },
        stats("u3", 1, 1),
    )
    write_manifest(location, "completed_with_errors")


def read_jsonl(storage: Storage, uri: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_bytes(uri).decode().splitlines()]


def test_the_export_reads_back_through_openai_types(location, capsys):
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    build_location(location)
    storage = location.storage
    endpoint = ["--endpoint-url", storage.endpoint_url] if storage.endpoint_url else []
    assert export_main(["--format", "openai_batch", location.uri, *endpoint]) == 0
    dest = location.path("export", "openai_batch")
    assert "3 results and 2 errors from 2 units" in capsys.readouterr().out

    results = {line["custom_id"]: line for line in read_jsonl(storage, f"{dest}/results.jsonl")}
    assert list(results) == ["chat-1", "chat-2", "cmpl-1"]  # one line per custom_id; the uncommitted unit is not there
    for line in results.values():
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"].startswith("req_")

    one = ChatCompletion.model_validate(results["chat-1"]["response"]["body"])
    assert (
        one.object == "chat.completion" and one.model == "target@abc"
    )  # what generated it, not the name the line asked for
    assert [c.index for c in one.choices] == [0, 1]  # samples grouped, by sample_index
    assert [c.message.content for c in one.choices] == ['{"city": "Paris"}', '{"city": "Lyon"}']
    assert one.choices[0].message.role == "assistant" and one.choices[0].finish_reason == "stop"
    assert one.choices[0].model_extra["stop_reason"] == "\n\n"
    assert one.choices[0].message.model_extra["reasoning"] == "The Louvre is in Paris."
    assert (one.usage.prompt_tokens, one.usage.completion_tokens, one.usage.total_tokens) == (20, 15, 35)
    second = one.choices[1].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in second] == [("{", -0.1, [123]), ("é", -0.3, [195, 169])]
    assert [(t.token, t.logprob) for t in second[0].top_logprobs] == [("{", -0.1), (" {", -2.5)]
    assert one.created == int(
        dt.datetime(2026, 11, 29, 11, tzinfo=dt.timezone.utc).timestamp()
    )  # the job's end, not the export's time: exporting twice gives the same file

    two = ChatCompletion.model_validate(results["chat-2"]["response"]["body"])
    assert two.model == "target@abc"  # no body.model in the request: the same
    assert two.choices[0].finish_reason == "length" and two.choices[0].logprobs is None

    cmpl = Completion.model_validate(results["cmpl-1"]["response"]["body"])
    assert cmpl.object == "text_completion" and cmpl.model == "target@abc" and cmpl.choices[0].text == " there was"
    lp = cmpl.choices[0].logprobs
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == ([" there", " was"], [-0.5, -0.2], [0, 6])
    assert lp.top_logprobs == [{" there": -0.5, " a": -1.5}, {}]
    assert (cmpl.usage.prompt_tokens, cmpl.usage.completion_tokens) == (4, 2)

    errors = {line["custom_id"]: line for line in read_jsonl(storage, f"{dest}/errors.jsonl")}
    assert list(errors) == ["chat-3", "cmpl-2"]
    bad, died = errors["chat-3"], errors["cmpl-2"]
    assert BatchError.model_validate(bad["error"]).code == "invalid_sampling"
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == "temperature"
    assert BatchError.model_validate(died["error"]).message == "engine died" and died["response"]["status_code"] == 500


def test_export_refuses_a_running_job_and_writes_nothing(tmp_path, capsys):
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    build_location(location)
    write_manifest(location, "running")
    assert export_main(["--format", "openai_batch", location.uri, "--to", str(tmp_path / "exp")]) == 2
    err = capsys.readouterr().err
    assert "job job-7 is running" in err and "rerun `specbatch run`" in err
    assert not os.path.exists(tmp_path / "exp")


def test_export_is_a_specbatch_subcommand_whose_help_ends_with_an_example(capsys):
    from pipeline.cli import main

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert (
        capsys.readouterr().out.rstrip().splitlines()[-1].strip().startswith("specbatch export --format openai_batch ")
    )


# ---------------------------------------------------------------- end to end


@pytest.mark.engine
def test_a_batch_file_runs_through_the_engine_and_exports(tmp_path, ray_local, capsys):
    """JSONL in, a real job on vLLM's CPU build with the kit's EAGLE-3.1 drafter, export out, read
    back through the openai package; a rerun converts nothing and starts no engine."""
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    from pipeline.job.runner import run_job
    from tinykit import kit_paths

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    chat = lambda cid, body: {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",  # noqa: E731
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "import os"}], **body},
    }
    lines = [
        chat("lp", {"logprobs": True, "top_logprobs": 2, "max_tokens": 8}),
        chat(
            "json",
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
                "max_tokens": 24,
            },
        ),
        chat("sampled", {"n": 2, "temperature": 0.7}),  # refused per row: the CPU build cannot sample with the drafter
        {
            "custom_id": "cmpl",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "davinci-002",
                "prompt": "def f(x):\n    return",
                "max_tokens": 12,
                "stop": ["\n"],
                "logprobs": 1,
            },
        },
        {"custom_id": "min-p", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x = ", "min_p": 0.1}},
        chat("tooled", {"tools": [{"type": "function", "function": {"name": "f"}}]}),  # unsupported: its error line
        {
            "custom_id": "other-model",
            "method": "POST",
            "url": "/v1/completions",  # vLLM's run-batch test line
            "body": {"model": "NonExistModel", "prompt": "x = ", "max_tokens": 4},
        },
    ]
    write_jsonl(tmp_path / "batch" / "requests.jsonl", lines)
    kit = kit_paths()
    config = parse_config(
        job_config(
            str(tmp_path / "batch"),
            str(tmp_path / "out"),
            {"target": kit["target"], "drafter": kit["drafter_eagle31"]},
            input_format="openai_batch",
            unsupported_requests="errors",
            engine={"json_whitespace": False},
            retries={"max_error_fraction": 0.6},
            model={"served_names": ["gpt-4o-mini", "davinci-002"]},
        )
    )
    manifest = run_job(config, progress=False)
    assert (manifest.status, manifest.totals.input_rows, manifest.totals.error_rows) == (
        "succeeded",
        7,
        4,
    )  # within 0.6
    location = OutputLocation(Storage(), config.output_uri)
    stats = location.read_table("stats").to_pylist()
    assert sum(s["draft_tokens"] for s in stats) > 0  # the drafter ran

    assert export_main(["--format", "openai_batch", config.output_uri]) == 0
    capsys.readouterr()
    dest = location.path("export", "openai_batch")
    results = {line["custom_id"]: line for line in read_jsonl(location.storage, f"{dest}/results.jsonl")}
    errors = {line["custom_id"]: line for line in read_jsonl(location.storage, f"{dest}/errors.jsonl")}
    assert sorted(results) == ["cmpl", "json", "lp"] and sorted(errors) == ["min-p", "other-model", "sampled", "tooled"]

    outputs = {o["id"]: o for o in location.read_table("outputs").to_pylist()}
    lp = ChatCompletion.model_validate(results["lp"]["response"]["body"])
    content = lp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == lp.choices[0].message.content == outputs["lp"]["text"]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)  # greedy
    assert lp.usage.completion_tokens == outputs["lp"]["generated_tokens"] == len(content)
    answer = ChatCompletion.model_validate(results["json"]["response"]["body"]).choices[0].message.content
    assert set(json.loads(answer)) == {"n"} and outputs["json"]["parsed"] is True
    cmpl = Completion.model_validate(results["cmpl"]["response"]["body"])
    assert cmpl.model == outputs["cmpl"]["model"] and cmpl.model.startswith("target@")  # the model that wrote it
    assert "\n" not in cmpl.choices[0].text and cmpl.choices[0].logprobs.tokens
    other = errors["other-model"]["response"]
    assert (other["status_code"], other["body"]["error"]["code"], other["body"]["error"]["param"]) == (
        400,
        "model_not_found",
        "body.model",
    )
    assert "The model `NonExistModel` does not exist" in other["body"]["error"]["message"]
    assert BatchError.model_validate(errors["sampled"]["error"]).code == "invalid_sampling"
    assert "min_p" in BatchError.model_validate(errors["min-p"]["error"]).message
    tooled = errors["tooled"]["response"]
    assert tooled["status_code"] == 400 and tooled["body"]["error"]["param"] == "body.tools"
    assert BatchError.model_validate(errors["tooled"]["error"]).code == "unsupported_request"

    converted = converted_files(location.storage, config.output_uri)
    again = run_job(config, progress=False)
    assert again.attempts[-1].processed_rows == 0 and again.attempts[-1].ray_cluster is None  # no engine
    assert converted_files(location.storage, config.output_uri) == converted
