"""The speculation policy's arithmetic on recorded measurements, without an engine: the spread
rule, the model that combines a calibration's step costs with a job's own acceptance, and the
decisions and words every surface prints (pipeline/speculation/policy.py)."""

from __future__ import annotations

import pytest

from pipeline.config import parse_config
from pipeline.speculation.calibrations import JobCalibration
from pipeline.speculation.policy import (
    early_decision,
    planned_decision,
    recommendation_text,
    speculation_verdict,
    trial_decision,
    verdict_text,
)
from pipeline.speculation.speedup import Speedup, Traffic, costs_from, predict
from pipeline.speculation.trial import too_few_units
from pipeline.tools.calibration_choice import calibration_rows
from schemas import JobTotals, ProbeResult, TrialArm
from schemas.report import CalibrationReport
from tests.conftest import calibration_report, job_config

PROMPTS, TOKENS = 64, 65  # per run: 64 completions of 65 tokens, 64 decode steps' worth each


def config_with(**speculative):
    return parse_config(
        job_config(
            "/tmp/in",
            "/tmp/out",
            {"target": "t", "drafter": "d"},
            engine={"max_num_seqs": 16},
            resources={"rows_per_unit": 16, "units_in_flight": 1},
            speculative=speculative,
        )
    )


def measured(depth: int, seconds: list[float], concurrency: int = 16, accepted: float = 2.0) -> dict:
    """One calibration cell: 64 completions; off, 64 decode steps each; at depth 3, `accepted`
    drafts kept per step (every step accepts the same prefix), so 64 / (1 + accepted) steps."""
    decode = PROMPTS * (TOKENS - 1)
    drafts = round(decode / (1 + accepted)) if depth else 0
    per_position = [drafts if accepted > i else 0 for i in range(depth)]
    return {
        "depth": depth,
        "concurrency": concurrency,
        "prompts": PROMPTS,
        "completions": PROMPTS,
        "prompt_tokens": 640,
        "generated_tokens": PROMPTS * TOKENS,
        "seconds": sorted(seconds)[len(seconds) // 2],
        "seconds_runs": seconds,
        "num_drafts": drafts,
        "draft_tokens": depth * drafts,
        "accepted_tokens": round(accepted * drafts),
        "accepted_per_position": per_position,
    }


def calibration(spec_seconds: list[float], off_seconds: list[float], accepted: float = 2.0) -> CalibrationReport:
    rows = calibration_rows([measured(0, off_seconds), measured(3, spec_seconds, accepted=accepted)], 1.0, None)
    return calibration_report(rows, concurrencies=[16], max_num_seqs=16, measured_at="2026-12-07T00:00:00Z")


def test_a_verdict_says_paid_or_cost_more_only_when_the_whole_spread_lies_on_one_side_of_one():
    assert Speedup.of_rates([110, 120, 115], [100, 101, 99]).verdict == "paid"
    assert Speedup.of_rates([80, 85, 90], [100, 101, 99]).verdict == "cost_more"
    straddles = Speedup.of_rates([110, 80, 95], [100, 101, 99])  # the 1.10x and 0.80x, minutes apart
    assert straddles.verdict == "no_difference"
    assert straddles.words() == f"no difference this measurement can show ({straddles.spread})"
    assert straddles.spread == "0.79x-1.11x"
    once = Speedup.of_rates([130], [100])  # one run on a side: no spread, no verdict
    assert once.verdict == "no_difference" and "measured once" in once.words()


def test_on_its_own_sample_the_model_gives_back_the_calibrations_measured_speedup():
    """E_k x T_off / T_k is an identity on the calibration's own traffic: its speedup, spread and all."""
    report = calibration(spec_seconds=[4.0, 4.2, 4.1], off_seconds=[6.0, 6.3, 6.1])
    spec = next(r for r in report.rows if r.depth == 3)
    costs = costs_from(report, 3, 16, "store/x.json")
    predicted = predict(costs, Traffic.of_calibration(costs))
    assert predicted.median == pytest.approx(spec.speedup_vs_off, rel=1e-9)
    assert (predicted.low, predicted.high) == pytest.approx((spec.speedup_low, spec.speedup_high), rel=1e-9)
    assert spec.speedup_low == pytest.approx(6.0 / 4.2) and spec.speedup_high == pytest.approx(6.3 / 4.0)


def test_only_the_calibrations_costs_are_reused_a_job_of_other_prompts_is_judged_by_its_own_acceptance():
    """The issue's case: a calibration on question answering (every draft kept: 4 tokens a step)
    paid; a job of code prompts accepting 1 draft a step is predicted to cost more, and says
    whose acceptance it used beside the calibration's."""
    report = calibration(spec_seconds=[3.0, 3.1, 3.05], off_seconds=[6.0, 6.1, 6.05], accepted=3.0)
    costs = costs_from(report, 3, 16)
    own = predict(costs, Traffic.of_calibration(costs))
    assert own.verdict == "paid" and own.median == pytest.approx(2.0, rel=0.02)
    code = Traffic([0.5, 0.0, 0.0], "this job's 1,000 drafts")  # E_3 = 1.5 tokens a step
    job = predict(costs, code)
    assert job.verdict == "cost_more" and job.median == pytest.approx(own.median * 1.5 / 4.0, rel=1e-6)
    shallower = Traffic([0.9, 0.8, 0.7], "x", tokens_per_step=3.4)
    assert shallower.length(3) == 3.4 and shallower.length(2) == pytest.approx(2.7)  # truncated from positions


def test_the_jobs_verdict_is_a_prediction_from_its_own_units_and_every_surface_reads_its_sentence():
    config = config_with()
    report = calibration(spec_seconds=[3.0, 3.1, 3.05], off_seconds=[6.0, 6.1, 6.05], accepted=3.0)
    found = JobCalibration(report, "the calibration of 2026-12-07 in store/x.json", "store/x.json")
    totals = JobTotals(
        units=4, num_drafts=1000, draft_tokens=3000, accepted_tokens=500, accepted_per_position=[500, 0, 0],
        mean_acceptance_length=1.5, tokens_per_target_pass=1.5, generated_tokens=1564, samples=64,
    )  # fmt: skip
    verdict = speculation_verdict(config, totals, [], found, None)
    assert verdict.source == "prediction" and verdict.verdict == "cost_more" and verdict.cost_more_than_saved is True
    assert verdict.calibration_uri == "store/x.json" and verdict.acceptance_from == "this job's 1,000 drafts"
    assert verdict_text(verdict) == verdict.text
    assert verdict.text.startswith("speculation k=3 cost more than it saved: ")
    assert "mean acceptance length 1.50; the calibration's own sample: 4.00" in verdict.text
    unmeasured = speculation_verdict(config, totals, [], JobCalibration(None, "no calibration in s"), None)
    assert unmeasured.source == "none" and unmeasured.verdict is None
    assert unmeasured.text.startswith("whether speculation k=3 paid is not known: the job ran no speculation trial")


def test_a_job_predicted_to_lose_turns_speculation_off_at_its_first_engine_and_says_so():
    config = config_with()
    report = calibration(spec_seconds=[3.0, 3.1, 3.05], off_seconds=[6.0, 6.1, 6.05], accepted=3.0)
    costs = costs_from(report, 3, 16, "store/x.json")
    probe = ProbeResult(
        measured_at="t", rows=16, num_speculative_tokens=3, max_model_len=512, prompt_tokens=160,
        generated_tokens=16 * 65, seconds=1.0, tokens_per_second=1040.0, num_drafts=1000, draft_tokens=3000,
        accepted_tokens=100, acceptance_rate=0.03, mean_acceptance_length=1.1, accepted_per_position=[0.1, 0.0, 0.0],
        floor=1.0, tokens_per_target_pass=1.1, passed=True,
    )  # fmt: skip
    lose = early_decision(config, costs, probe)
    assert lose.outcome == "turned-off" and lose.method == "prediction" and lose.speedup_high < 1
    assert lose.reason.endswith(": turned off for this job") and "the probe's 16 rows of this job" in lose.reason
    every = {"accepted_per_position": [1.0, 1.0, 1.0], "tokens_per_target_pass": 4.0}
    good = early_decision(config, costs, probe.model_copy(update=every))
    assert good.outcome == "kept" and good.speedup_low > 1
    assert early_decision(config, costs, None).outcome == "kept"


def test_the_trial_keeps_speculation_only_when_it_paid_over_its_units_spread():
    config = config_with(trial={"units": 2, "margin": 0.0})

    def arm(setting: str, rates: list[float]) -> TrialArm:
        rate = sum(rates) / len(rates)
        return TrialArm(
            setting=setting, units=len(rates), rows=32, generated_tokens=4096, seconds=4096 / rate,
            tokens_per_second=rate, unit_tokens_per_second=rates,
        )  # fmt: skip

    paid = trial_decision(config, arm("k=3", [1300, 1350]), arm("off", [1000, 1020]), 10_000, 1, 1.0)
    assert paid.outcome == "kept" and paid.speedup_low > 1 and " paid: " in paid.reason
    noise = trial_decision(config, arm("k=3", [1250, 900]), arm("off", [1000, 1020]), 10_000, 1, 1.0)
    assert noise.outcome == "turned-off" and "no difference this measurement can show (0.88x-1.25x)" in noise.reason


def test_the_dry_run_and_the_pilot_print_the_decision_the_run_will_make():
    config = config_with()
    report = calibration(spec_seconds=[8.0, 8.1, 8.2], off_seconds=[6.0, 6.1, 6.05], accepted=3.0)
    found = JobCalibration(report, "the calibration of 2026-12-07 in store/x.json", "store/x.json")
    said = planned_decision(config, found)
    assert said.startswith("speculation k=3 cost more than it saved: ") and "the run turns it off" in said
    assert "acceptance of the calibration's sample (mean acceptance length 4.00)" in said
    without = planned_decision(config, JobCalibration(None, "no calibration of this target and drafter in s"))
    assert "the trial measures it against off on the job's first units" in without
    assert planned_decision(config.without_speculation(), found).startswith("speculation off")
    assert recommendation_text(report, 16).startswith("speculation off: at 16 sequences at once, vLLM alone, 3 runs")


def test_a_trial_too_small_says_the_rows_its_head_units_would_need():
    """The issue's 2,400-row job: units of 4,096 rows, 256 sequences at once: a trial of 2 x 4
    units needs 16 head units of 256 rows, 4,096 rows, not 65,536."""
    config = parse_config(
        job_config(
            "/tmp/in",
            "/tmp/out",
            {"target": "t", "drafter": "d"},
            engine={"max_num_seqs": 256},
            resources={"rows_per_unit": 4096, "units_in_flight": 1},
        )
    )
    skipped = too_few_units(config, 1, 2400, None)
    assert "at least 4,096 rows, in units of 256 rows" in skipped.reason
