"""What the console says, without an engine: the progress line, the ETA's pace over commits that
come in bursts and around pauses (schedules of commits made here, as engines make them), and the
summary's figures on one time line."""

from __future__ import annotations

import heapq

import pytest

from pipeline.job.console import Pace, commit_window, progress_line, summary
from schemas import Attempt, JobManifest, JobTotals, ModelFingerprint, StartCost, StartPhase

ROWS = 64  # per unit


def slots(replicas: int, in_flight: int, units: int, unit_seconds: float, late: dict[int, float]) -> list[tuple]:
    """(commit, rows, in engine from, to) of each unit when every slot of every engine runs units
    back to back, each `unit_seconds` long; engine r starts `late[r]` s late. The units in flight
    of an engine start together, so they commit in bursts."""
    free = [(late.get(r, 0.0) + 0.01 * s, r) for r in range(replicas) for s in range(in_flight)]
    heapq.heapify(free)
    done = []
    for _ in range(units):
        start, replica = heapq.heappop(free)
        done.append((start + unit_seconds, ROWS, start, start + unit_seconds))
        heapq.heappush(free, (start + unit_seconds, replica))
    return sorted(done)


def one_engine(units: int, unit_seconds: float, in_flight: int, restarts: dict[int, float]) -> list[tuple]:
    """One engine holding `in_flight` units, finishing one every `unit_seconds` in order; after the
    n-th commit in `restarts` it drains and restarts for that many seconds with no unit in it
    (the speculation trial switching its engine)."""
    done, ready, last = [], 0.0, 0.0
    for k in range(units):
        entered = max(ready, done[k - in_flight][0] if k >= in_flight else 0.0)
        last = max(entered, last) + unit_seconds
        done.append((last, ROWS, entered, last))
        if k + 1 in restarts:
            ready = last = last + restarts[k + 1]
    return done


def etas(commits: list[tuple], window: int) -> list[tuple[float, float, float | None]]:
    """(commit time, the real remainder, the ETA) at each commit, heard in order."""
    pace, total, done, end = Pace(window), len(commits) * ROWS, 0, commits[-1][0]
    seen = []
    for unit in commits:
        pace.add(*unit)
        done += unit[1]
        seen.append((unit[0], end - unit[0], pace.eta(total - done)))
    return seen


def since_first_commit(commits: list[tuple]) -> list[float | None]:
    """The ETA the console printed before (rows per second since the first commit), for contrast."""
    total, first, done, out = len(commits) * ROWS, commits[0][0], 0, []
    for at, rows, *_ in commits:
        done += rows
        out.append((total - done) / ((done - ROWS) / (at - first)) if at - first >= 1 and done > ROWS else None)
    return out


def test_the_progress_line_labels_its_speeds_and_says_when_an_eta_comes():
    pace = Pace(commit_window(replicas=1, units_in_flight=4))
    assert pace.eta_text(640, units_left=10) == "ETA after 5 more units"
    pace.add(10.0, 64, 0.0, 10.0)
    line = progress_line(64, 640, 2150.4, 180.2, 0.68, pace.eta_text(576, units_left=9))
    assert line == "64/640 rows (10%), 2,150 tok/s engine, 180 tok/s wall, acceptance 0.68, ETA after 4 more units"
    assert pace.eta_text(192, units_left=3) == "no ETA: the last 3 units are running"  # fewer than the pace needs
    for n in range(2, 6):
        pace.add(10.0 * n, 64, 10.0 * (n - 1), 10.0 * n)
        assert pace.units_to_go() == 5 - n
    assert pace.eta_text(128, units_left=2) == "ETA 20s"  # 4 units of 64 rows in 40 s of generation: 6.4 rows/s
    assert progress_line(320, 320, 2000, 300, None, pace.eta_text(0, units_left=0)).endswith("300 tok/s wall, ETA 0s")
    one = Pace(commit_window(replicas=1, units_in_flight=1))
    one.add(10.0, 64, 0.0, 10.0)
    assert one.eta_text(128, units_left=2) == "ETA after the next unit"


def test_the_eta_waits_for_a_window_of_every_slot_and_bursts_do_not_skew_it():
    """Two engines of two slots, the second starting a minute late (its engine loads on a busy
    node): commits come two at a time. The ETA comes after one unit per slot has committed after
    the first, is never more than 1.6 times the remainder, and is within a few seconds of it once
    both engines are in the window."""
    commits = slots(replicas=2, in_flight=2, units=48, unit_seconds=40.0, late={1: 60.0})
    seen = etas(commits, commit_window(2, 2))
    assert [eta for _, _, eta in seen[:4]] == [None] * 4 and seen[4][2] is not None
    for at, left, eta in seen[4:]:
        assert eta <= 1.6 * left + 10, (at, left, eta)  # + a unit's time over the four slots: the last burst
        if at >= 60.0 + 2 * 40.0:
            assert eta == pytest.approx(left, abs=10.0), (at, left, eta)


def test_an_engine_restart_in_the_window_does_not_stretch_the_eta():
    """The speculation trial: one engine of four slots measures four units, restarts without the
    drafter (two minutes with nothing in it), measures four more, restarts with it again. The rate
    since the first commit puts those pauses into the pace and overshoots several times (what a
    user saw: "ETA 785s" with about 100 s left); the pace over the window's generation time does
    not, and does not know of a restart still to come (it undershoots then, by that restart)."""
    restarts = {4: 120.0, 8: 120.0}
    commits = one_engine(units=24, unit_seconds=5.0, in_flight=4, restarts=restarts)
    seen = etas(commits, commit_window(1, 4))
    before = since_first_commit(commits)
    assert max(old / left for old, (_, left, _) in zip(before, seen) if old and left) > 3  # the old overshoot
    after_the_trial = commits[8][0]
    for at, left, eta in seen[4:-1]:
        assert eta <= left + 1, (at, left, eta)
        if at >= after_the_trial:
            assert eta == pytest.approx(left, abs=1.0), (at, left, eta)
        else:
            assert eta >= left - 120.0 - 1, (at, left, eta)  # short by the restart still to come, no more


