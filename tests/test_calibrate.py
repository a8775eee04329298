"""`specbatch calibrate`: the pieces without an engine (sampling the job's own prompts, the
choice, --apply keeping comments), then a real calibration on the trained tiny kit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config, parse_config
from pipeline.storage import Storage
from tinykit import kit_paths
from pipeline.tools.calibrate import CalibrationError, parse_concurrencies, parse_depths
from pipeline.tools.calibrate import main as calibrate_main
from pipeline.tools.calibration_choice import apply_depth, best_depths, calibration_rows, schedule_from, schedule_pays
from pipeline.tools.calibration_sample import sample_prompts
from pipeline.tools.demo import sample_prompts as stdlib_lines
from schemas.report import CalibrationReport
from tests.conftest import job_config, speculation_surfaces, write_prompts

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
    write_prompts(
        folder / "b.parquet",
        {"id": [f"b{i}" for i in range(10)], "messages": [[{"role": "user", "content": t}] for t in lines[20:30]]},
    )


def test_apply_depth_edits_the_block_and_keeps_comments():
    deeper = apply_depth(CONFIG_WITH_COMMENTS, 5)
    assert "num_speculative_tokens: 5   # choose with `specbatch calibrate`" in deeper
    assert deeper.startswith("# the daily job\n") and "speculative:   # EAGLE-3.1" in deeper
    assert yaml.safe_load(deeper)["speculative"] == {
        "enabled": True,
        "drafter": "/models/d",
        "num_speculative_tokens": 5,
    }
    off = yaml.safe_load(apply_depth(CONFIG_WITH_COMMENTS, 0))
    assert off["speculative"] == {"enabled": False, "drafter": "/models/d", "num_speculative_tokens": 3}
    # A speculative block without the keys gets them; flow style is rewritten as plain YAML.
    added = yaml.safe_load(apply_depth("model: {path: /m}\nspeculative:\n  drafter: /d\n", 2))
    assert added["speculative"] == {"drafter": "/d", "enabled": True, "num_speculative_tokens": 2}
    flow = yaml.safe_load(apply_depth("speculative: {enabled: true, drafter: /d}\n", 0))
    assert flow["speculative"] == {"enabled": False, "drafter": "/d"}


def measured(depth, tokens, seconds, drafts=0, per_pos=(), concurrency=8):
    return {
        "depth": depth,
        "concurrency": concurrency,
        "prompts": 8,
        "prompt_tokens": 800,
        "generated_tokens": tokens,
        "seconds": seconds,
        "seconds_runs": [seconds * 0.98, seconds, seconds * 1.02],  # three runs: the spread every speedup carries
        "num_drafts": drafts,
        "draft_tokens": drafts * depth,
        "accepted_tokens": sum(per_pos),
        "accepted_per_position": list(per_pos),
    }


def test_recommendation_is_the_highest_throughput_per_gpu():
    rows = calibration_rows(
        [measured(2, 1200, 1.0, 100, (80, 40)), measured(0, 1000, 1.0), measured(4, 1100, 1.0, 60, (50, 30, 10, 5))],
        gpus_per_replica=2,
        price=3.6,
    )
    assert [r.depth for r in rows] == [0, 2, 4] and [r.recommended for r in rows] == [False, True, False]
    best = rows[1]
    assert best.tokens_per_second_per_gpu == pytest.approx(600) and best.speedup_vs_off == pytest.approx(1.2)
    # 2 GPUs x $3.6/h for 1 s = $0.002 for 1,200 tokens.
    assert best.cost_per_million_generated_tokens == pytest.approx(0.002 / 1200 * 1e6)
    assert best.cost_per_million_total_tokens == pytest.approx(0.002 / 2000 * 1e6)
    assert best.accepted_per_position == pytest.approx([0.8, 0.4]) and best.mean_acceptance_length == pytest.approx(2.2)
    assert min(rows, key=lambda r: r.cost_per_million_generated_tokens).recommended
    assert rows[0].acceptance_rate is None and rows[0].accepted_per_position == []


def test_each_concurrency_gets_its_best_depth_and_the_schedule_covers_every_batch_size():
    # Speculation pays at 1 and 4 sequences, costs at 64 (the shape measured on the kit).
    figures = {1: {0: 100, 3: 160}, 4: {0: 300, 3: 900}, 16: {0: 1000, 3: 1100}, 64: {0: 2000, 3: 1800}}
    rows = calibration_rows(
        [measured(k, rate, 1.0, concurrency=c) for c, by_k in figures.items() for k, rate in by_k.items()],
        gpus_per_replica=1,
        price=None,
    )
    assert best_depths(rows) == {1: 3, 4: 3, 16: 3, 64: 0}
    assert [r.speedup_vs_off for r in rows if r.concurrency == 64] == pytest.approx(
        [1.0, 0.9]
    )  # vs off at its own concurrency
    assert schedule_from(best_depths(rows), 64) == [(1, 32, 3), (33, 64, 0)]  # 32 = sqrt(16 x 64)
    assert schedule_from({1: 2, 4: 0, 16: 2}, 32) == [(1, 2, 2), (3, 8, 0), (9, 32, 2)]
    assert schedule_from({1: 3, 64: 3}, 64) is None  # one depth everywhere: no schedule
    # The schedule, measured in its own engine, pays only if it keeps up with the best single depth at 64.
    schedule_at_64 = lambda rate: {**measured(3, rate, 1.0, concurrency=64), "schedule": "1-32:3,33-64:0"}  # noqa: E731
    base = [measured(k, rate, 1.0, concurrency=c) for c, by_k in figures.items() for k, rate in by_k.items()]
    assert not schedule_pays(calibration_rows(base + [schedule_at_64(1500)], 1, None))  # k=0 still runs the drafter
    assert schedule_pays(calibration_rows(base + [schedule_at_64(2000)], 1, None))
    assert best_depths(calibration_rows(base + [schedule_at_64(9999)], 1, None))[64] == 0  # never a "depth" winner
    config = parse_config(
        job_config(
            "in",
            "out",
            TINY_KIT,
            engine={"max_num_seqs": 64},
            speculative={"depth_schedule": schedule_from(best_depths(rows), 64)},
        )
    )
    assert config.speculative.num_speculative_tokens == 3  # the schedule's largest k


def test_a_depth_schedule_is_validated_naming_the_entry():
    from pipeline.config import ConfigError

    def schedule(entries, max_num_seqs=32):
        return parse_config(
            job_config(
                "in", "out", TINY_KIT, engine={"max_num_seqs": max_num_seqs}, speculative={"depth_schedule": entries}
            )
        )

    with pytest.raises(ConfigError, match=r"\(3, 8, 2\): starts at 3; make it start at 2"):
        schedule([[1, 1, 3], [3, 8, 2], [9, 32, 0]])  # a gap
    with pytest.raises(ConfigError, match=r"\(4, 32, 0\): starts at 4; make it start at 5"):
        schedule([[1, 4, 3], [4, 32, 0]])  # an overlap
    with pytest.raises(ConfigError, match="k must be 0..16"):
        schedule([[1, 4, 17], [5, 32, 0]])
    with pytest.raises(ConfigError, match="must cover 1..engine.max_num_seqs"):
        schedule([[1, 4, 3], [5, 16, 0]])
    with pytest.raises(ConfigError, match="k is 0 everywhere"):
        schedule([[1, 32, 0]])


def test_apply_writes_a_schedule_into_the_block():
    scheduled = apply_depth(CONFIG_WITH_COMMENTS, 3, [(1, 8, 3), (9, 256, 0)])
    assert "num_speculative_tokens: 3   # choose with `specbatch calibrate`" in scheduled
    spec = yaml.safe_load(scheduled)["speculative"]
    assert spec["depth_schedule"] == [[1, 8, 3], [9, 256, 0]] and spec["enabled"] is True
    assert (
        "depth_schedule" not in yaml.safe_load(apply_depth(scheduled, 2))["speculative"]
    )  # a single depth replaces it


def test_parse_concurrencies():
    assert parse_concurrencies("1,4,16,max", 32) == [1, 4, 16, 32]
    assert parse_concurrencies("1,64,max", 8) == [1, 8]  # above what the job keeps in flight: dropped
    with pytest.raises(CalibrationError):
        parse_concurrencies("x", 8)


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
    sampling = [json.loads(p["sampling"]) for p in prompts]
    assert all(p["prompt_token_ids"] for p in prompts) and all(
        s["max_tokens"] == 16 and s["temperature"] == 0.0 for s in sampling
    )
    few, _ = sample_prompts(config, Storage(), 5, seed=1)
    assert len(few) == 5 and few == sample_prompts(config, Storage(), 5, seed=1)[0]  # the seed decides


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, ray_local):
    """A real calibration on the trained tiny kit: depths 0 and 3 at 1, 4 and 16 sequences at
    once on 16 of the job's prompts, then its job check (run_job in this process: on the
    session's Ray, which must be up first)."""
    root = tmp_path_factory.mktemp("calibrate")
    write_job_input(root / "in")
    config = job_config(str(root / "in"), str(root / "out"), TINY_KIT)
    config_path = root / "job.yaml"
    config_path.write_text("# tiny job\n" + yaml.safe_dump(config, sort_keys=False))
    code = calibrate_main(
        [
            str(config_path),
            "--sample",
            "16",
            "--depths",
            "0,3",
            "--concurrency",
            "1,4,16",
            "--repeats",
            "2",
            "--job-check",
            "32",
            "--apply",
        ]
    )
    assert code == 0
    report = CalibrationReport.model_validate_json((root / "out" / "calibration" / "calibration.json").read_text())
    return root, config_path, report


