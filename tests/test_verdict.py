"""The speculation verdict's arithmetic on a mixed job, without an engine: units that
speculated, the trial's off arm and units after the trial turned speculation off. Only the
first count in acceptance and tokens per target pass (the others yield one token per pass by
definition), and what the trial measured decides whether speculation cost more than it saved.

The figures: a drafter that is always right at k=3, 64 completions a unit of 49 tokens each
(the first from the prefill, then 12 target passes of 4). Over all eight units the job read
1.23 tokens per target pass, the false grammar flag of issue 42."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.config import parse_config
from pipeline.job.console import summary
from pipeline.speculation.policy import speculation_verdict
from pipeline.speculation.policy import trial_decision as decide
from pipeline.stages.stats import totals_from_stats
from pipeline.tools.cost import JobData, job_figures
from pipeline.tools.prices import Prices
from schemas import GuardEvent, JobManifest, TrialArm, UnitStats, arrow_schema
from tests.conftest import job_config

COMPLETIONS, TOKENS, PASSES = 64, 49, 12  # each completion: 1 token from its prefill, then 12 passes


def config_with(**speculative):
    return parse_config(job_config("/tmp/in", "/tmp/out", {"target": "t", "drafter": "d"}, speculative=speculative))


def unit(n: int, speculative: bool, arm=None, accepted_per_pass: int = 3, by_guard: bool = False) -> dict:
    drafts = COMPLETIONS * PASSES if speculative else 0
    accepted = drafts * accepted_per_pass
    generated = COMPLETIONS * (1 + PASSES * (1 + accepted_per_pass)) if speculative else COMPLETIONS * TOKENS
    return UnitStats(
        unit_id=f"u{n}",
        source="s",
        first_row=n * COMPLETIONS,
        actor_id="a",
        node_id="n",
        rows=COMPLETIONS,
        output_rows=COMPLETIONS,
        error_rows=0,
        samples=COMPLETIONS,
        prompt_tokens=640,
        generated_tokens=generated,
        started_at=float(n),
        wall_seconds=1.0,
        engine_seconds=1.0,
        tokens_per_second=float(generated),
        speculative=speculative,
        num_speculative_tokens=3 if speculative else 0,
        num_drafts=drafts,
        draft_tokens=3 * drafts,
        accepted_tokens=accepted,
        acceptance_rate=None,
        mean_acceptance_length=None,
        accepted_per_position=[drafts if accepted_per_pass > i else 0 for i in range(3)] if speculative else [],
        speculation_disabled_by_guard=by_guard,
        trial_arm=arm,
    ).model_dump()


def stats_of(units: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(units, schema=arrow_schema(UnitStats))


MIXED = [unit(0, True, "on"), unit(1, True, "on"), unit(2, False, "off"), unit(3, False, "off")] + [
    unit(n, False) for n in range(4, 8)
]


def arm(setting: str, tokens_per_second: float) -> TrialArm:
    return TrialArm(
        setting=setting,
        units=2,
        rows=128,
        generated_tokens=4096,
        seconds=4096 / tokens_per_second,
        tokens_per_second=tokens_per_second,
        unit_tokens_per_second=[tokens_per_second] * 2,
    )


def test_acceptance_and_tokens_per_pass_count_only_the_units_that_speculated():
    totals = totals_from_stats(stats_of(MIXED), input_rows=512, wall_seconds=10.0)
    assert totals.units == 8 and totals.generated_tokens == 8 * COMPLETIONS * TOKENS  # every unit's tokens
    assert totals.num_drafts == 2 * COMPLETIONS * PASSES and totals.acceptance_rate == 1.0
    assert totals.mean_acceptance_length == 4.0 and totals.tokens_per_target_pass == 4.0
    line = next(
        line
        for line in summary(
            JobManifest.model_construct(job_id="j", status="succeeded", totals=totals, attempts=[], probe=None)
        )
        if "drafts" in line
    )
    assert "mean acceptance length 4.00, 4.00 tokens per target pass" in line
    assert totals_from_stats(stats_of(MIXED[2:]), 384, 10.0).tokens_per_target_pass is None  # nothing speculated


def test_a_unit_a_depth_schedule_ran_at_k0_is_left_out_but_one_whose_grammar_cut_every_draft_counts():
    """Both drafted nothing in an engine with the drafter: at k=0 of a schedule the drafter did
    not run; at a fixed depth it did, and a grammar cut every draft: what speculation saved drops."""
    undrafted = dict(unit(2, False), speculative=True, num_speculative_tokens=3)
    at_k0 = dict(undrafted, depth_schedule="1-8:3,9-64:0")
    assert totals_from_stats(stats_of(MIXED[:2] + [at_k0]), 192, 10.0).tokens_per_target_pass == 4.0
    cut = totals_from_stats(stats_of(MIXED[:2] + [undrafted]), 192, 10.0)
    # passes: 2 x 768 with drafts + 64 x 48 without; tokens after each prefill: 3 x 64 x 48
    assert cut.tokens_per_target_pass == 2.0 and cut.mean_acceptance_length == 4.0


def test_a_trial_that_measured_speculation_faster_never_says_it_cost_more():
    config = config_with(trial={"units": 2})
    totals = totals_from_stats(stats_of(MIXED), input_rows=512, wall_seconds=10.0)
    within = decide(config, arm("k=3", 1037.0), arm("off", 1000.0), 100_000, 1, 20.0)  # the 1.037x
    assert within.outcome == "turned-off"
    verdict = speculation_verdict(config, totals, [], None, within)
    assert verdict.tokens_per_target_pass == 4.0 and verdict.mean_acceptance_length == 4.0
    assert not verdict.below_floor and verdict.cost_more_than_saved is False
    assert verdict.flags == [within.reason] and "1.04x of off" in within.reason and "within the margin" in within.reason


def test_a_trial_that_measured_speculation_slower_is_the_named_reason():
    config = config_with(trial={"units": 2})
    totals = totals_from_stats(stats_of(MIXED), input_rows=512, wall_seconds=10.0)
    slower = decide(config, arm("k=3", 660.0), arm("off", 1000.0), 100_000, 1, 20.0)
    verdict = speculation_verdict(config, totals, [], None, slower)
    assert verdict.cost_more_than_saved is True and not verdict.below_floor
    assert verdict.flags == [
        f"the speculation trial measured it slower than off: it cost more than it saved ({slower.reason})"
    ]
    assert "0.66x of off" in verdict.flags[0]


def test_acceptance_below_the_floor_decides_only_what_nothing_measured():
    """A drafter accepting nothing (1 token a pass) is below the floor: without a trial that is why
    speculation cost more than it saved; a trial that measured it faster anyway decides instead."""
    config = config_with(trial={"units": 2})
    poor = [unit(0, True, "on", accepted_per_pass=0), unit(1, True, "on", accepted_per_pass=0)] + MIXED[2:]
    totals = totals_from_stats(stats_of(poor), input_rows=512, wall_seconds=10.0)
    assert totals.mean_acceptance_length == 1.0 and totals.tokens_per_target_pass == 1.0
    unmeasured = speculation_verdict(config, totals, [])
    assert unmeasured.below_floor and unmeasured.cost_more_than_saved is True
    assert unmeasured.flags[0].startswith(
        "mean acceptance length 1.00 over the units that speculated is below the floor 1.3: "
        "speculation cost more than it saved"
    )
    kept = decide(config, arm("k=3", 1200.0), arm("off", 1000.0), 100_000, 1, 20.0)
    measured = speculation_verdict(config, totals, [], None, kept)
    assert measured.below_floor and measured.cost_more_than_saved is False
    assert (
        len(measured.flags) == 1 and "below the floor 1.3" in measured.flags[0] and "cost more" not in measured.flags[0]
    )


def test_units_after_the_guard_turned_speculation_off_do_not_count_and_the_guard_is_named():
    config = config_with(trial={"units": 2})
    units = [unit(0, True), unit(1, True)] + [unit(n, False, by_guard=True) for n in range(2, 8)]
    totals = totals_from_stats(stats_of(units), input_rows=512, wall_seconds=10.0)
    event = GuardEvent(
        time="t",
        attempt=1,
        action="disable-speculation",
        metric="mean_acceptance_length",
        value=1.1,
        floor=1.3,
        unit_ids=["u0", "u1"],
        message="mean acceptance length 1.100 over the last 2 units ...",
    )
    verdict = speculation_verdict(config, totals, [event])
    assert verdict.tokens_per_target_pass == 4.0 and not verdict.below_floor
    assert verdict.flags == [f"the acceptance guard acted (disable-speculation): {event.message}"]
    assert verdict.cost_more_than_saved is None and "no speculation trial" in verdict.cost_unknown_because


def manifest_of(config, totals, **fields) -> JobManifest:
    """A finished job's manifest of these totals, as the report reads it."""
    return JobManifest(
        job_id="j",
        status="succeeded",
        started_at="t",
        config=config.model_dump(mode="json"),
        versions={"specbatch": "t", "vllm": None, "ray": "t", "torch": None, "python": "3"},
        model={"path": "/m/t", "config_sha256": "a" * 64, "architectures": []},
        accelerator="cpu",
        input_files=[],
        totals=totals,
        **fields,
    )


