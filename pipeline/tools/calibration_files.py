"""The calibration report's files and tables (`specbatch calibrate`, pipeline/tools/calibrate.py):
calibration.json, .csv, .md, .html and speculative.yaml, and the terminal table."""

from __future__ import annotations

from typing import Optional

from pipeline.speculation.speedup import row_speedup
from pipeline.storage import Storage
from pipeline.tools.calibration_choice import schedule_yaml
from pipeline.tools.report import to_csv
from schemas.report import CalibrationReport, CalibrationRow


def _num(value: Optional[float], fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def versus_off(row: CalibrationRow) -> str:
    """A row's speed over off's at its concurrency, with the spread its runs allow."""
    speedup = row_speedup(row)
    if speedup is None:
        return _num(row.speedup_vs_off, ".2f") + ("x" if row.speedup_vs_off is not None else "")
    return f"{speedup.median:.2f}x ({speedup.spread})"


def table(report: CalibrationReport) -> tuple[list[str], list[list[str]]]:
    c = report.currency
    header = [
        "concurrency",
        "depth",
        "tokens/s",
        "tokens/s per GPU",
        "vs off (spread)",
        "acceptance rate",
        "mean acceptance length",
        "accepted per position",
        f"{c} / 1M generated",
        f"{c} / 1M total",
        "best here",
    ]
    rows = [
        [
            str(r.concurrency),
            (f"schedule {r.schedule}" if r.schedule else "off" if r.depth == 0 else str(r.depth)),
            f"{r.tokens_per_second:,.1f}",
            f"{r.tokens_per_second_per_gpu:,.1f}",
            versus_off(r),
            _num(r.acceptance_rate, ".3f"),
            _num(r.mean_acceptance_length, ".2f"),
            " ".join(f"{p:.2f}" for p in r.accepted_per_position) or "–",
            _num(r.cost_per_million_generated_tokens, ",.4f"),
            _num(r.cost_per_million_total_tokens, ",.4f"),
            "<-" if r.recommended else "",
        ]
        for r in report.rows
    ]
    return header, rows


def to_markdown(report: CalibrationReport) -> str:
    header, rows = table(report)
    price = (
        f"{report.price_per_gpu_hour} {report.currency} per GPU-hour (node-hour on CPU-only replicas)"
        if report.price_per_gpu_hour is not None
        else "no price"
    )
    lines = [
        "# specbatch calibration",
        "",
        f"Config `{report.config_uri}`, measured {report.measured_at} on {report.accelerator} ({price}), "
        f"{report.sample_measured} of the job's prompts (asked for {report.sample_requested}), engine max_num_seqs "
        f"{report.max_num_seqs}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "Best single depth: "
        f"{'speculation off' if report.recommended_depth == 0 else f'depth {report.recommended_depth}'} "
        + (
            "(the faster of off and the sweep's best depth through the job itself)."
            if report.job_check
            else (
                f"(highest generated tokens/s per GPU at concurrency {report.concurrencies[-1]} = lowest cost per "
                "million tokens)."
            )
        )
        + (
            f" Recommended: the schedule by concurrency `{schedule_yaml(report.recommended_schedule)}`."
            if report.recommended_schedule
            else f" The schedule `{schedule_yaml(report.schedule_candidate)}` was measured and is not recommended."
            if report.schedule_candidate
            else ""
        ),
        "",
        "```yaml",
        report.config_snippet.rstrip("\n"),
        "```",
    ]
    if report.job_check:
        lines += [
            "",
            "Through the job itself (engine start excluded):",
            "",
            "| setting | rows | tokens/s | mean acceptance length | chosen |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r.setting} | {r.rows} | {r.tokens_per_second:,.1f} | {_num(r.mean_acceptance_length, '.2f')} | "
            f"{'<-' if r.chosen else ''} |"
            for r in report.job_check
        ]
    if report.warnings:
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in report.warnings]
    return "\n".join(lines) + "\n"


def to_html(report: CalibrationReport) -> str:
    from html import escape

    from pipeline.tools import plots
    from pipeline.tools.report_plots import calibration_plots

    header, rows = table(report)
    return (
        "\n".join(
            [
                '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>specbatch calibration</title>',
                "<style>body{font-family:sans-serif;margin:24px}table{border-collapse:collapse}td,th{border:1px solid "
                "#ccc;padding:3px 8px;font-size:13px;text-align:right}" + plots.STYLE + "</style></head><body>",
                "<h1>specbatch calibration</h1>",
                "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>",
                *("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows),
                "</table>",
                f"<pre>{escape(report.config_snippet)}</pre>",
                *(f"<figure>{svg}</figure>" for svg in calibration_plots(report)),
                "</body></html>",
            ]
        )
        + "\n"
    )


def write_results(storage: Storage, out_uri: str, report: CalibrationReport) -> None:
    files = {
        "calibration.json": report.model_dump_json(indent=2) + "\n",
        "calibration.csv": to_csv(report.rows),
        "calibration.md": to_markdown(report),
        "speculative.yaml": report.config_snippet,
        "calibration.html": to_html(report),
    }
    for name, text in files.items():
        storage.write_bytes(storage.join(out_uri, name), text.encode())