@pytest.mark.engine
def test_calibration_measures_every_depth_at_every_concurrency(calibrated):
    _, _, report = calibrated
    assert report.concurrencies == [1, 4, 16] and report.sample_measured == 16
    fixed = [r for r in report.rows if r.schedule is None]
    assert [(r.concurrency, r.depth) for r in fixed] == [
        (c, d) for c in (1, 4, 16) for d in (0, 3)
    ]  # a fresh engine per depth: two
    for row in report.rows:
        assert (
            row.prompts == min(16, max(2 * row.concurrency, 8))
            and row.generated_tokens > 0
            and row.tokens_per_second > 0
        )
        assert row.cost_per_million_generated_tokens > 0  # the default price of a 'cpu' node
    for concurrency in report.concurrencies:
        off, *on = [r for r in fixed if r.concurrency == concurrency]
        assert off.num_drafts == 0 and off.acceptance_rate is None and off.speedup_vs_off == pytest.approx(1.0)
        assert len({r.prompt_tokens for r in (off, *on)}) == 1  # the same prompts at every depth
        for row in on:
            assert len(row.accepted_per_position) == row.depth and row.num_drafts > 0
            assert 0 < row.acceptance_rate <= 1 and row.mean_acceptance_length > 1  # a drafter trained for this target
            assert row.accepted_per_position == sorted(
                row.accepted_per_position, reverse=True
            )  # acceptance is a prefix
    assert any("in flight" in w for w in report.warnings)  # 16 prompts < 32 in flight: said, not hidden


