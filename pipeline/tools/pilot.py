"""`specbatch pilot CONFIG --sample N`: before a large job, on the node it will run on, with its
own target, drafter and a sample of its own prompts, one command says which speculation setting
to run and what it costs:

    the calibration (`specbatch calibrate`): vLLM alone, engine warm, speculation off and at
       each depth, at one sequence and at the job's sequences at once
    -> the job check: off, the best depth and the depth schedule run through specbatch itself
       on the sample (its units, actors and engine wrapper; engine start excluded)
    -> one page, OUTPUT_URI/pilot/pilot.md and pilot.html: tokens/s and cost per 1M generated
       tokens per setting, specbatch against vLLM alone per setting, the config lines to use

The calibration goes to the calibration store (pipeline/speculation/calibrations.py), so every
later job of the same models and engine settings judges its speculation by it, and a job with
`speculative.depth_from: calibration` runs the setting it recommends. On a GPU node it is the
same code: the engines are the job's.
"""

from __future__ import annotations

import argparse
import sys
from html import escape
from typing import Optional

from pipeline.config import ConfigError, JobConfig, load_config
from pipeline.inputs import InputError
from pipeline.speculation.calibrations import JobCalibration
from pipeline.speculation.policy import planned_decision
from pipeline.speculation.speedup import row_speedup
from pipeline.storage import Storage
from pipeline.tools.calibrate import CalibrationError, calibrate, store_calibration
from pipeline.tools.calibration_files import versus_off, write_results
from pipeline.tools.report_tables import format_terminal_table
from schemas.report import CalibrationReport, CalibrationRow

Table = tuple[list[str], list[list[str]]]


def _setting(row: CalibrationRow) -> str:
    return f"schedule {row.schedule}" if row.schedule else "off" if row.depth == 0 else f"depth {row.depth}"


def _num(value: Optional[float], fmt: str = ",.1f") -> str:
    return "–" if value is None else format(value, fmt)


def _why(row: CalibrationRow) -> str:
    """The recommended row's mark, with the policy's reason; a schedule is never recommended here."""
    if not row.recommended or row.schedule:
        return ""
    speedup = row_speedup(row)
    return f"<- {speedup.words()}" if speedup else "<- no depth paid over its whole spread"


def pilot_tables(report: CalibrationReport) -> dict[str, Table]:
    """The page's tables: each setting at the job's sequences at once (vLLM alone), and each
    setting of the job check through specbatch beside vLLM alone at the same setting."""
    top = max(report.concurrencies)
    at_top = [r for r in report.rows if r.concurrency == top]
    c = report.currency
    settings = (
        ["setting", "tokens/s", "tokens/s per GPU", "vs off (spread)", f"{c} / 1M generated", "recommended"],
        [
            [
                _setting(r),
                _num(r.tokens_per_second),
                _num(r.tokens_per_second_per_gpu),
                versus_off(r),
                _num(r.cost_per_million_generated_tokens, ",.4f"),
                _why(r),
            ]
            for r in at_top
        ],
    )
    alone = {_setting(r): r for r in at_top}
    through = (
        ["setting", "specbatch tokens/s", "vLLM alone tokens/s", "specbatch / vLLM alone", "rows", "chosen"],
        [
            [
                r.setting,
                _num(r.tokens_per_second),
                _num(alone[r.setting].tokens_per_second) if r.setting in alone else "–",
                _num(r.tokens_per_second / alone[r.setting].tokens_per_second, ".2f") + "x"
                if r.setting in alone and alone[r.setting].tokens_per_second
                else "–",
                str(r.rows),
                "<-" if r.chosen else "",
            ]
            for r in report.job_check
        ],
    )
    return {
        f"Each setting, vLLM alone at {top} sequences at once": settings,
        "Through specbatch, beside vLLM alone": through,
    }


def decision(config: JobConfig, report: CalibrationReport, stored: Optional[str]) -> str:
    """What a job of this config will decide, with this calibration: the dry run's and the run's words."""
    where = f"the calibration of {report.measured_at} in {stored}" if stored else "this pilot's calibration"
    return planned_decision(config, JobCalibration(report, where, stored))


