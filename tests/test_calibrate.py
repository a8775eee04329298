"""`specbatch calibrate`: the pieces without an engine (sampling the job's own prompts, the
choice, --apply keeping comments), then a real calibration on the trained tiny kit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.calibrate import apply_depth, calibration_rows, main as calibrate_main, parse_depths, sample_prompts, CalibrationError
from pipeline.config import load_config, parse_config
from pipeline.demo import sample_prompts as stdlib_lines
from pipeline.storage import Storage
from pipeline.tinykit import kit_paths
from schemas.report import CalibrationReport
from tests.conftest import job_config, write_prompts

KIT = kit_paths()
TINY_KIT = {"target": KIT["target"], "drafter": KIT["drafter_eagle31"]}

CONFIG_WITH_COMMENTS = """\
# the daily job
job_name: daily
input_uri: in/
output_uri: out/
model:
  path: /models/t
speculative:   # EAGLE-3.1
  enabled: true
  drafter: /models/d
  num_speculative_tokens: 3   # choose with `specbatch calibrate`
sampling:
  max_tokens: 16
"""


def write_job_input(folder: Path) -> None:
    """Two shards as a real job has them: plain prompts (two the job refuses) and chat messages."""
    lines = stdlib_lines(40, seed=3)
    write_prompts(folder / "a.parquet", {"id": [f"a{i}" for i in range(22)], "prompt": lines[:20] + ["   ", None]})
    write_prompts(folder / "b.parquet", {"id": [f"b{i}" for i in range(10)], "messages": [[{"role": "user", "content": t}] for t in lines[20:30]]})


def test_apply_depth_edits_the_block_and_keeps_comments():
    deeper = apply_depth(CONFIG_WITH_COMMENTS, 5)
    assert "num_speculative_tokens: 5   # choose with `specbatch calibrate`" in deeper
    assert deeper.startswith("# the daily job\n") and "speculative:   # EAGLE-3.1" in deeper
    assert yaml.safe_load(deeper)["speculative"] == {"enabled": True, "drafter": "/models/d", "num_speculative_tokens": 5}
    off = yaml.safe_load(apply_depth(CONFIG_WITH_COMMENTS, 0))
    assert off["speculative"] == {"enabled": False, "drafter": "/models/d", "num_speculative_tokens": 3}
    # A speculative block without the keys gets them; flow style is rewritten as plain YAML.
    added = yaml.safe_load(apply_depth("model: {path: /m}\nspeculative:\n  drafter: /d\n", 2))
    assert added["speculative"] == {"drafter": "/d", "enabled": True, "num_speculative_tokens": 2}
    flow = yaml.safe_load(apply_depth("speculative: {enabled: true, drafter: /d}\n", 0))
    assert flow["speculative"] == {"enabled": False, "drafter": "/d"}


def test_recommendation_is_the_highest_throughput_per_gpu():
    def measured(depth, tokens, seconds, drafts=0, per_pos=()):
        return {"depth": depth, "prompts": 8, "prompt_tokens": 800, "generated_tokens": tokens, "seconds": seconds,
                "num_drafts": drafts, "draft_tokens": drafts * depth, "accepted_tokens": sum(per_pos), "accepted_per_position": list(per_pos)}

    rows = calibration_rows([measured(2, 1200, 1.0, 100, (80, 40)), measured(0, 1000, 1.0), measured(4, 1100, 1.0, 60, (50, 30, 10, 5))],
                            gpus_per_replica=2, price=3.6)
    assert [r.depth for r in rows] == [0, 2, 4] and [r.recommended for r in rows] == [False, True, False]
    best = rows[1]
    assert best.tokens_per_second_per_gpu == pytest.approx(600) and best.speedup_vs_off == pytest.approx(1.2)
    # 2 GPUs x $3.6/h for 1 s = $0.002 for 1,200 tokens.
    assert best.cost_per_million_generated_tokens == pytest.approx(0.002 / 1200 * 1e6)
    assert best.cost_per_million_total_tokens == pytest.approx(0.002 / 2000 * 1e6)
    assert best.accepted_per_position == pytest.approx([0.8, 0.4]) and best.mean_acceptance_length == pytest.approx(2.2)
    assert min(rows, key=lambda r: r.cost_per_million_generated_tokens).recommended
    assert rows[0].acceptance_rate is None and rows[0].accepted_per_position == []


def test_parse_depths():
    assert parse_depths("3,0,1,3") == [0, 1, 3]
    for bad in ("a", "", "-1", "17"):
        with pytest.raises(CalibrationError):
            parse_depths(bad)


def test_sample_is_the_jobs_own_prompts_prepared_as_the_job_does(tmp_path):
    write_job_input(tmp_path / "in")
    config = parse_config(job_config(str(tmp_path / "in"), str(tmp_path / "out"), TINY_KIT))
    prompts, skipped = sample_prompts(config, Storage(), 100)
    assert len(prompts) == 30 and skipped == 2  # all good rows; the two empty prompts refused
    assert {p["id"] for p in prompts} == {f"a{i}" for i in range(20)} | {f"b{i}" for i in range(10)}
    assert all(p["prompt_token_ids"] and p["max_tokens"] == 16 and p["temperature"] == 0.0 for p in prompts)
    few, _ = sample_prompts(config, Storage(), 5, seed=1)
    assert len(few) == 5 and few == sample_prompts(config, Storage(), 5, seed=1)[0]  # the seed decides


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A real calibration on the trained tiny kit: depths 0, 1, 3 on 16 of the job's prompts."""
    root = tmp_path_factory.mktemp("calibrate")
    write_job_input(root / "in")
    config = job_config(str(root / "in"), str(root / "out"), TINY_KIT)
    config_path = root / "job.yaml"
    config_path.write_text("# tiny job\n" + yaml.safe_dump(config, sort_keys=False))
    code = calibrate_main([str(config_path), "--sample", "16", "--depths", "0,1,3", "--apply"])
    assert code == 0
    report = CalibrationReport.model_validate_json((root / "out" / "calibration" / "calibration.json").read_text())
    return root, config_path, report