@pytest.mark.engine
def test_calibration_recommends_what_the_policy_says_of_the_measured_rows_and_applies_it(calibrated):
    """At each concurrency the fastest depth whose speedup paid over its whole spread, else off
    (the verdict is the measurement's; the test holds the rule, not the verdict). The job check
    runs the recommended settings through the job once each, shown beside vLLM alone."""
    from pipeline.speculation.policy import recommended_row
    from pipeline.speculation.speedup import row_speedup

    root, config_path, report = calibrated
    best = best_depths(report.rows)
    for concurrency, depth in best.items():
        here = [r for r in report.rows if r.concurrency == concurrency and not r.schedule]
        assert recommended_row(here).depth == depth
        for row in here:
            if row.depth:
                assert len(row.seconds_runs) == 2
                speedup = row_speedup(row)
                assert speedup.low <= row.speedup_vs_off <= speedup.high
    top = max(report.concurrencies)
    assert report.recommended_depth == best[top]
    assert report.recommendation.startswith("speculation off" if best[top] == 0 else f"speculation k={best[top]}")
    assert report.schedule_candidate == schedule_from(best, 32)
    if report.schedule_candidate:  # measured in its own engine too
        scheduled = [r for r in report.rows if r.schedule]
        assert [r.concurrency for r in scheduled] == [1, 4, 16] and not any(r.recommended for r in scheduled)
    assert report.recommended_schedule == (report.schedule_candidate if schedule_pays(report.rows) else None)
    checked = {r.setting: r for r in report.job_check}
    expected = {"off"} | ({f"depth {best[top]}"} if best[top] else set())
    expected |= {f"schedule {r.schedule}" for r in report.rows if r.schedule}
    assert set(checked) == expected
    for row in checked.values():
        assert row.rows == 32 and row.generated_tokens > 0 and row.seconds > 0
        if row.depth == 0:
            assert row.mean_acceptance_length is None
        elif not row.schedule:  # a schedule may draft nothing at the job check's concurrency (k=0 there)
            assert row.mean_acceptance_length > 1
    (marked,) = [r for r in checked.values() if r.chosen]
    assert marked.setting == (
        f"schedule {marked.schedule}"
        if report.recommended_schedule
        else ("off" if best[top] == 0 else f"depth {best[top]}")
    )
    out = root / "out" / "calibration"
    assert (out / "speculative.yaml").read_text() == report.config_snippet
    assert "| concurrency | depth |" in (out / "calibration.md").read_text()
    assert len((out / "calibration.csv").read_text().splitlines()) == 1 + len(report.rows)
    assert (out / "calibration.html").read_text().count("<svg") == 2
    applied = load_config(str(config_path))
    if report.recommended_schedule:
        assert [tuple(r) for r in applied.speculative.depth_schedule] == report.recommended_schedule
    else:
        assert (
            applied.speculative.enabled == (report.recommended_depth > 0) and applied.speculative.depth_schedule is None
        )
        if report.recommended_depth:
            assert applied.speculative.num_speculative_tokens == report.recommended_depth
    assert config_path.read_text().startswith("# tiny job\n")
    assert json.loads((out / "calibration.json").read_text())["recommended_depth"] == report.recommended_depth


