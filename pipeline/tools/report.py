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
import io
import posixpath
import sys
from html import escape
from typing import Any, Sequence

from pipeline.storage import Storage
from pipeline.tools import plots
from pipeline.tools.cost import JobData, ReportError, build_report, read_job
from pipeline.tools.prices import load_prices
from pipeline.tools.report_plots import report_plots
from pipeline.tools.report_tables import in_units, tables, terminal_summary
from schemas.report import CostReport


DEFINITIONS = [
    "GPU-hours: replicas x GPUs per replica x the job's wall time (what is billed); for CPU-only runs, one node per "
    "replica.",
    "Busy GPU-hours: per engine actor, the union of its units' engine intervals (units overlap), times GPUs per "
    "replica.",
    "Cost: GPU-hours x the price per GPU-hour of the job's accelerator kind.",
    "Acceptance rate: accepted / draft tokens. Mean acceptance length: 1 + accepted / drafts. Position i: share of "
    "drafts whose i-th token was accepted. Overall: every job's drafts pooled.",
    "Prefix cache hit rate: prompt tokens vLLM served from its prefix cache / prompt tokens; prefill tokens computed: "
    "the rest, the prefill the engines did.",
    "Tokens per target pass: generated tokens per target decode pass (passes: generated - accepted - completions, at "
    "least the drafting steps): what speculation saved, counting the drafts a grammar cut, which vLLM's acceptance "
    "counters leave out.",
    "Speculation on vs off: jobs on the same target model, accelerator kind, prompts and sampling, pooled per side; a "
    "negative saving means speculation cost money.",
    "Speculation trial: one engine of the job ran its first units with the configured speculation, then as many "
    "without the drafter, back to back; tok/s is that engine's generated tokens over each setting's engine time, and "
    "the cost per 1M is the price of one replica-hour at that rate.",
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
        f"<p>{escape(in_units(report, f'Generated {report.generated_at}; prices in {report.currency} per GPU-hour.'))}"
        "</p>",
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
        parts.append(
            "<h2>Warnings</h2><ul>" + "".join(f'<li class="warn">{escape(w)}</li>' for w in report.warnings) + "</ul>"
        )
    parts.append(
        "<h2>Definitions</h2><ul>" + "".join(f"<li>{escape(in_units(report, d))}</li>" for d in DEFINITIONS) + "</ul>"
    )
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
        writer.writerow(
            {
                k: ";".join(str(x) for x in v) if isinstance(v, list) else ("" if v is None else v)
                for k, v in row.items()
            }
        )
    return buffer.getvalue()


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
        prog="specbatch report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
