"""`specbatch check-drafter`: the drafter checks of pipeline/speculation/drafter_check.py as a command, with
a readable report and, with --probe N, the acceptance probe on the job's own rows."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional

from pipeline.config import validate_check_names
from pipeline.speculation.drafter_check import CHECKS, DrafterMismatch, inspect_drafter
from schemas.drafter import DrafterReport


def _fmt(value: Optional[float], spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: DrafterReport) -> str:
    d, t = report.drafter, report.target
    vmap = d.vocab_map
    vmap_text = (
        f"{vmap.size} ids -> target {vmap.min_target_id}..{vmap.max_target_id} ({vmap.source})" if vmap else "not read"
    )
    rows = [
        ("hidden size", f"{d.hidden_size} (target_hidden_size {d.target_hidden_size})", t.hidden_size),
        ("vocab size", d.vocab_size, t.vocab_size),
        ("draft vocab", f"{d.draft_vocab_size}: {vmap_text}", ""),
        (
            "aux layer ids",
            f"{d.aux_layer_ids} ({d.aux_layer_ids_source}, fc takes {d.aux_states_expected})",
            f"{t.num_hidden_layers} layers: 0..{t.num_hidden_layers}",
        ),
        ("max positions", d.max_position_embeddings, t.max_position_embeddings),
        ("dtype", f"{d.dtype} (weights {d.weights_dtype})", t.dtype),
    ]
    lines = [
        f"drafter  {d.path}",
        f"         EAGLE-{d.eagle_version} (fc_norm {d.fc_norm}, norm_output {d.norm_output}), {d.format} format, "
        f"{', '.join(d.architectures) or '?'}",
        f"         declares target {d.declared_target_name!r} {d.declared_target_fingerprint or ''}".rstrip(),
        f"target   {t.path}",
        f"         {', '.join(t.architectures) or '?'}, name {t.name!r}, {t.config_fingerprint}",
        "",
        f"  {'':16}{'drafter':44}target",
    ]
    lines += [f"  {label:16}{str(dv):44}{tv}" for label, dv, tv in rows]
    lines += ["", "checks"]
    lines += [f"  {c.status.upper():5}{c.name:20}{c.message}" for c in report.checks]
    lines += [f"note: {n}" for n in report.notes]
    if report.probe:
        p = report.probe
        lines.append(
            f"probe    {p.rows} rows of the job's input, depth {p.num_speculative_tokens}, max_model_len "
            f"{p.max_model_len}: mean acceptance length {_fmt(p.mean_acceptance_length)}, acceptance rate "
            f"{_fmt(p.acceptance_rate, '.3f')}, per position "
            f"{' '.join(f'{r:.2f}' for r in p.accepted_per_position) or '-'}; floor {p.floor}: "
            + ("PASS" if p.passed else "FAIL")
        )
        if not p.passed:
            lines.append(
                "REFUSED by the probe: acceptance this low is what a drafter trained for another base model "
                "gives, even one with the same shapes; speculation would only cost"
            )
            return "\n".join(lines)
    failed = [c.name for c in report.checks if c.status == "fail"]
    warned = f" ({len(report.warnings)} warning(s))" if report.warnings else ""
    if failed:
        lines.append(f"REFUSED: {', '.join(failed)} (an expert may downgrade with --warn-only {' '.join(failed)})")
    elif report.target_identity == "verified":
        lines.append("OK: target identity verified: the drafter declares this target" + warned)
    elif report.target_identity == "mismatch":
        lines.append("WARNING: target identity mismatch (downgraded): the drafter declares another target" + warned)
    else:
        lines.append(
            "SHAPES OK, target identity UNVERIFIED: the drafter declares no target, so a drafter trained for another "
            "base model with the same shapes would pass these checks too; measure its acceptance with "
            "`specbatch check-drafter --config JOB.yaml --probe 64` (jobs run that probe by default)" + warned
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch check-drafter",
        description=textwrap.fill(
            "Refuse an EAGLE-3 / EAGLE-3.1 drafter that does not belong to its target. Exit 0: shapes match and no "
            "declared target disagrees (warnings allowed); 1: refused; 2: usage or unreadable files."
        ),
        epilog="checks (--warn-only NAME downgrades one to a warning):\n"
        + "\n".join(f"  {n}: {h}" for n, h in CHECKS.items())
        + "\n\nexample:\n"
        "  specbatch check-drafter --model models/tinykit/target --drafter models/tinykit/drafter-eagle31\n"
        "  specbatch check-drafter --config job.yaml --probe 64     # then 64 of the job's rows with the drafter",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="a job config: its model, drafter, checks_as_warnings, input and lengths")
    parser.add_argument("--model", help="the target model directory (instead of --config)")
    parser.add_argument("--drafter", help="the drafter directory (EAGLE-3 config or speculators format)")
    parser.add_argument(
        "--warn-only",
        nargs="+",
        action="extend",
        default=[],
        metavar="CHECK",
        help="downgrade these checks to warnings (experts)",
    )
    parser.add_argument("--target-name", help="the target's name, when its config records none")
    parser.add_argument(
        "--probe",
        type=int,
        metavar="N",
        help="also generate N rows of the job's input with the drafter (needs --config) and refuse "
        "it below speculative.probe.min_mean_acceptance_length",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    storage = None  # models in object storage: the default endpoint, or the config's
    if args.config:
        from pipeline.config import load_config
        from pipeline.storage import Storage

        try:
            config = load_config(args.config)
        except ValueError as exc:  # ConfigError: names the field and what to do
            print(f"specbatch check-drafter: {exc}", file=sys.stderr)
            return 2
        storage = Storage.from_config(config.storage)
        if not (args.drafter or config.speculative.drafter):
            parser.error(f"{args.config}: speculative.drafter is not set; set it there, or give --drafter DIR")
        args.model, args.drafter = args.model or config.model.path, args.drafter or config.speculative.drafter
        args.warn_only += config.speculative.checks_as_warnings
    if not (args.model and args.drafter):
        parser.error("give --config JOB.yaml, or --model and --drafter")
    if args.probe is not None and (not args.config or args.probe < 1):
        parser.error("--probe N needs --config (the probe runs the job's own rows at its lengths) and N >= 1")
    try:
        validate_check_names(args.warn_only)
        report = inspect_drafter(args.model, args.drafter, args.warn_only, args.target_name, storage)
        if args.probe and report.ok:
            report.probe = _probe(config, args.probe)  # DrafterRejected below the floor
            if report.probe is None:
                report.notes.append("probe skipped: every row read ends within 2k tokens of engine.max_model_len")
    except DrafterMismatch as exc:
        print(f"specbatch check-drafter: refused: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"specbatch check-drafter: {exc}", file=sys.stderr)
        return 2
    print(report.model_dump_json(indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def _probe(config, rows: int):
    from pipeline.cluster.startup import ray_init
    from pipeline.config import ProbeConfig
    from pipeline.speculation.probe import probe_job_input
    from pipeline.storage import Storage

    probe = config.speculative.probe
    config.speculative.probe = ProbeConfig(rows=rows, min_mean_acceptance_length=probe.min_mean_acceptance_length)
    ray_init()
    return probe_job_input(config, Storage.from_config(config.storage))


if __name__ == "__main__":
    sys.exit(main())