@pytest.mark.engine
def test_a_job_of_the_same_models_and_settings_is_judged_by_the_stored_calibrations_costs_and_its_own_acceptance(
    calibrated, capsys
):
    """calibrate stored its result (the tests' store: tests/conftest.py). A job of the same models
    and settings at k=3, on another output location, finds it: its dry run prints the decision the
    pilot page prints (the calibration sample's acceptance), its first engine predicts from the
    probe's acceptance before any unit and keeps or turns off speculation by that prediction (no
    timed trial), and at its end _job.json, the console, status, the report, the data card and
    the dry run say its verdict in one sentence, resting on the calibration's costs and the job's
    own acceptance. Which verdict is the machine's; the test holds the words and the rule."""
    import re

    from pipeline.cli import main
    from pipeline.job.plan import plan_job
    from pipeline.job.runner import run_job
    from pipeline.speculation.calibrations import job_calibration
    from pipeline.speculation.policy import job_costs, planned_decision
    from pipeline.speculation.speedup import Speedup, Traffic, predict
    from pipeline.tools.pilot import decision
    from schemas.plan import DryRunPlan

    root, config_path, report = calibrated
    stored = list(Path(os.environ["SPECBATCH_CALIBRATIONS"]).rglob("*.json"))
    assert any(json.loads(p.read_text())["report"]["measured_at"] == report.measured_at for p in stored)
    data = yaml.safe_load(config_path.read_text())
    data["output_uri"] = str(root / "job-out")
    data["speculative"].update(enabled=True, num_speculative_tokens=3, depth_schedule=None, probe={"rows": 8})
    job_path = root / "job-k3.yaml"
    job_path.write_text(yaml.safe_dump(data))
    config = load_config(str(job_path))

    assert main(["run", str(job_path), "--dry-run", "--json"]) == 0
    out = capsys.readouterr().out
    planned = DryRunPlan.model_validate_json(out[re.search(r"(?m)^\{$", out).start() :]).speculation
    job = plan_job(config)
    found = job_calibration(config, job.location, job.target, job.drafter)
    assert planned == planned_decision(config, found) == decision(config, found.report, found.uri)
    assert planned.startswith("speculation k=3 ") and "acceptance of the calibration's sample" in planned

    manifest = run_job(config)
    trial, verdict = manifest.trial, manifest.speculation
    assert trial.method == "prediction" and trial.speculation is None and trial.off is None  # nothing timed
    assert len(manifest.attempts[0].start.engine_starts) == (2 if trial.outcome == "turned-off" else 1)
    predicted = Speedup(trial.speedup_vs_off, trial.speedup_low, trial.speedup_high, 2)
    assert trial.outcome == ("turned-off" if predicted.verdict == "cost_more" else "kept"), trial.reason
    assert "the acceptance of the probe's 8 rows of this job" in trial.reason
    said = speculation_surfaces(str(job_path), capsys)
    assert set(said.values()) == {verdict.text}, said
    assert verdict.source == "prediction" and verdict.calibration_uri == found.uri
    # a verdict unlike the pilot's says whose acceptance it used, beside the calibration sample's
    costs = job_costs(config, found)
    if verdict.verdict != predict(costs, Traffic.of_calibration(costs)).verdict:
        assert "the calibration's own sample" in verdict.text


