"""The cost report's SVG plots: acceptance by draft position, each unit's tokens/s over time,
cost per million generated tokens; and a calibration's tokens/s and acceptance by depth."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any, Sequence

from pipeline.tools import plots
from pipeline.tools.cost import JobData
from pipeline.tools.report_tables import depth_label
from schemas.report import CalibrationReport, CostReport


MAX_POINTS_PER_SERIES = 2000


def _thin(rows: Sequence[dict[str, Any]]) -> Sequence[dict[str, Any]]:
    """Every n-th unit, so that a job of many thousand units keeps the page light."""
    step = -(-len(rows) // MAX_POINTS_PER_SERIES)
    return rows[::step]


def throughput_series(job: JobData) -> list[tuple[str, list[tuple[float, float]]]]:
    """(name, (seconds since the job's first unit, unit tok/s)) per attempt that committed
    units: a line of its own each, so none is drawn across the gap between two attempts."""
    starts = sorted((dt.datetime.fromisoformat(a.started_at).timestamp(), a.number) for a in job.manifest.attempts)
    first = min(r["started_at"] for r in job.stats)
    by_attempt: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in job.stats:
        by_attempt[max((n for t, n in starts if t <= row["started_at"]), default=starts[0][1] if starts else 1)].append(
            row
        )
    name = job.manifest.job_id
    return [
        (
            f"{name}, attempt {n}" if len(by_attempt) > 1 else name,
            [(r["started_at"] - first, r["tokens_per_second"]) for r in _thin(rows)],
        )
        for n, rows in sorted(by_attempt.items())
    ]


def report_plots(report: CostReport, jobs: Sequence[JobData]) -> list[str]:
    acceptance = plots.line_chart(
        "acceptance",
        "Acceptance by draft position",
        [
            (f"{j.job_id} ({depth_label(j)})", [(i + 1, r) for i, r in enumerate(j.accepted_per_position)])
            for j in report.jobs
            if j.speculative
        ],
        "draft position",
        "share of drafts accepted",
        integer_x=True,
    )
    throughput = plots.line_chart(
        "throughput",
        "Tokens/s per unit over time",
        [series for job in jobs if job.stats for series in throughput_series(job)],
        "seconds since the job's first unit",
        "generated tokens/s (unit)",
    )
    cost = plots.bar_chart(
        "cost",
        f"Cost per million generated tokens ({report.currency})",
        [(j.job_id, j.cost_per_million_generated_tokens, f"speculation {depth_label(j)}") for j in report.jobs],
        f"{report.currency} per 1M generated tokens",
    )
    calibrations = [
        plot for job in jobs if job.calibration for plot in calibration_plots(job.calibration, job.manifest.job_id)
    ]
    return [acceptance, throughput, cost, *calibrations]


def calibration_plots(calibration: CalibrationReport, name: str = "") -> list[str]:
    """Where depth stops paying: tokens/s against concurrency, one line per depth, and the
    acceptance by draft position of each depth at the highest concurrency measured."""
    suffix = f" ({name})" if name else ""
    settings = list(
        dict.fromkeys(
            (r.depth, r.schedule) for r in sorted(calibration.rows, key=lambda r: (r.schedule is not None, r.depth))
        )
    )
    label = lambda d, schedule: f"schedule {schedule}" if schedule else "off" if d == 0 else f"k={d}"  # noqa: E731
    speed = plots.line_chart(
        f"calibration-speed{'-' + name if name else ''}",
        "Calibration: tokens/s by concurrency and depth" + suffix,
        [
            (
                label(d, sch),
                [(r.concurrency, r.tokens_per_second) for r in calibration.rows if (r.depth, r.schedule) == (d, sch)],
            )
            for d, sch in settings
        ],
        "sequences running at once",
        "generated tokens/s",
    )
    top = max(r.concurrency for r in calibration.rows)
    positions = plots.line_chart(
        f"calibration-positions{'-' + name if name else ''}",
        f"Calibration: acceptance by draft position at concurrency {top}" + suffix,
        [
            (label(r.depth, None), [(i + 1, a) for i, a in enumerate(r.accepted_per_position)])
            for r in calibration.rows
            if r.concurrency == top and r.depth and not r.schedule
        ],
        "draft position",
        "share of drafts accepted",
        integer_x=True,
    )
    return [speed, positions]
