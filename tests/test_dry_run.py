"""`specbatch run CONFIG --dry-run [--json]`: the plan and the checks of the real run, with no
engine, no Ray and nothing written to the output location. The dry run of a finished job's
rerun is tested on tests/test_status.py's real job."""

from __future__ import annotations

import json
import random
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
import yaml

from pipeline.config import load_config
from pipeline.cli import main
from pipeline.tools.estimates import NO_CALIBRATION, SAMPLE_ROWS
from schemas.plan import DryRunPlan
from schemas.report import CalibrationReport, CalibrationRow
from tests.conftest import calibration_report, job_config, record_s3_requests, write_prompts

ROOT = Path(__file__).resolve().parents[1]
WORDS = "def class return import for while if else yield lambda print range self None True".split()
PROMPT_ROWS, CHAT_ROWS, ROWS_PER_UNIT, MAX_TOKENS = 600, 200, 16, 16


def _text(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most)))


def write_input(folder: Path) -> tuple[list[str], list[list[dict]]]:
    """Plain prompts and chat messages of varied lengths, in several row groups each: more rows
    than the token sample, so the estimate is an estimate."""
    rng = random.Random(7)
    prompts = [_text(rng, 60) for _ in range(PROMPT_ROWS)]
    chats = [[{"role": "user", "content": _text(rng, 40)}] for _ in range(CHAT_ROWS)]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({"id": [f"p{i}" for i in range(PROMPT_ROWS)], "prompt": prompts}),
        folder / "a.parquet",
        row_group_size=100,
    )
    pq.write_table(
        pa.table({"id": [f"c{i}" for i in range(CHAT_ROWS)], "messages": chats}),
        folder / "b.parquet",
        row_group_size=50,
    )
    return prompts, chats


def write_config(path: Path, input_uri: str, output_uri: str, kit: dict, **overrides) -> str:
    defaults = {
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
        "resources": {"replicas": 1, "rows_per_unit": ROWS_PER_UNIT, "units_in_flight": 2},
    }
    config = job_config(input_uri, output_uri, kit, **{**defaults, **overrides})
    path.write_text(yaml.safe_dump(config))
    return str(path)


