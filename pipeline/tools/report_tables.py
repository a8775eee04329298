"""The cost report's tables as (header, rows) of strings, one source for its Markdown, its HTML
and the terminal; and the terminal's summary of the jobs."""

from __future__ import annotations

import posixpath
from typing import Optional, Sequence

from schemas.report import CostReport, JobFigures


def _share(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.0%}"


def _num(value: Optional[float], digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}" if abs(value) < 1e6 else f"{value:,.0f}"


def depth_label(job: JobFigures) -> str:
    """What ran, unit by unit (JobFigures.ran); the configured depth for a job without stats."""
    return job.ran or (f"k={job.num_speculative_tokens}" if job.speculative else "off")


def _replicas(job: JobFigures) -> str:
    """ "2 x 1" (replicas x GPUs each), or "3 replicas, CPU" for replicas without a GPU."""
    if job.cpu_only:
        return f"{job.replicas} replica{'s' if job.replicas != 1 else ''}, CPU"
    return f"{job.replicas} x {job.gpus_per_replica:g}"


Table = tuple[list[str], list[list[str]]]


def tables(report: CostReport) -> dict[str, Table]:
    """Every table of the report as (header, rows) of strings: one source for Markdown, HTML
    and the terminal."""
    c = report.currency
    jobs = report.jobs
    o = report.overall
    out: dict[str, Table] = {}
    out["Overall"] = (
        [
            "jobs",
            "generated tokens",
            "prompt tokens",
            "GPU-hours",
            "busy GPU-hours",
            f"cost ({c})",
            f"{c} / 1M generated",
            f"{c} / 1M total",
            "tokens/s per GPU",
            "acceptance rate",
            "mean acceptance length",
            "failed rows",
        ],
        [
            [
                str(o.jobs),
                _num(o.generated_tokens),
                _num(o.prompt_tokens),
                _num(o.gpu_hours, 4),
                _num(o.busy_gpu_hours, 4),
                _num(o.cost, 4),
                _num(o.cost_per_million_generated_tokens, 4),
                _num(o.cost_per_million_total_tokens, 4),
                _num(o.tokens_per_second_per_gpu, 1),
                _num(o.acceptance_rate),
                _num(o.mean_acceptance_length),
                _num(o.failed_rows),
            ]
        ],
    )
    out["Jobs"] = (
        [
            "job",
            "status",
            "accelerator",
            "replicas x GPUs",
            "speculation",
            "wall s",
            "GPU-hours",
            f"cost ({c})",
            f"{c} / 1M generated",
            "tokens/s per GPU",
            "failed rows",
        ],
        [
            [
                j.job_id,
                j.status,
                j.accelerator,
                _replicas(j),
                depth_label(j),
                _num(j.wall_seconds, 1),
                _num(j.gpu_hours, 4),
                _num(j.cost, 4),
                _num(j.cost_per_million_generated_tokens, 4),
                _num(j.tokens_per_second_per_gpu, 1),
                _num(j.failed_rows),
            ]
            for j in jobs
        ],
    )
    out["Engines and prefill"] = (
        [
            "job",
            "busy GPU-hours",
            "engine busy",
            "generated tokens",
            "prompt tokens",
            "prefix cache hit rate",
            "prefill tokens computed",
            f"{c} / 1M total",
            "tok/s of engine time",
            "tok/s of wall time",
        ],
        [
            [
                j.job_id,
                _num(j.busy_gpu_hours, 4),
                _share(j.utilization),
                _num(j.generated_tokens),
                _num(j.prompt_tokens),
                _share(j.prefix_cache_hit_rate),
                _num(j.computed_prompt_tokens),
                _num(j.cost_per_million_total_tokens, 4),
                _num(j.engine_tokens_per_second, 1),
                _num(j.wall_tokens_per_second, 1),
            ]
            for j in jobs
        ],
    )
    priced = {(j.accelerator, j.cpu_only): j for j in jobs if j.price_per_gpu_hour is not None}
    out["Prices"] = (
        ["accelerator", "billed", f"{c} per hour", "from"],
        [
            [kind, "node-hour" if cpu_only else "GPU-hour", _num(j.price_per_gpu_hour, 4), j.price_source or ""]
            for (kind, cpu_only), j in sorted(priced.items())
        ],
    )
    out["Start-up"] = (
        ["job", "phase", "from (s)", "seconds"],
        [[j.job_id, p.name, _num(p.started_s, 1), _num(p.seconds, 1)] for j in jobs for p in j.start_phases]
        + [
            [
                j.job_id,
                f"first unit committed ({j.engine_starts} engine start{'s' if j.engine_starts != 1 else ''})",
                "",
                _num(j.to_first_commit_seconds, 1),
            ]
            for j in jobs
            if j.to_first_commit_seconds is not None
        ],
    )
    spec_jobs = [j for j in jobs if j.speculative]
    width = max((len(j.accepted_per_position) for j in spec_jobs), default=0)
    out["Acceptance"] = (
        ["job", "speculation", "drafts", "acceptance rate", "mean acceptance length", "tokens per target pass"]
        + [f"pos {i + 1}" for i in range(width)],
        [
            [
                j.job_id,
                depth_label(j),
                _num(j.num_drafts),
                _num(j.acceptance_rate),
                _num(j.mean_acceptance_length),
                _num(j.tokens_per_target_pass),
            ]
            + [_num(j.accepted_per_position[i]) if i < len(j.accepted_per_position) else "" for i in range(width)]
            for j in spec_jobs
        ],
    )
    out["Speculation on vs off"] = (
        [
            "model",
            "accelerator",
            "speculation",
            f"{c} / 1M generated (on)",
            f"{c} / 1M generated (off)",
            f"saving {c} / 1M",
            "saving",
            "tokens/s per GPU on / off",
        ],
        [
            [
                posixpath.basename(s.model.rstrip("/")),
                s.accelerator,
                f"k={s.num_speculative_tokens}",
                _num(s.cost_per_million_generated_tokens_on, 4),
                _num(s.cost_per_million_generated_tokens_off, 4),
                _num(s.saving_per_million_generated_tokens, 4),
                f"{s.saving_fraction:+.1%}",
                f"{s.tokens_per_second_per_gpu_on:,.1f} / {s.tokens_per_second_per_gpu_off:,.1f}",
            ]
            for s in report.speculation
        ],
    )
    trials = [j for j in jobs if j.trial_outcome]
    out["Speculation trial (each job on its own first units)"] = (
        [
            "job",
            "speculation",
            "sequences at once",
            "tok/s on",
            "tok/s off",
            "on / off",
            f"{c} / 1M on",
            f"{c} / 1M off",
            "outcome",
        ],
        [
            [
                j.job_id,
                depth_label(j),
                _num(j.trial_concurrency),
                _num(j.trial_tokens_per_second_on, 1),
                _num(j.trial_tokens_per_second_off, 1),
                _num(j.trial_tokens_per_second_on / j.trial_tokens_per_second_off, 2)
                if j.trial_tokens_per_second_on and j.trial_tokens_per_second_off
                else "",
                _num(j.trial_cost_per_million_on, 4),
                _num(j.trial_cost_per_million_off, 4),
                j.trial,
            ]
            for j in trials
        ],
    )
    out["Speculation verdict"] = (
        ["job", "speculation", "verdict"],
        [[j.job_id, depth_label(j), j.speculation_verdict] for j in jobs if j.speculation_verdict],
    )
    out["Speculation flags"] = (
        ["job", "speculation", "mean acceptance length", "flag"],
        [
            [j.job_id, depth_label(j), _num(j.mean_acceptance_length, 2), flag]
            for j in jobs
            for flag in j.speculation_flags
        ],
    )
    return {title: ([in_units(report, h) for h in header], rows) for title, (header, rows) in out.items()}


