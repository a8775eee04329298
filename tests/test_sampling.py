"""Sampling as dataset generation needs it, end to end on vLLM's CPU build with the kit's
EAGLE-3.1 drafter: n samples per prompt, structured output, logprobs, stop strings, per-row
overrides, and the same greedy output with the drafter as without it.

One input holds a few rows of each kind; it runs twice (drafter on, drafter off) and the
tests read the two runs."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from pipeline.commit.outputs import OutputLocation
from pipeline.config import SamplingConfig, parse_config
from pipeline.job.runner import run_job
from pipeline.stages.sampling import RowError, resolve
from pipeline.storage import Storage
from tests.conftest import job_config, write_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}
JSON_FORMAT = json.dumps({"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}})
CHOICES = ["yes", "no", "maybe"]
REGEX = "[0-9]{3}-[a-z]{2}"
SYSTEM_PROMPT = "You write Python."


def _rows() -> dict[str, dict]:
    rows = {}
    for i in range(4):
        code = f"def function_{i}(x):\n    return"
        rows[f"n-{i}"] = {"prompt": code, "n": 4, "temperature": 0.8, "seed": 100 + i}
        rows[f"json-{i}"] = {"prompt": f"item_{i} = ", "response_format": JSON_FORMAT, "max_tokens": 64}
        rows[f"choice-{i}"] = {
            "prompt": f"answer_{i} = ",
            "response_format": json.dumps({"type": "choice", "choice": CHOICES}),
        }
        rows[f"regex-{i}"] = {
            "prompt": f"code_{i} = ",
            "response_format": json.dumps({"type": "regex", "regex": REGEX}),
        }
        rows[f"lp-{i}"] = {"prompt": code, "sampling": json.dumps({"logprobs": 3, "prompt_logprobs": 2})}
        rows[f"stop-{i}"] = {"prompt": f"import os\nimport sys\nx_{i} = 1\n", "stop": ["\n"], "max_tokens": 48}
    rows["json-cut"] = {"prompt": "item = ", "response_format": JSON_FORMAT, "max_tokens": 3}
    rows["bad-key"] = {"prompt": "x", "sampling": json.dumps({"top_kk": 5})}
    rows["bad-format"] = {"prompt": "x", "response_format": json.dumps({"type": "regex"})}
    rows["bad-json"] = {"prompt": "x", "sampling": "{top_k: 5"}
    rows["bad-job-key"] = {"prompt": "x", "sampling": json.dumps({"clip_max_tokens": False})}
    rows["n-twin"] = dict(rows["n-0"])  # the same prompt and seed as n-0, in another unit
    return rows


SAMPLED = {f"n-{i}" for i in range(4)} | {"n-twin"}
BAD = {
    "bad-key": ("invalid_sampling", "sampling.top_kk"),
    "bad-format": ("invalid_sampling", "response_format"),
    "bad-json": ("invalid_sampling", "sampling"),
    "bad-job-key": ("invalid_sampling", "sampling.clip_max_tokens"),
}
GREEDY = ("json-", "choice-", "regex-", "lp-", "stop-")


def _input(folder) -> None:
    rows = _rows()
    columns = {
        "id": list(rows),
        "prompt": [r["prompt"] for r in rows.values()],
        "n": [r.get("n") for r in rows.values()],
        "temperature": [r.get("temperature") for r in rows.values()],
        "seed": [r.get("seed") for r in rows.values()],
        "max_tokens": [r.get("max_tokens") for r in rows.values()],
        "stop": [r.get("stop") for r in rows.values()],
        "response_format": [r.get("response_format") for r in rows.values()],
        "sampling": [r.get("sampling") for r in rows.values()],
    }
    write_prompts(folder / "prompts.parquet", columns)
    chat_ids = [f"chat-{i}" for i in range(2)]
    write_prompts(
        folder / "chats.parquet",
        {
            "id": chat_ids,
            "messages": [[{"role": "user", "content": f"import os{i}"}] for i in range(2)],
            "sampling": [json.dumps({"prompt_logprobs": 0})] * 2,
        },
    )


def _run(root, kit, speculative: bool):
    _input(root / "in")
    config = parse_config(
        job_config(
            str(root / "in"),
            str(root / "out"),
            kit,
            speculative={"enabled": speculative},
            engine={"json_whitespace": False},
            sampling={"max_tokens": 16},
            chat={"system_prompt": SYSTEM_PROMPT, "template_kwargs": {"enable_thinking": False}},
            retries={"max_error_fraction": 0.5},
        )
    )
    manifest = run_job(config, progress=False)
    location = OutputLocation(Storage(), config.output_uri)
    return manifest, location.read_table("outputs").to_pylist(), location.read_table("errors").to_pylist(), location


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory, ray_local, trained_kit):
    return _run(tmp_path_factory.mktemp("sampling-spec"), trained_kit, speculative=True)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, ray_local, trained_kit):
    return _run(tmp_path_factory.mktemp("sampling-plain"), trained_kit, speculative=False)


def _by_id(outputs: list[dict]) -> dict[str, list[dict]]:
    grouped = defaultdict(list)
    for row in outputs:
        grouped[row["id"]].append(row)
    return {i: sorted(rows, key=lambda r: r["sample_index"]) for i, rows in grouped.items()}


# ---------------------------------------------------------------- per-row overrides, no engine


def test_row_overrides_come_from_columns_and_the_sampling_object():
    defaults = SamplingConfig(max_tokens=32, temperature=0.5)
    values = defaults.model_dump()
    row = {
        "max_tokens": 8,
        "stop": ["\n"],
        "sampling": json.dumps({"top_k": 20, "presence_penalty": 0.5, "logprobs": 2}),
    }
    resolved = resolve(row, defaults, values)
    assert (resolved.max_tokens, resolved.stop, resolved.top_k, resolved.presence_penalty, resolved.logprobs) == (
        8,
        ["\n"],
        20,
        0.5,
        2,
    )
    assert resolved.temperature == 0.5  # the job's default where the row says nothing
    assert resolve({}, defaults, values) is defaults


@pytest.mark.parametrize(
    "row, field, words",
    [
        ({"sampling": json.dumps({"min_pp": 0.1})}, "sampling.min_pp", "did you mean 'min_p'"),
        ({"sampling": json.dumps({"logprobs": 50})}, "sampling.logprobs", "less than or equal to 20"),
        ({"sampling": "[1, 2]"}, "sampling", "must be a JSON object"),
        ({"response_format": json.dumps({"type": "choice", "choice": []})}, "response_format", "choice is empty"),
        (
            {"response_format": json.dumps({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})},
            "response_format.json_schema",
            "not a valid JSON Schema",
        ),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 2}, "n", "only at a temperature above 0"),
        ({"temperature": float("nan")}, "temperature", "NaN"),
    ],
)
def test_a_bad_override_is_the_rows_error_naming_the_field(row, field, words):
    defaults = SamplingConfig()
    with pytest.raises(RowError) as err:
        resolve(row, defaults, defaults.model_dump())
    assert err.value.kind == "invalid_sampling" and err.value.field == field and words in err.value.message


def test_a_format_or_reasoning_parser_vllm_cannot_use_is_refused_before_any_engine(tmp_path, trained_kit):
    from pipeline.config import ConfigError

    write_prompts(tmp_path / "in" / "p.parquet", {"id": ["a"], "prompt": ["x = 1"]})
    base = dict(input_uri=str(tmp_path / "in"), output_uri=str(tmp_path / "out"), kit=trained_kit)
    grammar = job_config(**base, sampling={"response_format": {"type": "grammar", "grammar": "root ::= ("}})
    with pytest.raises(ConfigError, match=r"sampling\.response_format: vLLM cannot compile it"):
        run_job(parse_config(grammar), progress=False)
    parser = job_config(**base, chat={"reasoning_parser": "deepseek_r1"})
    with pytest.raises(ConfigError, match=r"chat\.reasoning_parser: .*could not locate think start/end tokens"):
        run_job(parse_config(parser), progress=False)
    unknown = job_config(**base, chat={"reasoning_parser": "deepseek"})
    with pytest.raises(ConfigError, match=r"chat\.reasoning_parser: 'deepseek' is not one of vLLM's reasoning parsers"):
        run_job(parse_config(unknown), progress=False)
    assert not (tmp_path / "out").exists()  # refused before the job wrote anything


def test_a_rows_format_vllm_cannot_compile_is_its_error(trained_kit):
    from pipeline.stages.preprocess import PreprocessSettings, Preprocessor

    pre = Preprocessor(PreprocessSettings(trained_kit["target"], 256))
    bad = {"prompt": "x = ", "response_format": json.dumps({"type": "grammar", "grammar": "root ::= ("})}
    with pytest.raises(RowError) as err:
        pre.prepare(bad, "prompt")
    assert (err.value.kind, err.value.field) == ("invalid_response_format", "response_format")
    assert "Invalid grammar specification" in err.value.message
    good = {"prompt": "x = ", "response_format": json.dumps({"type": "regex", "regex": "[0-9]+"})}
    assert json.loads(pre.prepare(good, "prompt")["sampling"])["response_format"]["regex"] == "[0-9]+"


def test_a_reasoning_parser_splits_the_reasoning_off_the_answer(trained_kit):
    """The kit's tokenizer has no <think> markers (refused above); with them added, as a
    reasoning model's tokenizer has them, vLLM's deepseek_r1 parser splits each output."""
    from transformers import AutoTokenizer

    from pipeline.stages.completions import reasoning_parser, split_reasoning

    tokenizer = AutoTokenizer.from_pretrained(trained_kit["target"])
    tokenizer.add_tokens(["<think>", "</think>"])
    parser = reasoning_parser("deepseek_r1", tokenizer)
    assert split_reasoning(parser, "<think>2 + 2 is 4</think>The answer is 4.") == ("2 + 2 is 4", "The answer is 4.")
    assert split_reasoning(None, "plain") == (None, "plain")


# ---------------------------------------------------------------- end to end


@pytest.mark.engine
def test_n_samples_land_as_one_row_each_and_seeded_samples_repeat(plain_run):
    """Sampled at temperature 0.8 without the drafter: vLLM's CPU build samples wrongly with it
    (docs/sampling.md), and the job refuses that (next test)."""
    manifest, outputs, errors, location = plain_run
    by_id = _by_id(outputs)
    for i in range(4):
        samples = by_id[f"n-{i}"]
        assert [s["sample_index"] for s in samples] == [0, 1, 2, 3]
        assert len({s["text"] for s in samples}) > 1  # sampled, not four copies
    # The same prompt and seed in another unit, beside other requests: the same four samples.
    assert [s["text"] for s in by_id["n-twin"]] == [s["text"] for s in by_id["n-0"]]
    stats = location.read_table("stats").to_pylist()
    assert sum(s["samples"] for s in stats) == len(outputs)
    assert sum(s["output_rows"] for s in stats) == len(by_id) == manifest.totals.output_rows
    assert manifest.totals.samples == len(outputs) == len(by_id) + 5 * 3  # n-0..3 and n-twin: 3 more rows each


@pytest.mark.engine
def test_sampling_with_the_drafter_on_the_cpu_build_is_refused_per_row(spec_run):
    _, outputs, errors, _ = spec_run
    refused = {e["id"]: e for e in errors if e["id"] in SAMPLED}
    assert set(refused) == SAMPLED and not SAMPLED & {o["id"] for o in outputs}
    assert all(e["field"] == "temperature" and "CPU build samples wrongly" in e["message"] for e in refused.values())


@pytest.mark.engine
def test_unit_stats_sum_the_acceptance_of_their_rows(spec_run):
    _, outputs, _, location = spec_run
    stats = location.read_table("stats").to_pylist()
    for column in ("draft_tokens", "accepted_tokens", "num_drafts"):
        assert sum(s[column] for s in stats) == sum(o[column] for o in outputs) > 0


def test_acceptance_of_a_request_sums_every_sample():
    """vLLM keeps speculative-decoding metrics per sample. n > 1 needs a temperature above 0,
    which vLLM's CPU build cannot sample with the drafter (refused above), so no engine here
    drafts for n > 1: the request is built from vLLM's own output types, as its engine fills them."""
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    from pipeline.stages.completions import output_rows

    def sample(index, histogram, drafted):
        metrics = RequestSpecDecodeMetrics(num_spec_tokens=3, histogram=histogram, num_draft_tokens=drafted)
        return CompletionOutput(
            index, f"s{index}", [1, 2, 3], None, None, finish_reason="length", spec_decode_metrics=metrics
        )

    request = RequestOutput("r", None, [5, 6], None, [sample(1, [1, 0, 1, 0], 6), sample(0, [0, 1, 0, 1], 6)], True)
    rows, total = output_rows(request, {"response_format": None}, str)
    assert [r["sample_index"] for r in rows] == [0, 1]
    assert [(r["num_drafts"], r["accepted_tokens"]) for r in rows] == [(2, 4), (2, 2)]
    assert (total.num_drafts, total.draft_tokens, total.accepted_tokens) == (4, 12, 6)
    assert total.accepted_per_position == [3, 2, 1]