def test_the_pace_hears_the_units_the_driver_heard_since_it_last_looked():
    """The driver's stats rows by unit, in the order heard; one looked at once, one unit at a time,
    and with a unit heard again (a retry) give the same pace."""
    rows = {
        f"u{i}": {"started_at": 10.0 * i, "wall_seconds": 10.0, "engine_seconds": 10.0, "rows": 64} for i in range(8)
    }
    at_once, one_by_one = Pace(3), Pace(3)
    at_once.take(rows)
    heard: dict[str, dict] = {}
    for unit, row in rows.items():
        heard[unit] = row
        one_by_one.take(heard)
    heard["u7"] = {**rows["u7"], "rows": 64}  # heard again: not a new unit
    one_by_one.take(heard)
    assert at_once.rows_per_second() == one_by_one.rows_per_second() == pytest.approx(3 * 64 / 30.0)
    assert list(at_once.units) == list(one_by_one.units)


def manifest_with(start: StartCost, wall_seconds: float, attempts: int = 1) -> JobManifest:
    model = ModelFingerprint(path="/m", config_sha256="0" * 64, architectures=[], files={})
    tries = [
        Attempt(number=n, started_at="2026-12-01T00:00:00+00:00", status="succeeded", skipped_rows=0)
        for n in range(1, attempts + 1)
    ]
    tries[-1].start = start
    return JobManifest(
        job_id="j",
        status="succeeded",
        started_at="2026-12-01T00:00:00+00:00",
        config={},
        model=model,
        versions={"specbatch": "dev", "vllm": None, "ray": "x", "torch": None, "python": "3"},
        accelerator="cpu",
        input_files=[],
        totals=JobTotals(
            input_rows=256,
            output_rows=250,
            error_rows=6,
            units=4,
            prompt_tokens=4710,
            generated_tokens=1042,
            wall_seconds=wall_seconds,
            tokens_per_second=1042 / wall_seconds,
            engine_busy_seconds=4.0,
            engine_tokens_per_second=260.5,
            engine_busy_share=0.1,
        ),
        attempts=tries,
    )


def test_the_summary_puts_the_wall_time_and_the_first_commit_on_one_time_line():
    """The demo's summary said "17 tok/s of wall time (61.3 s)" and "first unit committed at 74.5 s":
    the wall time counts from the start of generation, the first commit from the process start.
    Both are now said on the same line of time."""
    phase = StartPhase(name="EngineCore start: model load, KV cache, warm-up", started_s=30.0, seconds=25.0)
    start = StartCost(to_first_commit_seconds=74.5, generation_started_s=20.0, phases=[phase])
    text = "\n".join(summary(manifest_with(start, wall_seconds=61.3)))
    assert text.startswith("job j succeeded") and "256 of 256 done: 250 generated, 6 failed" in text
    assert (
        "260 tok/s of engine time, 17 tok/s of wall time (61.3 s of generation); engines busy 10% of the billed time"
        in text
    )
    assert (
        "first unit committed 54.5 s into generation (74.5 s after the process started, generation at 20.0 s); "
        "0 engine starts; longest phase: EngineCore start: model load, KV cache, warm-up 25.0 s"
    ) in text
    assert "{" not in text  # a readable block, not a JSON dump

    two = "\n".join(summary(manifest_with(start, wall_seconds=90.0, attempts=2)))
    assert "(90.0 s of generation in 2 attempts)" in two
    older = "\n".join(summary(manifest_with(StartCost(to_first_commit_seconds=74.5), wall_seconds=61.3)))
    assert (
        "first unit committed 74.5 s after the process started; 0 engine starts" in older
    )  # no generation start recorded


def test_the_summary_says_how_much_prefill_the_prefix_cache_served():
    import pyarrow as pa

    from pipeline.stages.stats import totals_from_stats
    from schemas import UnitStats, arrow_schema
    from tests.test_outputs import stats

    units = [
        stats("u1", 8, 8).model_copy(update={"prompt_tokens": 300, "cached_prompt_tokens": 128}),
        stats("u2", 8, 8).model_copy(update={"prompt_tokens": 212}),
    ]
    table = pa.Table.from_pylist([u.model_dump() for u in units], schema=arrow_schema(UnitStats))
    totals = totals_from_stats(table, input_rows=16, wall_seconds=10.0)
    assert (totals.prompt_tokens, totals.cached_prompt_tokens, totals.prefix_cache_hit_rate) == (512, 128, 0.25)
    manifest = manifest_with(StartCost(), wall_seconds=10.0)
    manifest.totals = totals
    assert (
        "16 generated from 512 prompt tokens (128 from the prefix cache, 25%; 384 computed), in 2 units"
        in summary(manifest)[2]
    )

    older = table.set_column(
        table.schema.get_field_index("cached_prompt_tokens"), "cached_prompt_tokens", pa.nulls(2, pa.int64())
    )
    assert totals_from_stats(older, 16, 10.0).cached_prompt_tokens == 0  # a stats file written before the column
    none = totals_from_stats(table.slice(0, 0), 0, 10.0)
    assert none.prefix_cache_hit_rate is None
    manifest.totals = none
    assert summary(manifest)[2] == "  tokens    0 generated from 0 prompt tokens, in 0 units"
