"""The pieces of the job's start and speed accounting that need no engine: the job board's
probe claim, the start-up phases and busy time over overlapping units (what the console says of
them: tests/test_console.py). The same pieces on real jobs: tests/test_job.py and
tests/test_speculation.py."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from pipeline.cluster import job_board
from pipeline.cluster.job_board import JobBoard
from pipeline.cluster.startup import StartClock, start_cost
from pipeline.stages.stats import EngineBusyTime, busy_seconds, totals_from_stats
from schemas import EngineStart, ProbeResult
from schemas.board import NO_PROBE, ProbeClaim, ProbeVerdict

START = dict(
    node_id="n",
    process_started_at=1007.0,
    init_started_at=1009.0,
    vllm_imported_at=1017.0,
    engine_core_started_at=1018.0,
    engine_ready_at=1035.0,
)


def probe_result(seconds: float = 2.0) -> ProbeResult:
    return ProbeResult(
        measured_at="2026-12-07T00:00:00+00:00",
        rows=4,
        num_speculative_tokens=3,
        max_model_len=256,
        prompt_tokens=40,
        generated_tokens=40,
        seconds=seconds,
        tokens_per_second=20.0,
        num_drafts=8,
        draft_tokens=24,
        accepted_tokens=12,
        acceptance_rate=0.5,
        mean_acceptance_length=2.5,
        accepted_per_position=[0.7, 0.5, 0.3],
        floor=1.2,
        passed=True,
    )


def test_the_probe_goes_to_the_first_engine_with_work_and_its_restart_only():
    async def scenario():
        board = JobBoard([{"id": "r"}], near_limit_rows=2)
        await board.check_in(EngineStart(actor_id="a", **START))  # checked in first, but never had a unit
        claim = await board.claim("b")
        assert claim == ProbeClaim(rows=[{"id": "r"}], near_limit_rows=2)
        assert await board.claim("a") is None  # b measures
        assert await board.claim("b") == claim  # b restarted by Ray (same actor id): handed the rows again
        assert await board.wait_verdict(0.01) is None  # no verdict yet: the waiters look again later
        board.claimed_at -= job_board.CLAIM_STALE_SECONDS + 1  # b went away for good
        assert await board.claim("a") == claim
        verdict = ProbeVerdict(result=probe_result(), refusal=None, started_at=1036.0, actor_id="a")
        await board.post(verdict)
        assert await board.wait_verdict(0.01) == verdict
        assert await board.claim("c") is None  # judged: nobody measures again
        assert [s.actor_id for s in (await board.read()).starts] == ["a"]

    asyncio.run(scenario())


def test_a_board_without_probe_rows_has_its_verdict_at_once():
    async def scenario():
        board = JobBoard([])
        assert await board.claim("a") is None
        assert await board.wait_verdict(0.01) == NO_PROBE

    asyncio.run(scenario())


def test_start_phases_lie_on_the_drivers_time_line():
    clock = StartClock()
    t0 = clock.marks["process"] = 1000.0
    clock.marks.update(
        run=1001.0,
        ray_started=1001.5,
        ray_ready=1006.0,
        planned=1005.0,
        generating=1006.2,
        graph_started=1006.5,
        first_commit=1040.0,
    )
    verdict = ProbeVerdict(result=probe_result(seconds=2.0), started_at=1036.0)
    cost = start_cost(clock, [EngineStart(actor_id="a", **START)], verdict)
    phases = {p.name: (p.started_s, p.seconds) for p in cost.phases}
    assert phases == {
        "process start and imports": (0.0, 1.0),
        "input check and planning": (1.0, 4.0),
        "Ray start": (1.5, 4.5),
        "engine actor start": (6.5, 2.5),
        "import vllm": (9.0, 8.0),
        "engine arguments and EngineCore spawn": (17.0, 1.0),
        "EngineCore start: model load, KV cache, warm-up": (18.0, 17.0),
        "drafter probe (on the job's first engine)": (36.0, 2.0),
        "first unit": (38.0, 2.0),
    }
    assert [p.started_s for p in cost.phases] == sorted(p.started_s for p in cost.phases)
    assert cost.to_first_commit_seconds == 40.0 and len(cost.engine_starts) == 1 and t0 == 1000.0
    assert cost.generation_started_s == 6.2  # where the attempt's wall time begins, on the same line


def test_busy_time_is_the_union_of_each_engines_units():
    # engine a: [0, 10] and [5, 12] overlap -> 12; then [20, 21] -> 13; engine b: [0, 4] -> 4
    units = [("a", 0.0, 10.0), ("a", 5.0, 7.0), ("a", 20.0, 1.0), ("b", 0.0, 4.0)]
    assert busy_seconds(units) == pytest.approx(17.0)
    stats = pa.table(
        {
            "actor_id": [u[0] for u in units],
            "started_at": [u[1] for u in units],
            "engine_seconds": [u[2] for u in units],
            **{
                name: [0] * 4
                for name in (
                    "rows",
                    "output_rows",
                    "error_rows",
                    "samples",
                    "retryable_error_rows",
                    "clipped_rows",
                    "prompt_tokens",
                    "cached_prompt_tokens",
                    "num_drafts",
                    "draft_tokens",
                    "accepted_tokens",
                )
            },
            "generated_tokens": [340, 0, 0, 0],
        }
    )
    totals = totals_from_stats(stats, input_rows=4, wall_seconds=20.0, replicas=2)
    assert totals.engine_busy_seconds == pytest.approx(17.0)
    assert totals.engine_tokens_per_second == pytest.approx(20.0) and totals.tokens_per_second == pytest.approx(17.0)
    assert totals.engine_busy_share == pytest.approx(17.0 / 40.0)


def test_busy_time_kept_unit_by_unit_is_the_union_so_far():
    """The progress line's engine time, kept as units are heard in any order: a unit that
    bridges two spans joins them, one inside a span adds nothing, one that only touches merges."""
    busy = EngineBusyTime()
    for (actor, start, seconds), expected in [
        (("a", 10.0, 2.0), 2.0),  # a: [10, 12]
        (("a", 0.0, 3.0), 5.0),  # a: [0, 3] [10, 12], heard late
        (("a", 5.0, 1.0), 6.0),  # a: [0, 3] [5, 6] [10, 12]
        (("b", 5.0, 1.0), 7.0),  # another engine's time adds up
        (("a", 2.0, 9.0), 13.0),  # a: [0, 12], bridging all three
        (("a", 4.0, 1.0), 13.0),  # inside: nothing new
        (("a", 12.0, 3.0), 16.0),  # touching the end: a: [0, 15]
    ]:
        busy.add(actor, start, seconds)
        assert busy.seconds == pytest.approx(expected), (actor, start, seconds)
