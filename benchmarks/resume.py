"""Resume costs, measured with the real CLI in fresh processes (each with its own local Ray):

    python benchmarks/resume.py [--prompts 512] [--max-tokens 32]

1. a full run into an empty output location (wall time T);
2. a rerun of that finished job: wall time as a fraction of T (target <= 5%);
3. a run killed (driver and its Ray, SIGKILL) once half of the units are committed, then
   resumed with --take-over once its lease is stale (the wait is not counted): the resume's
   wall time as a fraction of T (target <= 60%).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPECBATCH = str(Path(sys.executable).with_name("specbatch"))
LEASE_STALE_SECONDS = 4

from pipeline.commit.outputs import OutputLocation  # noqa: E402
from pipeline.storage import Storage  # noqa: E402


def run(config: Path, *flags: str) -> tuple[float, float]:
    """Wall time of one `specbatch run`, and the time from its start until its first unit
    entered the engine (the fixed start cost: Ray, checks, engine start)."""
    started = time.time()
    subprocess.run([SPECBATCH, "run", str(config), *flags], check=True, capture_output=True)
    wall = time.time() - started
    location = OutputLocation(Storage(), yaml.safe_load(config.read_text())["output_uri"])
    firsts = [t for t in location.read_table("stats", ["started_at"]).column("started_at").to_pylist() if t >= started]
    return wall, (min(firsts) - started if firsts else float("nan"))


def kill_at(config: Path, location, units: int) -> None:
    proc = subprocess.Popen(
        [SPECBATCH, "run", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    while len(location.committed_units()) < units:
        if proc.poll() is not None:
            raise RuntimeError("the job ended before it could be killed")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def exactly_once(location: OutputLocation, n_inputs: int) -> str:
    ids = location.read_table("outputs", ["id"]).column("id").to_pylist()
    errors = location.read_table("errors", ["id"])
    ids += errors.column("id").to_pylist() if errors.num_rows else []
    stats = location.read_table("stats", ["output_rows", "error_rows"])
    stats_rows = sum(stats.column("output_rows").to_pylist()) + sum(stats.column("error_rows").to_pylist())
    ok = len(ids) == len(set(ids)) == n_inputs == stats_rows
    return (
        f"{len(set(ids))} distinct ids in {len(ids)} rows for {n_inputs} inputs, stats count {stats_rows}: "
        f"{'exactly once' if ok else 'NOT exactly once'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from pipeline.tools.demo import demo_models, write_sample_shards

    workdir = Path(tempfile.mkdtemp(prefix="specbatch-resume-"))
    models, _ = demo_models(workdir)
    write_sample_shards(workdir / "prompts", args.prompts)
    config = yaml.safe_load((ROOT / "jobs" / "configs" / "local.yaml").read_text())
    config.update(input_uri=str(workdir / "prompts"))
    config["model"]["path"], config["speculative"]["drafter"] = models["target"], models["drafter"]
    config["sampling"]["max_tokens"] = args.max_tokens
    config["lease"] = {"heartbeat_seconds": 1, "stale_after_seconds": LEASE_STALE_SECONDS}
    rows_per_unit = config["resources"]["rows_per_unit"]
    shards = len(list((workdir / "prompts").glob("*.parquet")))
    n_units = shards * -(-(args.prompts // shards) // rows_per_unit)

    paths = {}
    for name in ("full", "killed"):
        paths[name] = workdir / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump({**config, "output_uri": str(workdir / name)}))

    full, start_cost = run(paths["full"])
    rerun, _ = run(paths["full"])
    killed_location = OutputLocation(Storage(), str(workdir / "killed"))
    kill_at(paths["killed"], killed_location, n_units // 2)
    time.sleep(LEASE_STALE_SECONDS + 1)  # the killed run's lease goes stale
    resume, resume_start_cost = run(paths["killed"], "--take-over")
    # Engine actors outlive the killed driver for a few seconds and may commit one more unit:
    # what the resume skipped is what counts.
    skipped = killed_location.read_manifest()["attempts"][-1]["skipped_rows"]

    print(f"{args.prompts} prompts x {args.max_tokens} tokens, about {n_units} units of {rows_per_unit} rows")
    print(
        f"full run                     {full:7.1f} s   of which start cost {start_cost:5.1f} s (process start to first "
        "unit in the engine)"
    )
    print(f"rerun of the finished job    {rerun:7.1f} s   {rerun / full:6.1%} of the full run (target <= 5%)")
    print(
        f"resume after {skipped}/{args.prompts} rows done {resume:7.1f} s   {resume / full:6.1%} of the full run "
        f"(target <= 60%); start cost {resume_start_cost:5.1f} s"
    )
    print(f"killed + resumed output      {exactly_once(killed_location, args.prompts)}")


if __name__ == "__main__":
    main()
