"""Rows that share a prompt prefix run together (pipeline/inputs/prefixes.py, pipeline/job/grouping.py,
pipeline/graph/regroup.py): the key pass and the decision on real Parquet files, the grouped copy
on a real local Ray, and one grouped job against the same job ungrouped on the real kit."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import job_config, write_prompts

WORDS = "the of and to in is was for on with as by at from that this which be are it an or".split()


def passages_and_questions(folder, passages=16, questions=3, files=2, seed=0, words=120) -> dict[str, str]:
    """Passages of `words` words, `questions` questions each, rows shuffled across `files` files;
    returns id -> prompt."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(passages)]
    rows = [
        (f"p{p}q{q}", f"Read the passage.\n{texts[p]}\nQuestion {q}: what is word {q * 7 + p}?")
        for p in range(passages)
        for q in range(questions)
    ]
    rng.shuffle(rows)
    for k in range(files):
        part = rows[k::files]
        write_prompts(folder / f"part{k}.parquet", {"id": [r[0] for r in part], "prompt": [r[1] for r in part]})
    return dict(rows)


def unique_prompts(folder, rows=40, files=2, seed=1) -> None:
    rng = random.Random(seed)
    prompts = [f"You are helpful.\n{' '.join(rng.choice(WORDS) for _ in range(80))}" for _ in range(rows)]
    for k in range(files):
        write_prompts(
            folder / f"part{k}.parquet", {"id": [f"u{i}" for i in range(k, rows, files)], "prompt": prompts[k::files]}
        )


def _keys(folder):
    from pipeline.inputs import inspect_inputs
    from pipeline.inputs.prefixes import read_keys
    from pipeline.storage import Storage

    files = inspect_inputs(str(folder), Storage()).files
    return files, read_keys(Storage(), files)


def _ids_in_order(files, order) -> list[str]:
    ids = [i for f in files for i in pq.read_table(f.uri, columns=["id"]).column("id").to_pylist()]
    return [ids[i] for i in order]


def test_sorting_puts_the_rows_of_one_passage_next_to_each_other_and_it_pays(tmp_path):
    from pipeline.inputs.prefixes import group_order, grouping_pays, measure_sharing

    passages_and_questions(tmp_path, passages=16, questions=3)
    files, keys = _keys(tmp_path)
    order = group_order(keys)
    passages = [i.split("q")[0] for i in _ids_in_order(files, order)]
    runs = [p for k, p in enumerate(passages) if k == 0 or p != passages[k - 1]]
    assert len(runs) == 16 and sorted(runs) == sorted(set(passages))  # each passage's rows in one run
    sharing = measure_sharing(keys, order, 4)
    assert sharing.rows == 48 and sharing.prefix_groups == 16 and sharing.rows_in_groups == 48
    # two of three rows share a passage of ~500 characters, counted at the 256 level below it
    assert sharing.shared_chars_grouped == 32 * 256 and sharing.shared_chars_in_input_order < 32 * 64
    assert grouping_pays(sharing)[0]


def test_unique_prompts_and_an_input_already_in_order_are_not_grouped(tmp_path):
    from pipeline.inputs.prefixes import group_order, grouping_pays, measure_sharing

    unique_prompts(tmp_path / "unique")
    _, keys = _keys(tmp_path / "unique")
    sharing = measure_sharing(keys, group_order(keys), 4)
    assert sharing.prefix_groups == 0 and not grouping_pays(sharing)[0]
    ordered = tmp_path / "ordered"
    prompts = passages_and_questions(tmp_path / "shuffled", files=1)
    write_prompts(ordered / "p.parquet", {"id": sorted(prompts), "prompt": [prompts[i] for i in sorted(prompts)]})
    _, keys = _keys(ordered)
    pays, reason = grouping_pays(measure_sharing(keys, group_order(keys), 4))
    assert not pays and "only 0%" in reason


