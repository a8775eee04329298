"""The contracts without an engine: schema exports, job-level input checks (files and
columns; the config's refusals are in test_config_errors.py), row checks, max_tokens clipping,
acceptance arithmetic and the circuit breaker."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inputs import InputError, inspect_inputs
from pipeline.stages.stats import Acceptance
from pipeline.storage import Storage
from schemas import OutputRow, UnitStats, arrow_schema
from schemas.export import JSON_DIR, json_schemas


def test_exported_json_schemas_match_the_code():
    exported = {p.name: p.read_text() for p in JSON_DIR.glob("*.schema.json")}
    assert exported == json_schemas(), "run `python -m schemas.export`"


def test_arrow_schema_is_derived_from_the_model():
    schema = arrow_schema(UnitStats)
    assert schema.field("accepted_per_position").type == pa.list_(pa.int64())
    assert schema.field("acceptance_rate").nullable and not schema.field("rows").nullable
    assert "metadata" not in arrow_schema(OutputRow).names
    assert arrow_schema(OutputRow, metadata=pa.string()).field("metadata").type == pa.string()


def _write(path, columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def test_corrupt_parquet_names_the_file(tmp_path):
    _write(tmp_path / "in" / "a.parquet", {"id": ["a"], "prompt": ["x"]})
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match=r"b\.parquet: not a readable Parquet file"):
        inspect_inputs(str(tmp_path / "in"), Storage())


@pytest.mark.parametrize(
    "columns, expected",
    [
        ({"prompt": ["x"]}, r"missing column 'id'"),
        ({"id": ["a"], "prompt": ["x"], "messages": [[{"role": "user", "content": "x"}]]}, r"has both of the columns"),
        ({"id": ["a"], "text": ["x"]}, r"has neither of the columns"),
        ({"id": [1.5], "prompt": ["x"]}, r"column 'id' has type double, expected string or integer"),
        ({"id": ["a"], "prompt": [3]}, r"column 'prompt' has type int64"),
        ({"id": ["a"], "prompt": ["x"], "max_tokens": ["ten"]}, r"column 'max_tokens' has type string"),
        ({"id": ["a"], "messages": [["hi"]]}, r"column 'messages' has type list<element: string>"),
    ],
)
def test_job_level_refusals_name_file_and_column(tmp_path, columns, expected):
    _write(tmp_path / "in" / "shard.parquet", columns)
    with pytest.raises(InputError, match=r"shard\.parquet: " + expected) as err:
        inspect_inputs(str(tmp_path / "in"), Storage())
    assert "shard.parquet" in str(err.value)


def test_footers_of_known_files_are_not_read_again(tmp_path):
    """A rerun takes files whose (uri, size, version) it recorded from _job.json; a file
    rewritten in place is read again."""
    _write(tmp_path / "in" / "a.parquet", {"id": ["x1", "x2"], "prompt": ["a", "b"]})
    _write(tmp_path / "in" / "b.parquet", {"id": ["y1"], "prompt": ["c"]})
    first = inspect_inputs(str(tmp_path / "in"), Storage())
    assert first.footers_read == 2 and [f.rows for f in first.files] == [2, 1]
    again = inspect_inputs(str(tmp_path / "in"), Storage(), known=first.files)
    assert again.footers_read == 0 and again.files == first.files
    _write(tmp_path / "in" / "b.parquet", {"id": ["y1", "y2", "y3"], "prompt": ["c", "d", "e"]})
    changed = inspect_inputs(str(tmp_path / "in"), Storage(), known=first.files)
    assert changed.footers_read == 1 and [f.rows for f in changed.files] == [2, 3]


def test_null_and_empty_ids_pass_the_input_check(tmp_path):
    """Null and empty ids are row errors (below), not a refusal of the whole input."""
    _write(tmp_path / "in" / "shard.parquet", {"id": ["a", None, ""], "prompt": ["x", "y", "z"]})
    assert inspect_inputs(str(tmp_path / "in"), Storage()).rows == 3


def test_rows_a_footer_cannot_check_become_row_errors():
    """Null, empty and blank ids, and ids the plan's id check found repeated (pipeline/inputs/ids.py):
    row errors naming the row, its file and the field."""
    from pipeline.stages.preprocess import PreprocessSettings, Preprocessor
    from tinykit import kit_paths

    pre = Preprocessor(PreprocessSettings(kit_paths()["target"], 256, duplicates=(("f.parquet", 12, "f.parquet", 10),)))
    rows = {"id": ["a", "  ", "a", "b", None, ""], "prompt": ["x = 1"] * 6}
    n = len(rows["id"])
    unit = pa.table(
        {
            **rows,
            "messages": pa.nulls(n),
            "max_tokens": pa.nulls(n, pa.int64()),
            "temperature": pa.nulls(n, pa.float64()),
            "top_p": pa.nulls(n, pa.float64()),
            "seed": pa.nulls(n, pa.int64()),
            "metadata": pa.nulls(n),
            "source": ["f.parquet"] * n,
            "row": [10, 11, 12, 13, 14, 15],
            "text_column": ["prompt"] * n,
            "unit_id": ["u"] * n,
            "unit_rows": [n] * n,
        }
    )
    out = pre(unit).to_pylist()
    assert [(r["id"], r["error_kind"], r["error_field"]) for r in out] == [
        ("a", None, None),
        ("  ", "invalid_id", "id"),
        ("a", "duplicate_id", "id"),
        ("b", None, None),
        ("", "invalid_id", "id"),
        ("", "invalid_id", "id"),
    ]
    assert (
        out[2]["error_message"].startswith("id 'a' appears twice in f.parquet (rows 10 and 12)")
        and out[0]["prompt_token_ids"]
    )
    assert [r["error_message"] for r in out[4:]] == [
        "id is null at row 14 of f.parquet",
        "id '' is blank at row 15 of f.parquet",
    ]
    assert [(r["source"], r["row"]) for r in out] == [("f.parquet", 10 + i) for i in range(n)]


LOADS_WITHOUT_TORCH = """
import json, shutil, sys
from pipeline.stages.preprocess import load_tokenizer
from tinykit import kit_paths
tokenizer = load_tokenizer(kit_paths()["target"])
print(json.dumps({"torch": "torch" in sys.modules, \
"auto": "transformers.models.auto.tokenization_auto" in sys.modules}))
shutil.copytree(kit_paths()["target"], sys.argv[1], ignore=shutil.ignore_patterns("*.safetensors"))
config = json.load(open(sys.argv[1] + "/tokenizer_config.json"))
json.dump({**config, "auto_map": {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}}, \
open(sys.argv[1] + "/tokenizer_config.json", "w"))
load_tokenizer(sys.argv[1])
print(json.dumps({"torch": "torch" in sys.modules, \
"auto": "transformers.models.auto.tokenization_auto" in sys.modules}))
"""


def test_a_plain_fast_tokenizer_loads_as_autotokenizer_does_without_torch(tmp_path):
    """The driver's check and each preprocess actor load the tokenizer while engines start: a
    folder naming PreTrainedTokenizerFast loads without AutoTokenizer's import of torch and gives
    what AutoTokenizer (vLLM's loader) gives; a folder with custom code goes to AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from pipeline.stages.preprocess import load_tokenizer
    from tinykit import kit_paths

    out = subprocess.run(
        [sys.executable, "-c", LOADS_WITHOUT_TORCH, str(tmp_path / "custom")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert [json.loads(line) for line in out] == [{"torch": False, "auto": False}, {"torch": True, "auto": True}]
    ours, theirs = load_tokenizer(kit_paths()["target"]), AutoTokenizer.from_pretrained(kit_paths()["target"])
    assert type(ours) is type(theirs) and ours.special_tokens_map == theirs.special_tokens_map
    texts = ["def fib(n):\n    return", "<|user|> x <|endoftext|>", "  ünïcode\t"]
    assert [ours.encode(t) for t in texts] == [theirs.encode(t) for t in texts]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


def test_good_input_report(tmp_path):
    _write(tmp_path / "in" / "a.parquet", {"id": ["x1", "x2"], "prompt": ["a", "b"]})
    _write(tmp_path / "in" / "b.parquet", {"id": ["y1"], "messages": [[{"role": "user", "content": "c"}]]})
    report = inspect_inputs(str(tmp_path / "in" / "*.parquet"), Storage())
    assert report.rows == 3 and len(report.files) == 2
    assert sorted(report.text_columns.values()) == ["messages", "prompt"]


class _Metrics:
    def __init__(self, histogram, num_draft_tokens):
        self.histogram, self.num_draft_tokens = histogram, num_draft_tokens


def test_acceptance_from_per_request_histogram():
    # 10 verify steps at k=3: 2 accepted nothing, 3 accepted 1, 1 accepted 2, 4 accepted all 3.
    a = Acceptance.from_request(_Metrics([2, 3, 1, 4], 30))
    assert (a.num_drafts, a.draft_tokens, a.accepted_tokens) == (10, 30, 3 + 2 + 12)
    assert a.accepted_per_position == [8, 5, 4]
    assert a.acceptance_rate == pytest.approx(17 / 30) and a.mean_acceptance_length == pytest.approx(2.7)
    total = a + Acceptance.from_request(_Metrics([1, 0, 0, 1], 6)) + Acceptance.from_request(None)
    assert (total.num_drafts, total.draft_tokens, total.accepted_tokens) == (12, 36, 20)
    assert total.accepted_per_position == [9, 6, 5]
    assert Acceptance().acceptance_rate is None and Acceptance().mean_acceptance_length is None


def test_max_tokens_beyond_the_room_left_is_clipped_visibly_or_refused():
    from pipeline.stages.preprocess import PreprocessSettings, Preprocessor, RowError
    from tinykit import kit_paths

    row = {"prompt": "x = 1\n" * 4, "max_tokens": 500}
    clipping = Preprocessor(PreprocessSettings(kit_paths()["target"], 64, {"max_tokens": 16}))
    prepared = clipping.prepare(row, "prompt")
    sampling = json.loads(prepared["sampling"])
    assert prepared["max_tokens_clipped"] and sampling["max_tokens"] == 64 - len(prepared["prompt_token_ids"])
    assert not clipping.prepare({"prompt": "x = 1"}, "prompt")["max_tokens_clipped"]
    strict = Preprocessor(PreprocessSettings(kit_paths()["target"], 64, {"max_tokens": 16, "clip_max_tokens": False}))
    with pytest.raises(RowError) as err:
        strict.prepare(row, "prompt")
    assert (err.value.kind, err.value.field) == (
        "max_tokens_too_long",
        "max_tokens",
    ) and "does not fit" in err.value.message


def _unit(unit_id, rows=10, errors=0, retryable=0):
    return {
        "unit_id": unit_id,
        "source": "s3://b/in.parquet",
        "rows": rows,
        "error_rows": errors,
        "retryable_error_rows": retryable,
        "first_error": f"prompt_too_long: id-{unit_id}" if errors else None,
    }


def test_circuit_breaker_trips_on_an_error_share_over_its_window_and_on_repeated_infrastructure_errors():
    from pipeline.config import RetriesConfig
    from pipeline.job.breaker import ErrorBreaker, TooManyErrors

    breaker = ErrorBreaker(RetriesConfig(max_error_fraction=0.1, breaker_window_units=3, breaker_consecutive_units=2))
    for unit in (_unit("a"), _unit("b"), _unit("c"), _unit("d", errors=1), _unit("e", errors=1)):
        breaker.observe(unit)  # windows of 3 units: 0, 1 and 2 errors of 30 rows, within 10 %
    with pytest.raises(
        TooManyErrors, match=r"4 of the 30 rows of the last 3 units failed .* e\.g\. prompt_too_long: id-f in unit f"
    ):
        breaker.observe(_unit("f", errors=2))

    streak = ErrorBreaker(RetriesConfig(breaker_consecutive_units=2, max_error_fraction=1.0))
    streak.observe(_unit("a", errors=1, retryable=1))
    streak.observe(_unit("b"))  # the streak breaks
    streak.observe(_unit("c", errors=1, retryable=1))
    with pytest.raises(TooManyErrors, match=r"2 units in a row have errors that are not their rows' own"):
        streak.observe(_unit("d", errors=1, retryable=1))