def test_calibration_measures_one_row_per_depth(calibrated):
    _, _, report = calibrated
    assert [r.depth for r in report.rows] == [0, 1, 3] and report.sample_measured == 16
    assert len({r.prompt_tokens for r in report.rows}) == 1  # the same prompts at every depth
    for row in report.rows:
        assert row.prompts == 16 and row.generated_tokens > 0 and row.seconds > 0 and row.tokens_per_second > 0
        assert row.cost_per_million_generated_tokens > 0  # the default price of a 'cpu' node
    off, *on = report.rows
    assert off.num_drafts == 0 and off.acceptance_rate is None and off.speedup_vs_off == pytest.approx(1.0)
    for row in on:
        assert len(row.accepted_per_position) == row.depth and row.num_drafts > 0
        assert 0 < row.acceptance_rate <= 1 and row.mean_acceptance_length > 1  # a drafter trained for this target
        assert row.accepted_per_position == sorted(row.accepted_per_position, reverse=True)  # acceptance is a prefix
    assert any("in flight" in w for w in report.warnings)  # 16 prompts < 32 in flight: said, not hidden


def test_calibration_recommends_the_best_measured_row_and_applies_it(calibrated):
    root, config_path, report = calibrated
    (best,) = [r for r in report.rows if r.recommended]
    assert best.tokens_per_second_per_gpu == max(r.tokens_per_second_per_gpu for r in report.rows)
    assert best.cost_per_million_generated_tokens == min(r.cost_per_million_generated_tokens for r in report.rows)
    assert report.recommended_depth == best.depth
    out = root / "out" / "calibration"
    assert (out / "speculative.yaml").read_text() == report.config_snippet
    assert "| depth |" in (out / "calibration.md").read_text() and len((out / "calibration.csv").read_text().splitlines()) == 4
    applied = load_config(str(config_path))
    assert applied.speculative.enabled == (best.depth > 0)
    if best.depth:
        assert applied.speculative.num_speculative_tokens == best.depth
    assert config_path.read_text().startswith("# tiny job\n")
    assert json.loads((out / "calibration.json").read_text())["recommended_depth"] == best.depth