def test_the_report_counts_the_same_units_as_the_verdict():
    config = config_with(trial={"units": 2})
    totals = totals_from_stats(stats_of(MIXED), input_rows=512, wall_seconds=10.0)
    within = decide(config, arm("k=3", 1037.0), arm("off", 1000.0), 100_000, 1, 20.0)
    manifest = manifest_of(
        config, totals, trial=within, speculation=speculation_verdict(config, totals, [], None, within)
    )
    figures = job_figures(JobData(uri="/tmp/out", manifest=manifest, stats=MIXED), Prices(cpu={"cpu": 1.0}))
    assert figures.tokens_per_target_pass == pytest.approx(4.0) and figures.mean_acceptance_length == 4.0
    assert figures.speculative_units == 2 and figures.speculation_flags == [within.reason]


def test_the_report_says_what_ran_unit_by_unit_and_the_start_of_the_attempt_that_started_engines():
    """A job whose trial turned speculation off after two units reads 'k=3 for 128 rows, off for
    384 rows', not 'k=3'; a rerun with nothing left to do starts no engine, and the report's
    start-up figures stay those of the attempt that did (they read '(none)' before)."""
    from schemas import Attempt, EngineStart, StartCost

    config = config_with(trial={"units": 2})
    totals = totals_from_stats(stats_of(MIXED), input_rows=512, wall_seconds=10.0)
    started = StartCost(
        to_first_commit_seconds=30.0,
        engine_starts=[EngineStart(actor_id="a", node_id="n", process_started_at=1, init_started_at=2,
                                   vllm_imported_at=3, engine_ready_at=20)],
    )  # fmt: skip
    attempts = [
        Attempt(number=1, started_at="t", status="succeeded", skipped_rows=0, start=started),
        Attempt(number=2, started_at="t", status="succeeded", skipped_rows=512),  # nothing left: no engine
    ]
    manifest = manifest_of(config, totals, attempts=attempts)
    figures = job_figures(JobData(uri="/tmp/out", manifest=manifest, stats=MIXED), Prices(cpu={"cpu": 1.0}))
    assert figures.ran == "k=3 for 128 rows, off for 384 rows"
    assert figures.engine_starts == 1 and figures.to_first_commit_seconds == 30.0
