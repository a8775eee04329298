"""`specbatch report OUTPUT_URI... [--prices FILE] [--out URI]`: what the jobs cost, from what
they wrote (each output's `_job.json` and committed `stats/` rows, nothing else).

Per job and overall: GPU-hours (billed: replicas x GPUs x wall time; busy: engine time), tokens,
cost per million generated / total tokens, tokens/s per GPU, acceptance; and, for jobs on the
same target model and accelerator kind with speculation on and off, the saving or loss.

Written to `OUTPUT_URI/report/` for one job. For several jobs, to `--out URI`, by default the
`report/` folder under the outputs' deepest common folder (e.g. `s3://b/outputs/daily/report/`
for `s3://b/outputs/daily/2026-11-28/ s3://b/outputs/daily/2026-11-29/`):
report.md, report.html (self-contained, inline SVG plots), report.json (schemas.CostReport),
report.csv (one schemas.JobFigures row per job). A summary table goes to the terminal.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import posixpath
import sys
from collections import defaultdict
from html import escape
from typing import Any, Optional, Sequence

from pipeline.storage import Storage
from pipeline.tools import plots
from pipeline.tools.cost import JobData, ReportError, build_report, read_job
from pipeline.tools.prices import load_prices
from schemas.report import CalibrationReport, CostReport, JobFigures


def _share(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.0%}"


def _num(value: Optional[float], digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}" if abs(value) < 1e6 else f"{value:,.0f}"


def _depth(job: JobFigures) -> str:
    return f"k={job.num_speculative_tokens}" if job.speculative else "off"


def _replicas(job: JobFigures) -> str:
    """"2 x 1" (replicas x GPUs each), or "3 replicas, CPU" for replicas without a GPU."""
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
        ["jobs", "generated tokens", "prompt tokens", "GPU-hours", "busy GPU-hours", f"cost ({c})",
         f"{c} / 1M generated", f"{c} / 1M total", "tokens/s per GPU", "acceptance rate", "mean acceptance length",
         "failed rows"],
        [[str(o.jobs), _num(o.generated_tokens), _num(o.prompt_tokens), _num(o.gpu_hours, 4), _num(o.busy_gpu_hours, 4),
          _num(o.cost, 4), _num(o.cost_per_million_generated_tokens, 4), _num(o.cost_per_million_total_tokens, 4),
          _num(o.tokens_per_second_per_gpu, 1), _num(o.acceptance_rate), _num(o.mean_acceptance_length),
          _num(o.failed_rows)]],
    )
    out["Jobs"] = (
        ["job", "status", "accelerator", "replicas x GPUs", "speculation", "wall s", "GPU-hours", f"cost ({c})",
         f"{c} / 1M generated", "tokens/s per GPU", "failed rows"],
        [[j.job_id, j.status, j.accelerator, _replicas(j), _depth(j), _num(j.wall_seconds, 1), _num(j.gpu_hours, 4),
          _num(j.cost, 4), _num(j.cost_per_million_generated_tokens, 4), _num(j.tokens_per_second_per_gpu, 1),
          _num(j.failed_rows)] for j in jobs],
    )
    out["Engines and prefill"] = (
        ["job", "busy GPU-hours", "engine busy", "generated tokens", "prompt tokens", "prefix cache hit rate",
         "prefill tokens computed", f"{c} / 1M total", "tok/s of engine time", "tok/s of wall time"],
        [[j.job_id, _num(j.busy_gpu_hours, 4), _share(j.utilization), _num(j.generated_tokens), _num(j.prompt_tokens),
          _share(j.prefix_cache_hit_rate), _num(j.computed_prompt_tokens), _num(j.cost_per_million_total_tokens, 4),
          _num(j.engine_tokens_per_second, 1), _num(j.wall_tokens_per_second, 1)] for j in jobs],
    )
    priced = {(j.accelerator, j.cpu_only): j for j in jobs if j.price_per_gpu_hour is not None}
    out["Prices"] = (
        ["accelerator", "billed", f"{c} per hour", "from"],
        [[kind, "node-hour" if cpu_only else "GPU-hour", _num(j.price_per_gpu_hour, 4), j.price_source or ""]
         for (kind, cpu_only), j in sorted(priced.items())],
    )
    out["Start-up"] = (
        ["job", "phase", "from (s)", "seconds"],
        [[j.job_id, p.name, _num(p.started_s, 1), _num(p.seconds, 1)] for j in jobs for p in j.start_phases]
        + [[j.job_id, f"first unit committed ({j.engine_starts} engine start{'s' if j.engine_starts != 1 else ''})",
            "", _num(j.to_first_commit_seconds, 1)] for j in jobs if j.to_first_commit_seconds is not None],
    )
    spec_jobs = [j for j in jobs if j.speculative]
    width = max((len(j.accepted_per_position) for j in spec_jobs), default=0)
    out["Acceptance"] = (
        ["job", "speculation", "drafts", "acceptance rate", "mean acceptance length", "tokens per target pass"]
        + [f"pos {i + 1}" for i in range(width)],
        [[j.job_id, _depth(j), _num(j.num_drafts), _num(j.acceptance_rate), _num(j.mean_acceptance_length),
          _num(j.tokens_per_target_pass)]
         + [_num(j.accepted_per_position[i]) if i < len(j.accepted_per_position) else "" for i in range(width)]
         for j in spec_jobs],
    )
    out["Speculation on vs off"] = (
        ["model", "accelerator", "speculation", f"{c} / 1M generated (on)", f"{c} / 1M generated (off)",
         f"saving {c} / 1M", "saving", "tokens/s per GPU on / off"],
        [[posixpath.basename(s.model.rstrip("/")), s.accelerator, f"k={s.num_speculative_tokens}",
          _num(s.cost_per_million_generated_tokens_on, 4), _num(s.cost_per_million_generated_tokens_off, 4),
          _num(s.saving_per_million_generated_tokens, 4), f"{s.saving_fraction:+.1%}",
          f"{s.tokens_per_second_per_gpu_on:,.1f} / {s.tokens_per_second_per_gpu_off:,.1f}"] for s in report.speculation],
    )
    trials = [j for j in jobs if j.trial_outcome]
    out["Speculation trial (each job on its own first units)"] = (
        ["job", "speculation", "sequences at once", "tok/s on", "tok/s off", "on / off", f"{c} / 1M on", f"{c} / 1M off",
         "outcome"],
        [[j.job_id, _depth(j), _num(j.trial_concurrency), _num(j.trial_tokens_per_second_on, 1),
          _num(j.trial_tokens_per_second_off, 1),
          _num(j.trial_tokens_per_second_on / j.trial_tokens_per_second_off, 2)
          if j.trial_tokens_per_second_on and j.trial_tokens_per_second_off else "",
          _num(j.trial_cost_per_million_on, 4), _num(j.trial_cost_per_million_off, 4), j.trial] for j in trials],
    )
    out["Speculation verdict"] = (
        ["job", "speculation", "verdict"],
        [[j.job_id, _depth(j), j.speculation_verdict] for j in jobs if j.speculation_verdict],
    )
    out["Speculation flags"] = (
        ["job", "speculation", "mean acceptance length", "flag"],
        [[j.job_id, _depth(j), _num(j.mean_acceptance_length, 2), flag] for j in jobs for flag in j.speculation_flags],
    )
    return {title: ([in_units(report, h) for h in header], rows) for title, (header, rows) in out.items()}


def in_units(report: CostReport, text: str) -> str:
    """A report whose jobs all ran on CPU nodes bills node-hours, not GPU-hours (the figures
    are the same: one node per replica)."""
    if not report.jobs or not all(j.cpu_only for j in report.jobs):
        return text
    for gpu, node in (("replicas x GPUs per replica x", "replicas x"), ("times GPUs per replica", "one node a replica"),
                      ("replicas x GPUs", "replicas"), ("GPU-hour", "node-hour"), ("GPU-h", "node-h"),
                      ("per GPU", "per node"), ("/GPU", "/node")):
        text = text.replace(gpu, node)
    return text


DEFINITIONS = [
    "GPU-hours: replicas x GPUs per replica x the job's wall time (what is billed); for CPU-only runs, one node per replica.",
    "Busy GPU-hours: per engine actor, the union of its units' engine intervals (units overlap), times GPUs per replica.",
    "Cost: GPU-hours x the price per GPU-hour of the job's accelerator kind.",
    "Acceptance rate: accepted / draft tokens. Mean acceptance length: 1 + accepted / drafts. Position i: share of drafts whose i-th token was accepted. Overall: every job's drafts pooled.",
    "Prefix cache hit rate: prompt tokens vLLM served from its prefix cache / prompt tokens; prefill tokens computed: the rest, the prefill the engines did.",
    "Tokens per target pass: generated tokens per target decode pass (passes: generated - accepted - completions, at least the drafting steps): what speculation saved, counting the drafts a grammar cut, which vLLM's acceptance counters leave out.",
    "Speculation on vs off: jobs on the same target model, accelerator kind, prompts and sampling, pooled per side; a negative saving means speculation cost money.",
    "Speculation trial: one engine of the job ran its first units with the configured speculation, then as many without the drafter, back to back; tok/s is that engine's generated tokens over each setting's engine time, and the cost per 1M is the price of one replica-hour at that rate.",
]


def to_markdown(report: CostReport) -> str:
    intro = in_units(report, f"Generated {report.generated_at}; prices in {report.currency} per GPU-hour.")
    lines = ["# specbatch cost report", "", intro, ""]
    for uri in report.output_uris:
        lines.append(f"- `{uri}`")
    for title, (header, rows) in tables(report).items():
        lines += ["", f"## {title}", ""]
        if not rows:
            lines.append("(none)")
            continue
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    if report.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in report.warnings]
    lines += ["", "## Definitions", ""] + [f"- {in_units(report, d)}" for d in DEFINITIONS]
    return "\n".join(lines) + "\n"


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
        by_attempt[max((n for t, n in starts if t <= row["started_at"]), default=starts[0][1] if starts else 1)].append(row)
    name = job.manifest.job_id
    return [(f"{name}, attempt {n}" if len(by_attempt) > 1 else name,
             [(r["started_at"] - first, r["tokens_per_second"]) for r in _thin(rows)])
            for n, rows in sorted(by_attempt.items())]


def report_plots(report: CostReport, jobs: Sequence[JobData]) -> list[str]:
    acceptance = plots.line_chart(
        "acceptance",
        "Acceptance by draft position",
        [(f"{j.job_id} ({_depth(j)})", [(i + 1, r) for i, r in enumerate(j.accepted_per_position)]) for j in report.jobs if j.speculative],
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
        [(j.job_id, j.cost_per_million_generated_tokens, f"speculation {_depth(j)}") for j in report.jobs],
        f"{report.currency} per 1M generated tokens",
    )
    calibrations = [plot for job in jobs if job.calibration for plot in calibration_plots(job.calibration, job.manifest.job_id)]
    return [acceptance, throughput, cost, *calibrations]


def calibration_plots(calibration: CalibrationReport, name: str = "") -> list[str]:
    """Where depth stops paying: tokens/s against concurrency, one line per depth, and the
    acceptance by draft position of each depth at the highest concurrency measured."""
    suffix = f" ({name})" if name else ""
    settings = list(dict.fromkeys((r.depth, r.schedule) for r in sorted(calibration.rows, key=lambda r: (r.schedule is not None, r.depth))))
    label = lambda d, schedule: f"schedule {schedule}" if schedule else "off" if d == 0 else f"k={d}"  # noqa: E731
    speed = plots.line_chart(
        f"calibration-speed{'-' + name if name else ''}",
        "Calibration: tokens/s by concurrency and depth" + suffix,
        [(label(d, sch), [(r.concurrency, r.tokens_per_second) for r in calibration.rows if (r.depth, r.schedule) == (d, sch)])
         for d, sch in settings],
        "sequences running at once",
        "generated tokens/s",
    )
    top = max(r.concurrency for r in calibration.rows)
    positions = plots.line_chart(
        f"calibration-positions{'-' + name if name else ''}",
        f"Calibration: acceptance by draft position at concurrency {top}" + suffix,
        [(label(r.depth, None), [(i + 1, a) for i, a in enumerate(r.accepted_per_position)])
         for r in calibration.rows if r.concurrency == top and r.depth and not r.schedule],
        "draft position",
        "share of drafts accepted",
        integer_x=True,
    )
    return [speed, positions]


def to_html(report: CostReport, jobs: Sequence[JobData]) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<link rel="icon" href="data:,">',
        "<title>specbatch cost report</title>",
        "<style>body{font-family:sans-serif;margin:24px;color:#111}table{border-collapse:collapse;margin:8px 0 16px}"
        "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}td:first-child,th{text-align:left}"
        "th{max-width:9em}td{overflow-wrap:anywhere;max-width:40em}"
        "th{background:#f0f0f0}.warn{color:#a40}" + plots.STYLE + "</style>",
        "</head><body>",
        "<h1>specbatch cost report</h1>",
        f"<p>{escape(in_units(report, f'Generated {report.generated_at}; prices in {report.currency} per GPU-hour.'))}</p>",
        "<ul>" + "".join(f"<li><code>{escape(u)}</code></li>" for u in report.output_uris) + "</ul>",
    ]
    for title, (header, rows) in tables(report).items():
        parts.append(f"<h2>{escape(title)}</h2>")
        if not rows:
            parts.append("<p>(none)</p>")
            continue
        parts.append("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr></thead><tbody>")
        parts += ["<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append("</tbody></table>")
    parts.append("<h2>Plots</h2>")
    parts += [f"<figure>{svg}</figure>" for svg in report_plots(report, jobs)]
    if report.warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(f'<li class="warn">{escape(w)}</li>' for w in report.warnings) + "</ul>")
    parts.append("<h2>Definitions</h2><ul>" + "".join(f"<li>{escape(in_units(report, d))}</li>" for d in DEFINITIONS) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def to_csv(rows: Sequence[Any]) -> str:
    """Pydantic rows as CSV; list cells are joined with ';', nulls are empty."""
    buffer = io.StringIO()
    dumped = [r.model_dump() for r in rows]
    if not dumped:
        return ""
    writer = csv.DictWriter(buffer, fieldnames=list(dumped[0]), lineterminator="\n")
    writer.writeheader()
    for row in dumped:
        writer.writerow({k: ";".join(str(x) for x in v) if isinstance(v, list) else ("" if v is None else v) for k, v in row.items()})
    return buffer.getvalue()


def format_terminal_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def terminal_summary(report: CostReport) -> str:
    c = report.currency
    header = [in_units(report, h) for h in
              ["job", "accelerator", "spec", "generated", "GPU-h", f"cost {c}", f"{c}/1M gen", "tok/s/GPU", "accept len", "failed"]]
    rows = [
        [j.job_id, j.accelerator, _depth(j), _num(j.generated_tokens), _num(j.gpu_hours, 4), _num(j.cost, 4),
         _num(j.cost_per_million_generated_tokens, 4), _num(j.tokens_per_second_per_gpu, 1), _num(j.mean_acceptance_length, 2),
         _num(j.failed_rows)]
        for j in report.jobs
    ]
    o = report.overall
    rows.append(["overall", "", "", _num(o.generated_tokens), _num(o.gpu_hours, 4), _num(o.cost, 4),
                 _num(o.cost_per_million_generated_tokens, 4), _num(o.tokens_per_second_per_gpu, 1),
                 _num(o.mean_acceptance_length, 2), _num(o.failed_rows)])
    text = format_terminal_table(header, rows)
    for j in report.jobs:
        text += "".join(f"\nWARNING {j.job_id}: {flag}" for flag in j.speculation_flags)
    for s in report.speculation:
        verdict = "saves" if s.saving_fraction >= 0 else "costs"
        text += (f"\nspeculation k={s.num_speculative_tokens} on {s.accelerator} {verdict} "
                 f"{abs(s.saving_fraction):.1%} ({s.cost_per_million_generated_tokens_on:,.4f} vs "
                 f"{s.cost_per_million_generated_tokens_off:,.4f} {c} / 1M generated tokens)")
    return text


# ---------------------------------------------------------------- where and how it is written


def default_report_uri(output_uris: Sequence[str]) -> str:
    """`URI/report` for one job; for several, `report` under their deepest common folder."""
    uris = [u.rstrip("/") for u in output_uris]
    if len(uris) == 1:
        return uris[0] + "/report"
    schemes = {u.split("://", 1)[0] if "://" in u else "" for u in uris}
    paths = [u.split("://", 1)[-1] for u in uris]
    common = posixpath.commonpath(paths) if len(schemes) == 1 and len({p.startswith("/") for p in paths}) == 1 else ""
    if common in ("", "/", "."):
        raise ReportError("the output URIs share no folder to write a combined report under; pass --out URI")
    scheme = schemes.pop()
    return (f"{scheme}://" if scheme else "") + common + "/report"


def write_report(storage: Storage, out_uri: str, report: CostReport, jobs: Sequence[JobData]) -> list[str]:
    documents = {
        "report.json": report.model_dump_json(indent=2) + "\n",
        "report.csv": to_csv(report.jobs),
        "report.md": to_markdown(report),
        "report.html": to_html(report, jobs),
    }
    written = []
    for name, text in documents.items():
        uri = storage.join(out_uri, name)
        storage.write_bytes(uri, text.encode())
        written.append(uri)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n"
        "  specbatch report s3://bucket/outputs/daily/2026-11-29/          # one job -> .../2026-11-29/report/\n"
        "  specbatch report runs/a/output runs/b/output --out runs/report --prices my-prices.yaml",
    )
    parser.add_argument("output_uris", nargs="+", metavar="OUTPUT_URI", help="job output locations (local or s3://...)")
    parser.add_argument("--prices", help="YAML prices adding to / replacing pipeline/tools/prices.yaml")
    parser.add_argument("--out", help="where report/ files go (default: see above)")
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (as storage.endpoint_url in job configs)")
    parser.add_argument("--region")
    args = parser.parse_args(argv)
    storage = Storage(endpoint_url=args.endpoint_url, region=args.region)
    try:
        prices = load_prices(args.prices, storage)
        jobs = [read_job(storage, uri) for uri in args.output_uris]
        out_uri = (args.out or default_report_uri(args.output_uris)).rstrip("/")
    except (ReportError, FileNotFoundError, ValueError) as exc:
        print(f"specbatch report: {exc}", file=sys.stderr)
        return 2
    report = build_report(jobs, prices)
    written = write_report(storage, out_uri, report, jobs)
    print(terminal_summary(report))
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"\nreport written to {out_uri}/ ({', '.join(posixpath.basename(w) for w in written)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