def test_a_header_every_row_shares_is_no_reason_to_group_even_with_odd_rows_between(tmp_path):
    from pipeline.inputs.prefixes import group_order, grouping_pays, measure_sharing
    from tests.conftest import RANDOM_JOB_BAD, RANDOM_JOB_HEADER

    prompts = [
        RANDOM_JOB_BAD[i][0] if i in RANDOM_JOB_BAD else f"{RANDOM_JOB_HEADER}def function_{i}(x):" for i in range(28)
    ]
    write_prompts(tmp_path / "p.parquet", {"id": [str(i) for i in range(28)], "prompt": prompts})
    _, keys = _keys(tmp_path)
    sharing = measure_sharing(keys, group_order(keys), 4)
    assert (
        sharing.shared_chars_grouped == sharing.shared_chars_in_input_order > 0
    )  # sorting the odd rows aside gains nothing
    assert not grouping_pays(sharing)[0]


def test_rows_of_two_adapters_and_chat_rows_are_keyed_apart(tmp_path):
    from pipeline.inputs.prefixes import group_order

    long = "shared context " * 40
    write_prompts(
        tmp_path / "a.parquet",
        {
            "id": ["a0", "b0", "a1", "b1"],
            "prompt": [long + "x", long + "y", long + "z", long + "w"],
            "lora": ["A", "B", "A", "B"],
        },
    )
    messages = [[{"role": "system", "content": long}, {"role": "user", "content": str(i)}] for i in range(3)]
    write_prompts(tmp_path / "b.parquet", {"id": ["m0", "m1", "m2"], "messages": messages})
    files, keys = _keys(tmp_path)
    ids = _ids_in_order(files, group_order(keys))
    assert ids[:4] in (["a0", "a1", "b0", "b1"], ["b0", "b1", "a0", "a1"])  # an adapter's rows together, prompts first
    assert set(ids[4:]) == {"m0", "m1", "m2"}


def test_the_grouped_copy_holds_every_row_once_in_order_with_its_origin(tmp_path, ray_local):
    from pipeline.graph.regroup import write_grouped_copy
    from pipeline.inputs.shape import RowShape
    from pipeline.inputs.prefixes import group_order
    from pipeline.storage import Storage

    passages_and_questions(tmp_path / "in", passages=20, questions=3, files=3)
    files, keys = _keys(tmp_path / "in")
    order = group_order(keys)
    copy = write_grouped_copy(
        Storage(), str(tmp_path / "out"), files, order, keys.kinds, rows_per_unit=8, shape=RowShape()
    )
    assert [f.rows for f in copy] == [60] and copy[0].text_column == "prompt"
    table = pq.read_table(copy[0].uri)
    assert table.column("id").to_pylist() == _ids_in_order(files, order)
    assert pq.ParquetFile(copy[0].uri).metadata.row_group(0).num_rows == 8  # a unit reads its own row group
    for row in table.select(["id", "source", "row"]).to_pylist():  # each row names the file and row it came from
        assert pq.read_table(row["source"]).column("id")[row["row"]].as_py() == row["id"]


# ---------------------------------------------------------------- one job, grouped and not, on the kit


@pytest.fixture(scope="module")
def grouped_and_not(tmp_path_factory, ray_local, trained_kit):
    """48 rows (16 passages x 3 questions) shuffled over 2 files, run grouped (auto decides to)
    and ungrouped with the kit's drafter, 4 sequences at once, in a KV cache of about a quarter
    of the passages' tokens, 32-token blocks."""
    from pipeline.config import parse_config
    from pipeline.job.runner import run_job

    root = tmp_path_factory.mktemp("prefix-groups")
    prompts = passages_and_questions(root / "in")
    runs = {}
    for setting in ("auto", False):
        data = job_config(
            str(root / "in"),
            str(root / f"out-{setting}"),
            trained_kit,
            sampling={"max_tokens": 8},
            resources={"rows_per_unit": 8, "group_prefixes": setting},
            engine={
                "max_model_len": 512,
                "max_num_seqs": 4,
                "cpu_kv_cache_gib": 1200 * 4096 / 2**30,
                "extra_args": {"block_size": 32},
            },
        )
        runs[setting] = (data, run_job(parse_config(data), progress=False))
    return root, prompts, runs