def intro(report: CalibrationReport, store_uri: Optional[str]) -> list[str]:
    price = (
        f"{report.price_per_gpu_hour} {report.currency} per GPU-hour (per node-hour on CPU-only replicas)"
        if report.price_per_gpu_hour is not None
        else "no price for this accelerator: costs are blank"
    )
    return [
        f"Recommended: {report.recommendation}." if report.recommendation else "",
        f"Config `{report.config_uri}`, measured {report.measured_at} on {report.accelerator}; {price}.",
        f"{report.sample_measured} of the job's prompts (asked for {report.sample_requested}), engine max_num_seqs "
        f"{report.max_num_seqs}. vLLM alone: generated tokens over the wall time of the sample, engine warm. "
        "specbatch: over the time from its first unit entering an engine to its last commit (engine start excluded "
        "from both).",
        f"The calibration is stored in `{store_uri}`: jobs of these models, accelerator and engine settings use it."
        if store_uri
        else "No drafter: nothing is stored.",
    ]


def to_markdown(report: CalibrationReport, store_uri: Optional[str], decided: str = "") -> str:
    lines = ["# specbatch pilot", "", *intro(report, store_uri)]
    lines += ["", "## What a job of this config will decide", "", decided] if decided else []
    for title, (header, rows) in pilot_tables(report).items():
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows] or ["(none)"]
    lines += ["", "## Config lines to use", "", "```yaml", report.config_snippet.rstrip("\n"), "```"]
    lines += ["", "## Warnings", ""] + [f"- {w}" for w in report.warnings] if report.warnings else []
    return "\n".join(lines) + "\n"


def to_html(report: CalibrationReport, store_uri: Optional[str], decided: str = "") -> str:
    parts = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">',
        "<title>specbatch pilot</title><style>body{font-family:sans-serif;margin:24px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}td:first-child,th{text-align:left}"
        "</style></head><body><h1>specbatch pilot</h1>",
        *(f"<p>{escape(line)}</p>" for line in intro(report, store_uri) if line),
    ]
    if decided:
        parts.append(f"<h2>What a job of this config will decide</h2><p>{escape(decided)}</p>")
    for title, (header, rows) in pilot_tables(report).items():
        parts.append(
            f"<h2>{escape(title)}</h2><table><thead><tr>"
            + "".join(f"<th>{escape(h)}</th>" for h in header)
            + "</tr></thead><tbody>"
        )
        parts += ["<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows]
        parts.append("</tbody></table>")
    parts.append(f"<h2>Config lines to use</h2><pre>{escape(report.config_snippet)}</pre>")
    if report.warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{escape(w)}</li>" for w in report.warnings) + "</ul>")
    return "\n".join(parts + ["</body></html>"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch pilot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example:\n  specbatch pilot jobs/configs/gpu-cluster.yaml --sample 256   # on the GPU node, before the "
            "nightly job"
        ),
    )
    parser.add_argument("config", help="the job config (YAML, local path or URI)")
    parser.add_argument("--sample", type=int, default=256, help="prompts of the job's input to measure (default 256)")
    parser.add_argument("--depths", default="0,1,2,3", help="speculation depths to measure; 0 = off (default 0,1,2,3)")
    parser.add_argument("--prices", help="YAML prices adding to / replacing pipeline/tools/prices.yaml")
    parser.add_argument("--out", help="where the page goes (default OUTPUT_URI/pilot)")
    parser.add_argument("--seed", type=int, default=0, help="which rows are sampled")
    args = parser.parse_args(argv)
    if args.sample < 1:
        parser.error("--sample must be >= 1")
    try:
        config = load_config(args.config)
        storage = Storage.from_config(config.storage)
        out_uri = (args.out or storage.join(config.output_uri, "pilot")).rstrip("/")
        measure = argparse.Namespace(
            config=args.config,
            sample=args.sample,
            depths=args.depths,
            concurrency="1,max",
            job_check=args.sample,
            prices=args.prices,
            out=storage.join(out_uri, "calibration"),
            apply=False,
            seed=args.seed,
            repeats=3,
        )
        report = calibrate(measure)
        write_results(storage, measure.out, report)
        stored = store_calibration(config, storage, report, args.config)
        decided = decision(config, report, stored)
        storage.write_bytes(storage.join(out_uri, "pilot.md"), to_markdown(report, stored, decided).encode())
        storage.write_bytes(storage.join(out_uri, "pilot.html"), to_html(report, stored, decided).encode())
    except (CalibrationError, ConfigError, InputError, FileNotFoundError) as exc:
        print(f"specbatch pilot: {exc}", file=sys.stderr)
        return 2
    for title, (header, rows) in pilot_tables(report).items():
        print(f"{title}:\n{format_terminal_table(header, rows)}\n")
    print(f"recommended: {report.recommendation}")
    print(f"a job of this config will decide: {decided}")
    print(report.config_snippet, end="")
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"the page: {out_uri}/pilot.html and pilot.md" + (f"; the calibration is stored in {stored}" if stored else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
