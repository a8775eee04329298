"""specbatch command line: demo, run, status, report, calibrate, pilot, check-drafter, check-cluster, export, \
tiny-models."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import textwrap

from schemas import EXIT_CODES

# Commands whose modules own their argument parsing (`specbatch NAME --help`).
DELEGATED = {
    "report": ("pipeline.tools.report", "cost per million tokens from jobs' _job.json and stats/"),
    "calibrate": ("pipeline.tools.calibrate", "measure speculation depths on the job's own prompts"),
    "pilot": (
        "pipeline.tools.pilot",
        "before a large job: calibrate, specbatch beside vLLM alone, one page of what to run",
    ),
    "check-drafter": ("pipeline.tools.check_drafter", "refuse a drafter that does not belong to its target"),
    "export": ("pipeline.tools.export", "write a job's outputs as OpenAI batch output files (--format openai_batch)"),
    "status": ("pipeline.tools.status", "where a job stands: state, lease, rows and units done, errors by kind, ETA"),
    "check-cluster": (
        "pipeline.tools.check_cluster",
        "does a Ray head take jobs: submit one that does nothing, say why not",
    ),
}


# Every command's --help ends with an example (tests/test_cli_help.py checks each one).
EXAMPLES = {
    "specbatch": (
        "specbatch demo                         # a whole job on this machine: tiny models, CPU vLLM",
        "specbatch run runs/demo/job.yaml       # a job from its config (the demo wrote this one)",
        "specbatch report runs/demo/output      # what it cost",
        "specbatch COMMAND --help               # each command's options, and an example",
    ),
    "demo": ("specbatch demo --workdir runs/demo --rows 64",),
    "run": (
        "specbatch run job.yaml --dry-run      # the checks, the plan, tokens and cost; no engine starts",
        "specbatch run jobs/configs/gpu-cluster.yaml --output-uri s3://bucket/outputs/2026-11-29/",
        "specbatch run job.yaml --take-over    # a run you know is dead still holds the output's lease",
        "specbatch run job.yaml --restart      # settings changed: wipe the output location and start over",
    ),
    "tiny-models": (
        "specbatch tiny-models build /tmp/tinykit --threads 2    # trains the kit anew: minutes on 2 cores",
    ),
}


def example(lines: tuple[str, ...]) -> str:
    """An argparse epilog (RawDescriptionHelpFormatter) with the example last."""
    return "example:\n" + "\n".join(f"  {line}" for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        import importlib

        return importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from pipeline.tools.demo import run_demo

        return run_demo(args.workdir, rows=args.rows)
    if args.command == "run":
        if args.json and not args.dry_run:
            parser.error("--json goes with --dry-run")
        return run_from_config(
            args.config,
            args.output_uri,
            dry_run=args.dry_run,
            as_json=args.json,
            job_id=args.job_id,
            restart=args.restart,
            take_over=args.take_over,
            retry_errors=args.retry_errors,
            verbose=args.verbose,
            address=args.address,
        )
    if args.command == "tiny-models":
        from tinykit.build import main as build_main

        return build_main(args.rest)
    return 2


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="specbatch", description=__doc__, epilog=example(EXAMPLES["specbatch"]), formatter_class=raw
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="run the job on the embedded default (local Ray, tiny models, CPU vLLM)",
        description=textwrap.fill(
            "Run a whole job on the embedded default: sample prompts, the tiny model kit, local Ray and vLLM's CPU "
            "build, through the code path a GPU cluster runs."
        ),
        epilog=example(EXAMPLES["demo"]),
        formatter_class=raw,
    )
    demo.add_argument("--workdir", default="runs/demo", help="where prompts, config and outputs go")
    demo.add_argument("--rows", type=int, default=256)

    add_run_arguments(
        sub.add_parser(
            "run",
            help="run a job from a YAML config (local path or URI)",
            description=textwrap.fill(
                "Run, or resume, the job a YAML config describes (jobs/configs/ has examples). Exit 0 succeeded, 3 "
                "completed with errors, 1 failed, 2 refused before it started (a refusal says what to change), 130 "
                "interrupted (Ctrl-C; rerun to resume)."
            ),
            epilog=example(EXAMPLES["run"]),
            formatter_class=raw,
        )
    )

    tiny = sub.add_parser(
        "tiny-models",
        help="the project's tiny model kit",
        description=textwrap.fill(
            "Build the project's tiny model kit (a target and its EAGLE-3 drafters, trained on this CPU); "
            "`specbatch tiny-models build --help` lists the build's options."
        ),
        epilog=example(EXAMPLES["tiny-models"]),
        formatter_class=raw,
    )
    tiny.add_argument("action", choices=["build"])
    tiny.add_argument("rest", nargs=argparse.REMAINDER, help="OUT [--seed N] [--threads N] [--smoke]")

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text)
    return parser


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("config")
    run.add_argument("--output-uri", help="override output_uri (e.g. a dated prefix)")
    run.add_argument("--job-id")
    run.add_argument("--restart", action="store_true", help="wipe the output location and start over")
    run.add_argument(
        "--take-over",
        action="store_true",
        help=(
            "take the output location over at once from a run you know is dead (a dead run's lease is taken over "
            "without it once the lease tells)"
        ),
    )
    run.add_argument(
        "--retry-errors", action="store_true", help="run again every unit with error rows, final ones included"
    )
    run.add_argument("--verbose", action="store_true", help="show Ray's and vLLM's logs live")
    run.add_argument("--address", help="the Ray cluster to join (default: RAY_ADDRESS, else a Ray of the job's own)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check and plan, start nothing, write nothing: exit 0 accepted, 2 refused",
    )
    run.add_argument(
        "--json", action="store_true", help="with --dry-run: the plan as one JSON object (schemas/plan.py)"
    )


EXIT = EXIT_CODES  # exit codes by job status (schemas.EXIT_CODES)


def run_from_config(
    config_uri: str, output_uri: str | None = None, dry_run: bool = False, as_json: bool = False, **options
) -> int:
    """Exit 0 succeeded, 3 completed_with_errors (over retries.max_error_fraction), 1 failed
    (the job stopped; `_job.json` says why), 2 refused before it started, 4 fenced (another run
    took the output location over while this one ran), 130 interrupted. `options`: the run's
    flags (pipeline/job/plan.RunOptions). `dry_run`: the checks and the plan only
    (pipeline/tools/plan.py), 0 when the run would be accepted."""
    from pipeline.api import ending_status, run
    from pipeline.cluster.startup import StartClock
    from pipeline.job.manifest import plain_text
    from pipeline.job.plan import RunOptions

    flags = RunOptions(**options)
    previous_handler = signal.signal(signal.SIGINT, _interrupt_then_exit_at_the_next)
    try:
        if dry_run:
            from pipeline.tools.plan import dry_run as plan

            try:
                return plan(config_uri, output_uri, flags, as_json)
            except Exception as exc:  # the real run's refusal, said as the real run says it
                if ending_status(exc) is None:
                    raise
                print(f"specbatch: {SAID[ending_status(exc)]}: {plain_text(str(exc))}", file=sys.stderr)
                return EXIT[ending_status(exc)]
        result = run(
            config_uri,
            output_uri,
            clock=StartClock(from_process_start=True),
            command=_command(config_uri, output_uri, flags),
            **dataclasses.asdict(flags),
        )
    except KeyboardInterrupt:
        result = None
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    if result is None or result.status == "interrupted":
        print(
            f"specbatch: {_interrupted(result.manifest if result else None)}; rerun the same command to resume",
            file=sys.stderr,
        )
        return EXIT["interrupted"]
    if result.manifest is None:  # ended by an error specbatch names: one line, no traceback
        print(f"specbatch: {SAID.get(result.status, 'job failed')}: {result.error}", file=sys.stderr)
        return result.exit_code
    _print_summary(result.manifest, result.manifest.config["output_uri"])
    return result.exit_code


def _command(config_uri: str, output_uri: str | None, flags) -> str:
    """The `specbatch run` command line a run had (its data set card names it)."""
    words = ["specbatch", "run", config_uri] + (["--output-uri", output_uri] if output_uri else [])
    words += [
        f"--{name.replace('_', '-')}" for name in ("restart", "take_over", "retry_errors") if getattr(flags, name)
    ]
    return " ".join(words + (["--address", flags.address] if flags.address else []))


SAID = {"refused": "refused", "fenced": "fenced", "failed": "job failed"}  # a run's last line, by how it ended


def _print_summary(manifest, output_uri: str) -> None:
    from pipeline.job.console import summary

    print("\n".join(f"specbatch: {line}" if i == 0 else line for i, line in enumerate(summary(manifest))))
    print(f"  manifest  {output_uri.rstrip('/')}/_job.json (every figure, as JSON)")
    for flag in manifest.speculation.flags if manifest.speculation else []:
        print(f"specbatch: warning: speculation: {flag}", file=sys.stderr)


def _interrupt_then_exit_at_the_next(signum, frame) -> None:
    """Ctrl-C: the job stops its engines and closes its attempt as `interrupted`; a second
    Ctrl-C does not wait for that."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT["interrupted"]))
    _drop_rays_error_channel()
    raise KeyboardInterrupt


def _drop_rays_error_channel() -> None:
    """After a Ctrl-C, what Ray's error channel says is the teardown the user asked for: Ray
    Data kills its actors, and each task queued on one "submit failed ... killed by ray.kill".
    Ray's driver prints that channel from a thread of its own, at any moment, after the one line
    the interrupt prints; from now on the driver drops it."""
    worker = sys.modules.get("ray._private.worker")
    if worker is None:
        return
    show = worker.print_to_stdstream
    worker.print_to_stdstream = lambda data, ignore_prefix: (
        None if data.get("pid") == "raylet" else show(data, ignore_prefix)
    )


def _interrupted(manifest) -> str:
    """How far the interrupted attempt got, from the manifest it wrote."""
    if manifest is None:
        return "interrupted before the job started"
    return f"interrupted after {manifest.totals.units:,} of {manifest.attempts[-1].units_planned:,} units"


if __name__ == "__main__":
    sys.exit(main())