def _outputs(output_uri: str) -> pa.Table:
    return pq.read_table(f"{output_uri}/outputs")


@pytest.mark.engine
def test_a_grouped_job_generates_every_row_once_as_the_ungrouped_job_does(grouped_and_not):
    root, prompts, runs = grouped_and_not
    (grouped_config, grouped), (plain_config, plain) = runs["auto"], runs[False]
    assert grouped.status == plain.status == "succeeded"
    assert grouped.grouping.grouped and grouped.grouping.setting == "auto" and not plain.grouping.grouped
    assert all(f.uri.startswith(f"{grouped_config['output_uri']}/_grouped/") for f in grouped.grouping.files)
    a, b = _outputs(grouped_config["output_uri"]), _outputs(plain_config["output_uri"])
    assert sorted(a.column("id").to_pylist()) == sorted(prompts) == sorted(b.column("id").to_pylist())
    by_id = lambda t: {
        r["id"]: (r["text"], r["source"], r["row"]) for r in t.select(["id", "text", "source", "row"]).to_pylist()
    }  # noqa: E731
    assert by_id(a) == by_id(b)  # greedy text, and the input file and row each came from, alike
    assert all(r["source"].startswith(str(root / "in")) for r in a.select(["source"]).to_pylist())


@pytest.mark.engine
def test_grouped_rows_find_their_passage_in_the_prefix_cache(grouped_and_not):
    _, _, runs = grouped_and_not
    grouped, plain = runs["auto"][1].totals, runs[False][1].totals
    assert grouped.prompt_tokens == plain.prompt_tokens
    # two of each passage's three rows can find its ~5 blocks cached when they meet; shuffled, they rarely do
    assert grouped.cached_prompt_tokens > 0.4 * grouped.prompt_tokens > plain.cached_prompt_tokens


@pytest.mark.engine
def test_a_resume_reuses_the_recorded_grouped_copy_and_refuses_the_other_setting_or_a_lost_copy(grouped_and_not):
    from pipeline.config import parse_config
    from pipeline.job.grouping import GroupingChanged
    from pipeline.job.plan import plan_job
    from pipeline.storage import Storage
    from pipeline.tools.status_counts import planned_rows

    _, _, runs = grouped_and_not
    data, manifest = runs["auto"]
    markers = sorted(Storage().list_files(f"{data['output_uri']}/_commits"))
    planned = planned_rows(manifest)  # what status counts a running job's rows by: the grouped copy's units
    assert set(planned) == {m.rsplit("/", 1)[1].removesuffix(".json") for m in markers} and sum(planned.values()) == 48
    marker = markers[2]
    Storage().delete(marker)
    plan = plan_job(parse_config(data))
    assert not plan.grouping.copy_to_write and plan.grouping.record.files == manifest.grouping.files
    assert [u.unit_id for u in plan.todo] == [marker.rsplit("/", 1)[1].removesuffix(".json")]
    assert plan.todo[0].source in {f.uri for f in manifest.grouping.files}
    # a later run on the same location with a new input file: the copy's units, then the new file's as it is
    new_file = Path(data["input_uri"]) / "zz-new.parquet"
    pq.write_table(pa.table({"id": ["new-0", "new-1"], "prompt": ["x", "y"]}), new_file)
    later = plan_job(parse_config(data))
    assert [u.source for u in later.units[-1:]] == [str(new_file)] and later.units[:-1] == plan.units
    assert {u.source for u in later.todo} == {str(new_file), plan.todo[0].source}
    new_file.unlink()
    with pytest.raises(GroupingChanged, match="group_prefixes: false.*over its grouped copy"):
        plan_job(parse_config({**data, "resources": {**data["resources"], "group_prefixes": False}}))
    Storage().delete(manifest.grouping.files[-1].uri)  # a file of the copy gone while a unit is left
    with pytest.raises(GroupingChanged, match=r"1 file\(s\) of the job's grouped input copy are gone or changed"):
        plan_job(parse_config(data))