@pytest.mark.engine
def test_the_pilot_page_shows_each_setting_and_specbatch_beside_vllm_alone_from_the_measured_figures(calibrated):
    """`specbatch pilot`'s page from a real calibration and job check (the command itself runs
    them as calibrate does: it is timed by hand on the demo's prompts, docs/speculation.md)."""
    from pipeline.speculation.speedup import row_speedup
    from pipeline.tools.pilot import pilot_tables, to_html, to_markdown

    _, _, report = calibrated
    top = max(report.concurrencies)
    (settings_title, (_, settings)), (_, (_, through)) = pilot_tables(report).items()
    assert settings_title == f"Each setting, vLLM alone at {top} sequences at once"
    measured = [r for r in report.rows if r.concurrency == top]
    assert [row[0] for row in settings] == [
        f"schedule {r.schedule}" if r.schedule else "off" if r.depth == 0 else f"depth {r.depth}" for r in measured
    ]
    assert [row[1] for row in settings] == [f"{r.tokens_per_second:,.1f}" for r in measured]
    alone = {row[0]: r for row, r in zip(settings, measured)}
    assert [row[0] for row in through] == [r.setting for r in report.job_check]
    for row, checked in zip(through, report.job_check):
        assert (
            row[1] == f"{checked.tokens_per_second:,.1f}"
            and row[2] == f"{alone[checked.setting].tokens_per_second:,.1f}"
        )
        assert row[3] == f"{checked.tokens_per_second / alone[checked.setting].tokens_per_second:.2f}x"
        assert (row[5] == "<-") is checked.chosen
    (recommended,) = [r for r in measured if r.recommended and not r.schedule]  # the policy's, with its words
    marked = [row for row in settings if row[5].startswith("<-")]
    assert [row[0] for row in marked] == ["off" if recommended.depth == 0 else f"depth {recommended.depth}"]
    reason = row_speedup(recommended).words() if recommended.depth else "no depth paid over its whole spread"
    assert marked[0][5] == f"<- {reason}"
    page = to_markdown(report, "STORE/x.json", "the decision")
    assert report.config_snippet.rstrip("\n") in page and "stored in `STORE/x.json`" in page
    assert f"Recommended: {report.recommendation}." in page and "the decision" in page
    assert to_html(report, None).count("<table>") == 2