def test_a_units_prompt_and_cached_tokens_count_each_request_once():
    """vLLM reports the prompt tokens its prefix cache served per request (None when it has no
    figure): counted once per request whatever its n, as its prompt tokens are."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from pipeline.config import SpeculativeConfig
    from pipeline.stages.unit_results import Identity, collect, unit_stats

    def request(n, cached):
        samples = [CompletionOutput(i, f"s{i}", [1, 2], None, None, finish_reason="length") for i in range(n)]
        return RequestOutput("r", None, list(range(40)), None, samples, True, num_cached_tokens=cached)

    rows = [
        {
            "id": f"r{i}",
            "source": "s",
            "row": i,
            "unit_id": "u",
            "lora": None,
            "error_kind": None,
            "prompt_token_ids": [],
            "max_tokens_clipped": False,
            "sampling": json.dumps({"response_format": None}),
        }
        for i in range(3)
    ]
    out = collect("u", rows, {0: request(3, 32), 1: request(1, None), 2: request(1, 0)}, Identity("m", None, str))
    assert (len(out.outputs), out.prompt_tokens, out.cached_prompt_tokens) == (5, 120, 32)
    stats = unit_stats(
        ("u", "s", 0), 3, out, SpeculativeConfig(enabled=False), {"actor_id": "a", "node_id": "n"}, 0.0, 1.0, False
    )
    assert (stats.prompt_tokens, stats.cached_prompt_tokens) == (120, 32)


@pytest.mark.engine
def test_structured_outputs_parse_and_a_cut_off_one_is_marked(spec_run):
    _, outputs, _, _ = spec_run
    by_id = _by_id(outputs)
    for i in range(4):
        (js,) = by_id[f"json-{i}"]
        assert js["parsed"] is True and js["parse_error"] is None, js
        value = json.loads(js["text"])
        assert set(value) == {"name", "count"} and isinstance(value["count"], int)
        (choice,) = by_id[f"choice-{i}"]
        assert choice["text"] in CHOICES and choice["parsed"] is True
        (regex,) = by_id[f"regex-{i}"]
        assert regex["parsed"] is True and len(regex["text"]) == 6 and regex["text"][3] == "-"
    (cut,) = by_id["json-cut"]
    assert cut["finish_reason"] == "length" and cut["parsed"] is False and cut["parse_error"].startswith("not JSON")
    plain = by_id["stop-0"][0]
    assert plain["parsed"] is None and plain["parse_error"] is None  # no format asked for


@pytest.mark.engine
def test_logprobs_are_present_and_agree_with_the_greedy_tokens(spec_run):
    _, outputs, _, _ = spec_run
    by_id = _by_id(outputs)
    for i in range(4):
        (row,) = by_id[f"lp-{i}"]
        logprobs = row["logprobs"]
        assert len(logprobs) == row["generated_tokens"] > 0
        assert "".join(entry["token"] for entry in logprobs) == row["text"]
        for entry in logprobs:
            assert len(entry["top_logprobs"]) == 3
            best = entry["top_logprobs"][0]
            assert best["token_id"] == entry["token_id"]  # greedy: the chosen token is the most likely
            assert best["logprob"] == pytest.approx(entry["logprob"]) and entry["logprob"] <= 0
            assert [t["logprob"] for t in entry["top_logprobs"]] == sorted(
                (t["logprob"] for t in entry["top_logprobs"]), reverse=True
            )
        prompt = row["prompt_logprobs"]
        assert len(prompt) == row["prompt_tokens"] and prompt[0]["logprob"] is None
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in prompt[1:])
    assert by_id["stop-0"][0]["logprobs"] is None  # off unless asked for


@pytest.mark.engine
def test_stop_strings_set_finish_and_stop_reason(spec_run):
    _, outputs, _, _ = spec_run
    by_id = _by_id(outputs)
    stopped = [by_id[f"stop-{i}"][0] for i in range(4)]
    assert any(r["finish_reason"] == "stop" and r["stop_reason"] == "\n" for r in stopped), stopped
    for r in stopped:
        assert "\n" not in r["text"]
        assert (r["finish_reason"], r["stop_reason"]) in (("stop", "\n"), ("length", None), ("stop", None))


@pytest.mark.engine
def test_chat_rows_get_the_job_system_prompt(spec_run):
    _, outputs, _, _ = spec_run
    by_id = _by_id(outputs)
    for i in range(2):
        (chat,) = by_id[f"chat-{i}"]
        prompt_text = "".join(e["token"] for e in chat["prompt_logprobs"])
        assert SYSTEM_PROMPT in prompt_text and f"import os{i}" in prompt_text


@pytest.mark.engine
def test_bad_overrides_land_in_errors_with_their_field(spec_run):
    _, outputs, errors, _ = spec_run
    found = {e["id"]: (e["error_kind"], e["field"]) for e in errors}
    assert {i: f for i, f in found.items() if i not in SAMPLED} == BAD
    messages = {e["id"]: e["message"] for e in errors}
    assert "did you mean 'top_k'" in messages["bad-key"] and "set for the whole job" in messages["bad-job-key"]
    assert not BAD.keys() & {o["id"] for o in outputs}


@pytest.mark.engine
def test_greedy_output_is_the_same_with_and_without_the_drafter(spec_run, plain_run):
    """Lossless with logprobs on, under a grammar and on chat rows: the drafter changes the
    speed, never the output; a job with speculation off drafts nothing."""
    spec, plain = _by_id(spec_run[1]), _by_id(plain_run[1])
    compared = [i for i in spec if i.startswith((*GREEDY, "chat-"))]
    assert len(compared) == 23
    for i in compared:
        a, b = spec[i][0], plain[i][0]
        assert (a["text"], a["finish_reason"], a["parsed"]) == (b["text"], b["finish_reason"], b["parsed"]), i
        if a["logprobs"] is not None:
            assert [e["token_id"] for e in a["logprobs"]] == [e["token_id"] for e in b["logprobs"]]
            assert [e["logprob"] for e in a["logprobs"]] == pytest.approx(
                [e["logprob"] for e in b["logprobs"]], abs=1e-3
            )
    assert sum(o["draft_tokens"] for o in spec_run[1]) > 0 and sum(o["draft_tokens"] for o in plain_run[1]) == 0
    assert Counter(o["id"] for o in spec_run[1]) == Counter(o["id"] for o in plain_run[1] if o["id"] not in SAMPLED)
    stats = plain_run[3].read_table("stats").to_pylist()
    assert stats and all(r["draft_tokens"] == 0 and r["acceptance_rate"] is None for r in stats)