def files_of(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`, with its size and mtime: what "untouched" compares."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def dry_run_json(capsys, *args: str) -> tuple[int, DryRunPlan, str]:
    code = main(["run", *args, "--dry-run", "--json"])
    captured = capsys.readouterr()
    # the session's Ray may print its workers' late log lines on stdout too
    start = re.search(r"(?m)^\{$", captured.out).start()
    return code, DryRunPlan.model_validate_json(captured.out[start:]), captured.err


def real_prompt_tokens(tokenizer_path: str, prompts: list[str], chats: list[list[dict]]) -> dict[str, int]:
    """The prompt tokens of every row, with the model's tokenizer used directly."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    rendered = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return {
        "prompt": sum(len(tokenizer.encode(p)) for p in prompts),
        "messages": sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in rendered),
    }


@pytest.fixture(autouse=True)
def empty_calibration_store(tmp_path, monkeypatch):
    """Each dry run here reads a store of its own: the session's holds what test_calibrate
    stored for the same kit and settings, which the dry run would find (as the run does)."""
    monkeypatch.setenv("SPECBATCH_CALIBRATIONS", str(tmp_path / "calibrations"))


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dry-run-input")
    prompts, chats = write_input(folder / "in")
    return folder / "in", prompts, chats


def test_the_plan_counts_rows_units_the_chat_split_and_tokens(tmp_path, capsys, job_input, trained_kit):
    folder, prompts, chats = job_input
    config = write_config(tmp_path / "job.yaml", str(folder), str(tmp_path / "out"), trained_kit)
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0 and plan.accepted and plan.refused is None, err
    assert (plan.inputs.rows, plan.inputs.prompt_rows, plan.inputs.chat_rows) == (800, PROMPT_ROWS, CHAT_ROWS)
    assert [(Path(f.uri).name, f.rows, f.text_column, f.units) for f in plan.inputs.file_list] == [
        ("a.parquet", PROMPT_ROWS, "prompt", 38),
        ("b.parquet", CHAT_ROWS, "messages", 13),
    ]
    assert (plan.units.units, plan.units.committed, plan.units.left, plan.units.rows_left) == (51, 0, 51, 800)
    assert plan.units.rows_per_unit == ROWS_PER_UNIT and plan.units.rerun_of is None

    tokens = plan.tokens
    assert not tokens.exact and tokens.sample_rows == SAMPLE_ROWS and tokens.sample_error_rows == 0
    assert tokens.sample_row_groups <= 16
    real = real_prompt_tokens(trained_kit["target"], prompts, chats)
    for kind in ("prompt", "messages"):  # each kind from its own sample
        assert abs(tokens.prompt_tokens_by_kind[kind] - real[kind]) <= 0.15 * real[kind], (kind, tokens, real)
    assert abs(tokens.prompt_tokens - sum(real.values())) <= 0.1 * sum(real.values())
    assert tokens.output_tokens_upper_bound == tokens.output_tokens_upper_bound_left == 800 * MAX_TOKENS

    checks = {c.name: c.status for c in plan.checks}
    assert checks == {
        "preflight": "pass",
        "drafter": "pass",
        "drafter_probe": "skipped",
        "lease": "pass",
        "cluster": "pass",
    }
    assert plan.cost is None and plan.cost_note.endswith(NO_CALIBRATION)
    assert "no calibration of this target and drafter in" in plan.cost_note
    assert "the trial measures it against off on the job's first units" in plan.speculation
    assert not (tmp_path / "out").exists()


def test_the_probe_of_a_small_input_is_said_with_the_rows_it_has(tmp_path, capsys, trained_kit):
    """probe.rows 64 over a 5-row input: the plan says 5 (it said "64 rows" on 5-row inputs)."""
    write_prompts(tmp_path / "in" / "p.parquet", {"id": [f"s{i}" for i in range(5)], "prompt": ["def f(x):"] * 5})
    config = write_config(
        tmp_path / "job.yaml",
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        trained_kit,
        speculative={"probe": {"rows": 64}},
    )
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    (probe,) = [c for c in plan.checks if c.name == "drafter_probe"]
    assert "generates up to 5 rows with the drafter" in probe.message, probe.message


def test_null_and_blank_ids_are_counted_as_the_rows_errors(tmp_path, capsys, trained_kit):
    """The dry run counts a null or blank id as its row's `invalid_id`, as the job does (its
    sample once failed on a null id: KeyError 'row')."""
    write_prompts(tmp_path / "in" / "p.parquet", {"id": ["a", None, " ", "d"], "prompt": ["def f(x):"] * 4})
    config = write_config(tmp_path / "job.yaml", str(tmp_path / "in"), str(tmp_path / "out"), trained_kit)
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    assert plan.tokens.exact and plan.tokens.sample_error_rows == 2
    assert plan.tokens.sample_error_kinds == {"invalid_id": 2}


def test_the_output_bound_counts_each_rows_own_max_tokens(tmp_path, capsys, trained_kit):
    """Every row counted (a small input): the bound is the sum of each row's max_tokens x n, its
    overrides included, and no warning (it was rows x the job's max_tokens, then a warning that
    it did not hold)."""
    write_prompts(
        tmp_path / "in" / "p.parquet",
        {
            "id": [f"m{i}" for i in range(5)],
            "prompt": ["def f(x):"] * 5,
            "max_tokens": pa.array([None, 40, None, 3, None], pa.int64()),
        },
    )
    config = write_config(tmp_path / "job.yaml", str(tmp_path / "in"), str(tmp_path / "out"), trained_kit)
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    t = plan.tokens
    assert t.exact and t.sample_rows_above_bound == (40 > MAX_TOKENS) + (3 > MAX_TOKENS)
    assert t.output_tokens_upper_bound == t.output_tokens_upper_bound_left == 3 * MAX_TOKENS + 40 + 3
    assert not [w for w in plan.warnings if "max_tokens" in w], plan.warnings


def test_a_dry_run_starts_no_engine_and_no_ray_and_writes_nothing(tmp_path, job_input, trained_kit):
    """In a process of its own: no Ray or vLLM imported (so none started), no child process
    left, and the output location never created; the input and the models unchanged."""
    folder, _, _ = job_input
    config = write_config(tmp_path / "job.yaml", str(folder), str(tmp_path / "out"), trained_kit)
    before = {
        "input": files_of(folder),
        "target": files_of(Path(trained_kit["target"])),
        "drafter": files_of(Path(trained_kit["drafter"])),
    }
    script = (
        "import json, sys, psutil\n"
        "from pipeline.cli import main\n"
        f"code = main(['run', {config!r}, '--dry-run'])\n"
        "children = [p.name() for p in psutil.Process().children(recursive=True)]\n"
        "print(json.dumps({'code': code, 'ray': 'ray' in sys.modules, 'vllm': 'vllm' in sys.modules, 'children': "
        "children}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"code": 0, "ray": False, "vllm": False, "children": []}
    assert "the job would be accepted (exit 0)" in out.stdout
    assert "drafter_probe skipped not run" not in out.stdout  # the kit's jobs run no probe; said as "off"
    assert "off (speculative.probe.rows: 0)" in out.stdout
    assert not (tmp_path / "out").exists()
    assert before == {
        "input": files_of(folder),
        "target": files_of(Path(trained_kit["target"])),
        "drafter": files_of(Path(trained_kit["drafter"])),
    }


def test_on_s3_the_dry_run_only_reads(tmp_path, capsys, monkeypatch, s3_endpoint, job_input, trained_kit):
    """Input and output in object storage: not one write request, and the output prefix stays empty."""
    folder, _, _ = job_input
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    for name in ("a.parquet", "b.parquet"):
        fs.put(str(folder / name), f"specbatch/dry-in/{name}")
    config = write_config(
        tmp_path / "job.yaml",
        "s3://specbatch/dry-in/",
        "s3://specbatch/dry-out/",
        trained_kit,
        storage={"endpoint_url": s3_endpoint},
    )
    calls = record_s3_requests(monkeypatch)
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0 and plan.accepted, err
    assert plan.inputs.rows == 800 and plan.units.left == 51
    methods = {method for method, _ in calls}
    assert methods and methods <= {"list_objects_v2", "get_object", "head_object"}, methods
    fs.invalidate_cache()
    assert fs.find("specbatch/dry-out") == []


def test_a_refused_job_exits_2_with_the_real_runs_message(tmp_path, capsys, job_input):
    """The kit's mismatched drafter: the real run refuses it before any engine; the dry run
    says the same words, exits 2, and names the failed check in its plan."""
    from tinykit import kit_paths

    folder, _, _ = job_input
    kit = kit_paths()
    config = write_config(
        tmp_path / "job.yaml",
        str(folder),
        str(tmp_path / "out"),
        {"target": kit["target"], "drafter": kit["drafter_mismatched"]},
    )
    assert main(["run", config]) == 2
    real = capsys.readouterr().err
    assert real.startswith("specbatch: refused: drafter ") and "target_fingerprint" in real

    assert main(["run", config, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.err == real
    assert "would be REFUSED (exit 2)" in captured.out

    code, plan, err = dry_run_json(capsys, config)
    assert code == 2 and err == real and not plan.accepted
    assert plan.refused == real[len("specbatch: refused: ") :].rstrip("\n")
    assert [c.status for c in plan.checks if c.name == "drafter"] == ["fail"]
    assert plan.tokens is None and plan.cost is None  # no estimate for a job that would not start
    assert not (tmp_path / "out").exists()


def test_a_live_lease_refuses_the_dry_run_and_stays(tmp_path, capsys, job_input, trained_kit):
    import time

    from schemas import Lease

    folder, _, _ = job_input
    out = tmp_path / "out"
    out.mkdir()
    lease = Lease(
        owner="elsewhere:1:abc",
        job_id="other",
        attempt=1,
        acquired_at="2026-01-01T00:00:00+00:00",
        heartbeat_at=time.time(),
        stale_after_seconds=180.0,
    )
    (out / "_lease.json").write_text(lease.model_dump_json())
    before = files_of(out)
    config = write_config(tmp_path / "job.yaml", str(folder), str(out), trained_kit)
    code, plan, err = dry_run_json(capsys, config)
    assert code == 2 and "is leased to run elsewhere:1:abc (job other, attempt 1)" in err and "that run is alive" in err
    assert [c.status for c in plan.checks if c.name == "lease"] == ["fail"]
    assert files_of(out) == before


def calibration(rates: dict[tuple[int, int], float]) -> CalibrationReport:
    """A calibration of (depth, concurrency) -> generated tokens/s per GPU (one GPU per replica)."""
    rows = [
        CalibrationRow(
            depth=depth,
            concurrency=concurrency,
            prompts=64,
            prompt_tokens=1000,
            generated_tokens=int(rate * 10),
            seconds=10.0,
            tokens_per_second=rate,
            tokens_per_second_per_gpu=rate,
            speedup_vs_off=None,
            num_drafts=0,
            draft_tokens=0,
            accepted_tokens=0,
            acceptance_rate=None,
            mean_acceptance_length=None,
            accepted_per_position=[],
            cost_per_million_generated_tokens=None,
            cost_per_million_total_tokens=None,
            recommended=False,
        )
        for (depth, concurrency), rate in rates.items()
    ]
    return calibration_report(
        rows, measured_at="2026-12-01T00:00:00+00:00", concurrencies=sorted({c for _, c in rates})
    )


def test_with_a_calibration_the_plan_gives_gpu_hours_and_cost(tmp_path, capsys, job_input, trained_kit):
    from pipeline.tools.prices import load_prices

    folder, _, _ = job_input
    out = tmp_path / "out"
    (out / "calibration").mkdir(parents=True)
    rates = {(0, 1): 50.0, (3, 1): 80.0, (0, 32): 400.0, (3, 32): 300.0}
    (out / "calibration" / "calibration.json").write_text(calibration(rates).model_dump_json())
    before = files_of(out)
    _, price = load_prices().billing("cpu", 0)

    config = write_config(tmp_path / "job.yaml", str(folder), str(out), trained_kit)
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    cost = plan.cost
    # the job's depth (3) at the highest concurrency measured (32): rows x max_tokens / measured tok/s
    assert (cost.depth, cost.concurrency, cost.tokens_per_second_per_gpu) == (3, 32, 300.0)
    assert cost.output_tokens == 800 * MAX_TOKENS
    assert cost.gpu_hours == pytest.approx(800 * MAX_TOKENS / 300.0 / 3600)
    assert cost.wall_hours == pytest.approx(cost.gpu_hours)  # one replica of one billed unit
    assert cost.cost == pytest.approx(cost.gpu_hours * price) and cost.price_source == "prices"
    assert plan.cost_note is None

    off = write_config(tmp_path / "off.yaml", str(folder), str(out), trained_kit, speculative={"enabled": False})
    assert main(["run", off, "--dry-run"]) == 0
    text = capsys.readouterr().out
    gpu_hours = 800 * MAX_TOKENS / 400.0 / 3600
    assert f"at most {gpu_hours:.3g} GPU-hours, USD {gpu_hours * price:.3g} at {price:g} per GPU-hour" in text
    assert "400.0 generated tok/s per GPU at speculation off, 32 sequences at once" in text
    assert files_of(out) == before


def test_without_a_calibration_the_plan_says_how_to_get_one(tmp_path, capsys, job_input, trained_kit):
    folder, _, _ = job_input
    config = write_config(tmp_path / "job.yaml", str(folder), str(tmp_path / "out"), trained_kit)
    assert main(["run", config, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert (
        f"no calibration of this target and drafter in {os.environ['SPECBATCH_CALIBRATIONS']}: {NO_CALIBRATION}" in text
    )
    assert "  speculate speculation k=3: no calibration of this target and drafter in" in text


def test_the_dry_run_finds_the_pilots_calibration_and_prints_the_decision_the_run_will_make(
    tmp_path, capsys, job_input, trained_kit
):
    """The pilot writes OUTPUT_URI/pilot/calibration/; the dry run finds it (as the run does) and
    prints the policy's prediction in its words: off and k=3 at the job's 32 sequences, three runs
    each, the sample keeping 2 drafts a step: 3 x (10 s / 6,000 steps) / (12 s / 2,000 steps) = 0.83x."""
    from pipeline.speculation.calibrations import JobCalibration
    from pipeline.speculation.policy import planned_decision
    from pipeline.tools.calibration_choice import calibration_rows

    folder, _, _ = job_input
    out = tmp_path / "out"
    cells = [
        dict(depth=k, concurrency=32, prompts=64, completions=64, prompt_tokens=640, generated_tokens=6064,
             seconds=s, seconds_runs=[s * 0.99, s, s * 1.01], num_drafts=2000 if k else 0,
             draft_tokens=6000 if k else 0, accepted_tokens=4000 if k else 0,
             accepted_per_position=[2000, 2000, 0] if k else [])
        for k, s in ((0, 10.0), (3, 12.0))
    ]  # fmt: skip
    report = calibration_report(calibration_rows(cells, 1.0, None))
    (out / "pilot" / "calibration").mkdir(parents=True)
    (out / "pilot" / "calibration" / "calibration.json").write_text(report.model_dump_json())
    config = write_config(tmp_path / "job.yaml", str(folder), str(out), trained_kit, engine={"max_num_seqs": 32})
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    uri = str(out / "pilot" / "calibration" / "calibration.json")
    expected = planned_decision(
        load_config(config), JobCalibration(report, f"the calibration of {report.measured_at} in {uri}", uri)
    )
    assert plan.speculation == expected and plan.cost.calibration_uri == uri
    assert expected.startswith("speculation k=3 cost more than it saved: 0.83x of off (0.82x-0.85x) at 32 sequences")


def test_unsupported_batch_lines_are_counted_as_their_rows_errors(tmp_path, capsys, trained_kit):
    """unsupported_requests: errors: the dry run counts each line specbatch cannot run as its
    row's unsupported_request, as the job's preprocess stage does."""
    ok = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"x = {i}"}}
        for i in range(3)
    ]
    bad = [
        {
            "custom_id": "bias",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "y", "logit_bias": {"1": 2}},
        },
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "z"}},
    ]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "batch.jsonl").write_text("\n".join(json.dumps(line) for line in ok + bad) + "\n")
    config = write_config(
        tmp_path / "job.yaml",
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        trained_kit,
        input_format="openai_batch",
        unsupported_requests="errors",
    )
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    assert plan.inputs.rows == 5 and plan.tokens.exact
    assert plan.tokens.sample_error_kinds == {"unsupported_request": 2}


def test_openai_batch_input_is_checked_without_writing_its_conversion(tmp_path, capsys, trained_kit):
    """Every line checked as the run checks it (a bad line refuses the job with its message),
    the rows and units exact, and nothing under OUTPUT_URI/_inputs."""
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"import os{i}"}], "max_tokens": 8},
        }
        for i in range(20)
    ]
    lines += [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": f"x = {i}"}}
        for i in range(5)
    ]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "batch.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "out"
    config = write_config(
        tmp_path / "job.yaml", str(tmp_path / "in"), str(out), trained_kit, input_format="openai_batch"
    )
    code, plan, err = dry_run_json(capsys, config)
    assert code == 0, err
    assert (plan.inputs.rows, plan.inputs.chat_rows, plan.inputs.prompt_rows) == (25, 20, 5)
    assert (plan.inputs.converted_files, plan.inputs.conversions_checked) == (0, 1)
    assert all(f.uri.startswith(str(out / "_inputs") + "/") for f in plan.inputs.file_list)
    assert plan.units.units == 3 and plan.tokens.exact  # 20 chat rows in 2 units, 5 prompts in 1
    assert not out.exists()

    # converted as the run converts them: taken where they are, the same files and units
    from pipeline.inputs.openai_batch import convert_batch_files
    from pipeline.storage import Storage

    converted = convert_batch_files(str(tmp_path / "in"), Storage(), str(out / "_inputs"))
    before = files_of(out)
    code, again, err = dry_run_json(capsys, config)
    assert code == 0, err
    assert (again.inputs.converted_files, again.inputs.conversions_checked) == (1, 0)
    assert [f.uri for f in again.inputs.file_list] == [f.uri for f in plan.inputs.file_list] == converted
    assert again.units == plan.units and files_of(out) == before

    (tmp_path / "in" / "batch.jsonl").write_text(json.dumps({**lines[0], "body": {"messages": []}}) + "\n")
    assert main(["run", config]) == 2
    real = capsys.readouterr().err
    before = files_of(out)
    assert main(["run", config, "--dry-run"]) == 2
    assert capsys.readouterr().err == real and "line 1" in real
    assert files_of(out) == before
