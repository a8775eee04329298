"""The acceptance guard and the Prometheus metrics, on real jobs: a random drafter accepts
nothing, so a floor on acceptance fires within its window. `warn` and the metrics are read from
the session's small job on the random kit (`random_kit_job` in tests/conftest.py, which
test_status.py reads too); `fail` has a job of its own. Unit tests of the window logic run
without any engine. `disable-speculation`, the default, is tested on a real job in
tests/test_speculation.py, where a same-shape drafter of another target slips past the probe."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from pipeline.commit.outputs import OutputLocation
from pipeline.config import GuardConfig, parse_config
from pipeline.job.runner import run_job
from pipeline.speculation.guard import AcceptanceGuard, AcceptanceTooLow
from pipeline.stages.stats import Acceptance
from pipeline.storage import Storage
from tests.conftest import (
    RANDOM_JOB_BAD,
    RANDOM_JOB_GUARD,
    RANDOM_JOB_NULL_ID,
    RANDOM_JOB_ROWS,
    calibration_report,
    job_config,
    job_metric,
    speculation_surfaces,
    write_prompts,
)

N_ROWS, ROWS_PER_UNIT, WINDOW = 96, 8, 2


# ---------------------------------------------------------------- the window logic, no engine


def stats_row(unit_id: str, drafts: int = 10, accepted: int = 0, k: int = 3) -> dict:
    return {
        "unit_id": unit_id,
        "num_drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted_tokens": accepted,
        "accepted_per_position": [0] * k,
    }


def feed(guard: AcceptanceGuard, rows: list[dict]) -> list:
    return [event for event in map(guard.observe, rows) if event]


def test_guard_waits_for_a_full_window_of_units_that_drafted():
    guard = AcceptanceGuard(GuardConfig(min_acceptance_rate=0.5, window_units=3, action="warn"))
    assert feed(guard, [stats_row("a"), stats_row("no-drafts", drafts=0), stats_row("b")]) == []
    (event,) = feed(guard, [stats_row("c")])
    assert event.unit_ids == ["a", "b", "c"] and event.metric == "acceptance_rate"
    assert (event.value, event.floor, event.action) == (0.0, 0.5, "warn")
    assert "below speculative.guard.min_acceptance_rate" in event.message


def test_guard_pools_the_window_by_draft_tokens():
    guard = AcceptanceGuard(GuardConfig(min_acceptance_rate=0.5, window_units=2))
    # 1 of 3 draft tokens and 60 of 90: per-unit rates average 0.5, pooled 61/93 is above
    assert feed(guard, [stats_row("a", drafts=1, accepted=1), stats_row("b", drafts=30, accepted=60)]) == []
    # the window slides: b and c pooled, 60/180 = 0.33
    (event,) = feed(guard, [stats_row("c", drafts=30, accepted=0)])
    assert event.unit_ids == ["b", "c"] and event.value == pytest.approx(1 / 3)


def test_guard_fires_once_while_low_and_again_after_recovering():
    guard = AcceptanceGuard(GuardConfig(min_mean_acceptance_length=1.5, window_units=2, action="fail"), attempt=2)
    low, high = stats_row("low"), stats_row("high", drafts=10, accepted=30)
    events = feed(guard, [low, low, low, low])
    assert len(events) == 1 and events[0].metric == "mean_acceptance_length" and events[0].value == 1.0
    assert events[0].attempt == 2 and events[0].action == "fail"
    assert feed(guard, [high, high]) == []  # a full window back above the floor re-arms it
    assert len(feed(guard, [low, low])) == 1


def test_a_grammar_that_cuts_the_drafts_is_judged_by_tokens_per_target_pass():
    """As the choice constraint of docs/structured-output.md reads: vLLM counts the few drafts
    the grammar left, all accepted (acceptance rate 1.000, mean acceptance length 2.00), while
    1,132 tokens in 128 completions took 1,000 decode passes: about one token per pass, nothing
    saved. The acceptance floors pass it; the tokens per pass floor does not."""
    choice = {**stats_row("choice", drafts=4, accepted=4, k=1), "generated_tokens": 1132, "samples": 128}
    assert Acceptance(4, 4, 4).tokens_per_target_pass(1132, 128) == pytest.approx(1004 / 1000)
    assert Acceptance().tokens_per_target_pass(16, 1) == 1.0  # without drafts every decode pass yields one token
    assert Acceptance().tokens_per_target_pass(1, 1) is None  # no decode pass: nothing to judge
    # Every draft accepted (k=3) over 16 tokens: 4 drafting passes, the last one's drafts counted
    # past max_tokens (16 - 12 - 1 = 3 passes by the count): the drafting steps are the floor.
    assert Acceptance(4, 12, 12).tokens_per_target_pass(16, 1) == pytest.approx(15 / 4)
    legacy = AcceptanceGuard(
        GuardConfig(min_mean_acceptance_length=1.3, min_tokens_per_target_pass=None, window_units=1)
    )
    assert feed(legacy, [choice]) == []
    (event,) = feed(AcceptanceGuard(GuardConfig(window_units=1)), [choice])  # the defaults
    assert event.metric == "tokens_per_target_pass" and event.value == pytest.approx(1.004)
    assert "below speculative.guard.min_tokens_per_target_pass = 1.3" in event.message
    unconstrained = {**stats_row("free", drafts=100, accepted=210), "generated_tokens": 400, "samples": 10}
    assert feed(AcceptanceGuard(GuardConfig(window_units=1)), [unconstrained]) == []  # 390 / 180 = 2.17 per pass


def test_guard_is_on_by_default_and_needs_a_floor():
    from pipeline.config import ACCEPTANCE_FLOOR, ConfigError

    base = job_config("in", "out", {"target": "t", "drafter": "d"})
    spec = {k: v for k, v in base["speculative"].items() if k != "guard"}
    guard = parse_config({**base, "speculative": spec}).speculative.guard
    assert (guard.action, guard.min_mean_acceptance_length, guard.min_acceptance_rate) == (
        "disable-speculation",
        ACCEPTANCE_FLOOR,
        None,
    )
    assert parse_config({**base, "speculative": {**spec, "guard": None}}).speculative.guard is None  # turned off
    with pytest.raises(
        ConfigError,
        match=(
            r"speculative\.guard needs a floor: set speculative\.guard\.min_mean_acceptance_length .* or "
            r"speculative\.guard\.min_acceptance_rate"
        ),
    ):
        parse_config(
            {
                **base,
                "speculative": {
                    **spec,
                    "guard": {"min_mean_acceptance_length": None, "min_tokens_per_target_pass": None, "action": "fail"},
                },
            }
        )
    with pytest.raises(ConfigError, match="speculative.guard.action"):
        parse_config({**base, "speculative": {**spec, "guard": {"min_acceptance_rate": 0.1, "action": "stop"}}})


def test_the_verdict_flags_acceptance_below_the_floor_and_a_measured_loss():
    from pipeline.speculation.calibrations import JobCalibration
    from pipeline.speculation.policy import speculation_verdict
    from pipeline.tools.calibration_choice import calibration_rows
    from schemas import JobTotals
    from schemas.report import CalibrationReport

    config = parse_config(
        job_config(
            "in",
            "out",
            {"target": "t", "drafter": "d"},
            engine={"max_num_seqs": 32},
            speculative={"depth_schedule": [[1, 4, 3], [5, 32, 1]]},
        )
    )
    from pipeline.stages.stats import Acceptance

    def totals(accepted: int) -> JobTotals:
        return JobTotals(units=4, **Acceptance(100, 300, accepted).summary())

    poor = speculation_verdict(config, totals(3), [])
    assert poor.below_floor and poor.cost_more_than_saved is True and "below the floor 1.3" in poor.flags[0]
    good = totals(150)
    unmeasured = speculation_verdict(config, good, [])
    assert not unmeasured.below_floor and unmeasured.cost_more_than_saved is None and unmeasured.flags == []

    def calibration(k1_seconds: float) -> CalibrationReport:
        """Off and depth 1 at 32 sequences, three runs each; depth 1 kept half its drafts."""
        cells = [
            {
                "depth": k,
                "concurrency": 32,
                "prompts": 64,
                "completions": 64,
                "prompt_tokens": 640,
                "generated_tokens": 64 + 6000,
                "seconds": seconds,
                "seconds_runs": [seconds * 0.99, seconds, seconds * 1.01],
                "num_drafts": 4000 if k else 0,
                "draft_tokens": 4000 if k else 0,
                "accepted_tokens": 2000 if k else 0,
                "accepted_per_position": [2000] if k else [],
            }
            for k, seconds in ((0, 10.0), (1, k1_seconds))
        ]
        return calibration_report(
            calibration_rows(cells, 1, None), config_uri="c", measured_at="t", price_per_gpu_hour=None
        )

    where = "the calibration of t in STORE/abc.json"
    # the job's own acceptance at depth 1 (the schedule's k at 32): 150 of 300 drafts... per position
    good = good.model_copy(update={"accepted_per_position": [50], "tokens_per_target_pass": 1.5})
    # one step off: 10 s / 6000; at k=1 the job yields 1.5 tokens a step: 1.5 x (10 / 6000) / (s / 4000)
    slower = speculation_verdict(config, good, [], JobCalibration(calibration(11.0), where, "STORE/abc.json"))
    assert slower.cost_more_than_saved is True and slower.source == "prediction"
    assert slower.speedup == pytest.approx(1.5 * 4000 / 6000 * 10 / 11, rel=1e-3)
    assert slower.text.startswith("speculation 1-4:3,5-32:1 cost more than it saved: 0.91x of off")
    faster = speculation_verdict(config, good, [], JobCalibration(calibration(8.0), where, "STORE/abc.json"))
    assert faster.cost_more_than_saved is False and faster.verdict == "paid" and faster.calibration_uri
    assert unmeasured.source == "none" and "specbatch calibrate" in unmeasured.source_detail
    none_here = speculation_verdict(
        config, good, [], JobCalibration(None, "no calibration of this target and drafter in STORE")
    )
    assert (
        none_here.source == "none"
        and "no calibration of this target and drafter in STORE" in none_here.cost_unknown_because
    )
    assert (
        speculation_verdict(
            config.model_copy(update={"speculative": config.speculative.model_copy(update={"enabled": False})}),
            good,
            [],
        )
        is None
    )


# ---------------------------------------------------------------- real jobs on a random drafter


def guarded_job(root, kit, action: str):
    ids = [f"g-{i:03d}" for i in range(N_ROWS)]
    write_prompts(
        root / "in" / "p.parquet", {"id": ids, "prompt": [f"def f{i}(x):\n    return" for i in range(N_ROWS)]}
    )
    config = parse_config(
        job_config(
            str(root / "in"),
            str(root / "out"),
            kit,
            speculative={"guard": {"min_acceptance_rate": 0.5, "window_units": WINDOW, "action": action}},
            resources={"rows_per_unit": ROWS_PER_UNIT, "units_in_flight": 2},
        )
    )
    return ids, config, OutputLocation(Storage(), config.output_uri)


def run_guarded(root, kit, action: str):
    ids, config, location = guarded_job(root, kit, action)
    try:
        run_job(config, progress=False)
        error = None
    except AcceptanceTooLow as exc:
        error = exc
    return ids, location, error


@pytest.fixture(scope="module")
def fail_run(tmp_path_factory, ray_local, random_kit):
    return run_guarded(tmp_path_factory.mktemp("guard-fail"), random_kit, "fail")


def assert_exactly_once(location: OutputLocation, ids: list[str]) -> None:
    outputs, errors = location.read_table("outputs"), location.read_table("errors")
    landed = outputs.column("id").to_pylist() + (errors.column("id").to_pylist() if errors.num_rows else [])
    assert Counter(landed) == Counter(ids)


@pytest.mark.engine
def test_without_a_calibration_or_a_trial_every_surface_says_the_floors_verdict_in_the_same_words(
    random_kit_job, capsys
):
    """The random drafter accepts nothing and the job has no calibration (its trial is skipped: 4
    units): the floors decide, and _job.json, the console, status, the report, the data card and
    the dry run say it in one sentence."""
    root, manifest, _ = random_kit_job
    said = speculation_surfaces(str(root / "job.yaml"), capsys)
    verdict = OutputLocation(Storage(), str(root / "out")).job_manifest().speculation
    assert set(said.values()) == {verdict.text}, said
    assert verdict.source == "none" and verdict.cost_more_than_saved is True
    assert verdict.text.startswith("speculation k=3 cost more than it saved: mean acceptance length 1.00")


@pytest.mark.engine
def test_warn_records_one_event_and_the_job_goes_on(random_kit_job):
    root, manifest, _ = random_kit_job
    location = OutputLocation(Storage(), str(root / "out"))
    assert manifest.status == location.read_manifest()["status"] == "succeeded"
    (event,) = location.read_manifest()[
        "guard_events"
    ]  # acceptance stays at 0 over 4 units: one event, not one per unit
    assert (
        event["action"] == "warn"
        and event["value"] == 0.0
        and len(event["unit_ids"]) == RANDOM_JOB_GUARD["window_units"]
    )
    stats = location.read_table("stats").to_pylist()
    assert len(stats) == 4 and all(r["speculative"] and not r["speculation_disabled_by_guard"] for r in stats)
    ids = [
        "" if i == RANDOM_JOB_NULL_ID else f"r{i}" for i in range(RANDOM_JOB_ROWS)
    ]  # a null id lands in errors/ as ""
    assert_exactly_once(location, ids)


@pytest.mark.engine
def test_fail_stops_the_job_and_says_why(fail_run):
    ids, location, error = fail_run
    assert error is not None and "min_acceptance_rate" in str(error)
    manifest = location.read_manifest()
    assert manifest["status"] == "failed" and manifest["attempts"][-1]["status"] == "failed"
    assert manifest["attempts"][-1]["error"].startswith("AcceptanceTooLow: acceptance rate 0.000 over the last 2 units")
    (event,) = manifest["guard_events"]
    assert event["action"] == "fail" and len(event["unit_ids"]) == WINDOW
    committed = {r["unit_id"] for r in location.read_table("stats").to_pylist()}
    assert set(event["unit_ids"]) <= committed and len(committed) < N_ROWS // ROWS_PER_UNIT


# ---------------------------------------------------------------- Prometheus metrics


@pytest.mark.engine
def test_metrics_are_exported_per_job_and_replica(random_kit_job):
    root, manifest, text = random_kit_job
    job_id, totals = manifest.job_id, manifest.totals
    replicas = {r["actor_id"] for r in OutputLocation(Storage(), str(root / "out")).read_table("stats").to_pylist()}
    rows = job_metric(text, "ray_specbatch_rows_done_total", job_id)
    assert sum(rows.values()) == totals.output_rows == RANDOM_JOB_ROWS - len(RANDOM_JOB_BAD), (
        f"rows done exported: {rows}"
    )
    assert set(rows) == replicas
    assert sum(job_metric(text, "ray_specbatch_generated_tokens_total", job_id).values()) == totals.generated_tokens > 0
    assert sum(job_metric(text, "ray_specbatch_prompt_tokens_total", job_id).values()) == totals.prompt_tokens > 0
    assert (
        sum(job_metric(text, "ray_specbatch_cached_prompt_tokens_total", job_id).values())
        == totals.cached_prompt_tokens
        > 0
    )
    assert sum(job_metric(text, "ray_specbatch_draft_tokens_total", job_id).values()) == totals.draft_tokens > 0
    assert set(job_metric(text, "ray_specbatch_acceptance_rate", job_id).values()) == {0.0}
    assert set(job_metric(text, "ray_specbatch_mean_acceptance_length", job_id).values()) == {1.0}
    assert set(job_metric(text, "ray_specbatch_tokens_per_target_pass", job_id).values()) == {1.0}  # nothing accepted
    assert set(job_metric(text, "ray_specbatch_tokens_per_second", job_id)) == replicas
    assert all(v > 0 for v in job_metric(text, "ray_specbatch_tokens_per_second", job_id).values())


def test_grafana_dashboard_plots_the_exported_metrics():
    import json
    from pathlib import Path

    from pipeline.stages.metrics import COUNTERS, GAUGES

    exported = {f"ray_specbatch_{name}_total" for name in COUNTERS} | {f"ray_specbatch_{name}" for name in GAUGES}
    # the driver's own gauges, named where they are made (pipeline/job/watch.py: seconds since the last commit)
    runtime = " ".join(p.read_text() for p in (Path(__file__).parents[1] / "pipeline").rglob("*.py"))
    driver = {f"ray_{name}" for name in re.findall(r'Gauge\(\s*"(specbatch_\w+)"', runtime)}
    assert "ray_specbatch_seconds_since_last_commit" in driver
    exported |= driver
    dashboard = json.loads((Path(__file__).parents[1] / "infra" / "grafana" / "specbatch.json").read_text())
    queries = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    assert set(re.findall(r"ray_specbatch_\w+", queries)) == exported  # the names Prometheus sees