def in_units(report: CostReport, text: str) -> str:
    """A report whose jobs all ran on CPU nodes bills node-hours, not GPU-hours (the figures
    are the same: one node per replica)."""
    if not report.jobs or not all(j.cpu_only for j in report.jobs):
        return text
    for gpu, node in (
        ("replicas x GPUs per replica x", "replicas x"),
        ("times GPUs per replica", "one node a replica"),
        ("replicas x GPUs", "replicas"),
        ("GPU-hour", "node-hour"),
        ("GPU-h", "node-h"),
        ("per GPU", "per node"),
        ("/GPU", "/node"),
    ):
        text = text.replace(gpu, node)
    return text


def format_terminal_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def terminal_summary(report: CostReport) -> str:
    c = report.currency
    header = [
        in_units(report, h)
        for h in [
            "job",
            "accelerator",
            "spec",
            "generated",
            "GPU-h",
            f"cost {c}",
            f"{c}/1M gen",
            "tok/s/GPU",
            "accept len",
            "failed",
        ]
    ]
    rows = [
        [
            j.job_id,
            j.accelerator,
            depth_label(j),
            _num(j.generated_tokens),
            _num(j.gpu_hours, 4),
            _num(j.cost, 4),
            _num(j.cost_per_million_generated_tokens, 4),
            _num(j.tokens_per_second_per_gpu, 1),
            _num(j.mean_acceptance_length, 2),
            _num(j.failed_rows),
        ]
        for j in report.jobs
    ]
    o = report.overall
    rows.append(
        [
            "overall",
            "",
            "",
            _num(o.generated_tokens),
            _num(o.gpu_hours, 4),
            _num(o.cost, 4),
            _num(o.cost_per_million_generated_tokens, 4),
            _num(o.tokens_per_second_per_gpu, 1),
            _num(o.mean_acceptance_length, 2),
            _num(o.failed_rows),
        ]
    )
    text = format_terminal_table(header, rows)
    for j in report.jobs:
        text += "".join(f"\nWARNING {j.job_id}: {flag}" for flag in j.speculation_flags)
    for s in report.speculation:
        verdict = "saves" if s.saving_fraction >= 0 else "costs"
        text += (
            f"\nspeculation k={s.num_speculative_tokens} on {s.accelerator} {verdict} "
            f"{abs(s.saving_fraction):.1%} ({s.cost_per_million_generated_tokens_on:,.4f} vs "
            f"{s.cost_per_million_generated_tokens_off:,.4f} {c} / 1M generated tokens)"
        )
    return text
