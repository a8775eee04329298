"""What a resume costs before any engine starts, at 100,000 committed work units.

    python benchmarks/resume_planning.py [--files 200] [--rows 10000000] [--rows-per-unit 100]
    python benchmarks/resume_planning.py --rows 100000 --rows-per-unit 10     # a quick smoke run

Setup, on moto's S3 server (its own process on 127.0.0.1, started here): an input of
`--files` Parquet files with `--rows` short rows in all, and an output location where every
unit of that input is committed, as a finished job leaves it: one marker
`_commits/<unit_id>.json` per unit (written directly, many at a time), a stats file
`stats/attempt-0001.parquet` with one row per unit and a `_job.json` of a succeeded attempt.
Output files are written for the first `--output-files` units only: planning must never open
one, so the others need not exist.

Measured, each in a fresh process (its peak RSS is that driver's alone), with every S3
request counted where s3fs sends it (`S3FileSystem._call_s3`):
  (a) planning as a resume does it: `_job.json`, the input's listing with the footers taken
      from it (footer cache), the units, one listing of `_commits/`, the units left to do;
  (b) the same without the footer cache: every footer read, 16 at a time;
  (c) a whole no-op rerun, `run_job` on the finished location (no Ray, no engine).
Targets (the issue): <= 60 s, <= 300 MB peak RSS, 0 output files read.
Peak RSS includes the driver's imports (`pipeline.job.runner`, imported before the clock starts;
its RSS then is printed too). moto answers from this machine's cores, and scans every key of
a prefix for each listing page: pages are slower than a real object store's. So the driver's
own CPU time is printed next to the wall time, and the time spent waiting per operation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BUCKET = "bench"
INPUT = f"s3://{BUCKET}/input"
OUTPUT = f"s3://{BUCKET}/output"
SCENARIOS = {
    "cached": "planning (footer cache)",
    "uncached": "planning (no footer cache)",
    "rerun": "no-op rerun (run_job)",
}
TARGET_SECONDS, TARGET_RSS_MB = 60, 300
READS = ("get_object", "head_object")


def peak_rss_mb() -> float:
    """This process's peak RSS. Not ru_maxrss: Linux keeps that across exec, so a child would
    start from the peak of the parent it was forked from; VmHWM is the new image's own."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


def cpu_seconds() -> float:
    """User + system CPU of this process, all threads (s3fs's event loop has its own)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- configuration, shared by setup and children


def job_config(endpoint: str, rows_per_unit: int):
    """The job whose finished output location is planned: the tiny kit, as the tests run it."""
    from pipeline.config import parse_config
    from tinykit import kit_paths

    kit = kit_paths()
    return parse_config(
        {
            "job_name": "resume-planning",
            "input_uri": INPUT,
            "output_uri": OUTPUT,
            "model": {"path": kit["target"]},
            "speculative": {"enabled": True, "drafter": kit["drafter_eagle31"], "num_speculative_tokens": 3},
            "engine": {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 32, "enforce_eager": True},
            "sampling": {"max_tokens": 16, "temperature": 0.0},
            "resources": {"replicas": 1, "rows_per_unit": rows_per_unit},
            "storage": {"endpoint_url": endpoint},
        }
    )


# ---------------------------------------------------------------- setup (parent process)


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process, as an object store would be, with the bucket."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
            return server, endpoint
        except Exception:
            time.sleep(0.2)
    server.terminate()
    raise RuntimeError(f"moto did not start on {endpoint}")


def s3_client(endpoint: str, threads: int):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=threads))


def parquet_bytes(table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def input_file(first: int, rows: int, width: int, row_group: int) -> bytes:
    """Rows `first`.. of the input: ids r0000001.., short prompts, built column-wise."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    numbers = pc.utf8_lpad(pc.cast(pa.array(np.arange(first, first + rows)), pa.string()), width=width, padding="0")
    table = pa.table(
        {
            "id": pc.binary_join_element_wise("r", numbers, ""),
            "prompt": pc.binary_join_element_wise("Write one line about item ", numbers, "."),
        }
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group, compression="zstd")
    return sink.getvalue().to_pybytes()


def write_input(client, args) -> None:
    width = max(7, len(str(args.rows - 1)))
    per_file = -(-args.rows // args.files)
    starts = range(0, args.rows, per_file)

    def put(i_first):
        i, first = i_first
        body = input_file(first, min(per_file, args.rows - first), width, args.row_group)
        client.put_object(Bucket=BUCKET, Key=f"input/part-{i:05d}.parquet", Body=body)

    with ThreadPoolExecutor(4) as pool:  # generation is CPU-bound: a few at a time
        list(pool.map(put, enumerate(starts)))


def unit_stats(unit, token: str) -> dict:
    """A plausible stats row of a committed unit (speculation on, 16 tokens per row)."""
    from schemas import UnitStats

    rows = unit.rows
    return UnitStats(
        unit_id=unit.unit_id,
        source=unit.source,
        first_row=unit.first_row,
        actor_id="actor-0",
        node_id="node-0",
        rows=rows,
        output_rows=rows,
        error_rows=0,
        prompt_tokens=12 * rows,
        generated_tokens=16 * rows,
        started_at=time.time(),
        wall_seconds=2.0,
        engine_seconds=1.5,
        tokens_per_second=16 * rows / 1.5,
        speculative=True,
        num_speculative_tokens=3,
        num_drafts=8 * rows,
        draft_tokens=24 * rows,
        accepted_tokens=12 * rows,
        acceptance_rate=0.5,
        mean_acceptance_length=2.5,
        accepted_per_position=[6 * rows, 4 * rows, 2 * rows],
        commit_token=token,
    ).model_dump(mode="json")


def commit_all(client, units, args) -> list[dict]:
    """Every unit's marker (a valid CommitMarker), written many at a time; output files for the
    first `--output-files` units only. Returns the units' stats rows."""
    import pyarrow as pa

    from schemas import CommitMarker, OutputRow, arrow_schema

    def commit(i_unit) -> dict:
        i, unit = i_unit
        token = uuid.uuid4().hex[:12]
        stats = unit_stats(unit, token)
        name = f"outputs/{unit.unit_id}.{token}.parquet"
        if i < args.output_files:
            rows = [
                OutputRow(
                    id=f"u{i}-{r}",
                    text="x",
                    finish_reason="length",
                    prompt_tokens=12,
                    generated_tokens=16,
                    draft_tokens=24,
                    accepted_tokens=12,
                    num_drafts=8,
                    mean_acceptance_length=2.5,
                    model="target",
                    source=unit.source,
                    row=unit.first_row + r,
                    unit_id=unit.unit_id,
                ).model_dump()
                for r in range(unit.rows)
            ]
            body = parquet_bytes(pa.Table.from_pylist(rows, schema=arrow_schema(OutputRow)))
            client.put_object(Bucket=BUCKET, Key=f"output/{name}", Body=body)
        marker = CommitMarker(
            unit_id=unit.unit_id, token=token, files={"outputs": name}, rows={"outputs": unit.rows}, stats=stats
        )
        body = json.dumps(marker.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        client.put_object(Bucket=BUCKET, Key=f"output/_commits/{unit.unit_id}.json", Body=body.encode())
        return stats

    with ThreadPoolExecutor(args.threads) as pool:
        return list(pool.map(commit, enumerate(units), chunksize=64))


def write_finished_job(client, config, inputs, stats: list[dict], units: int) -> None:
    """stats/attempt-0001.parquet and the `_job.json` of one succeeded attempt, as run_job
    writes them at the end of a job that committed every unit."""
    import pyarrow as pa

    from pipeline.job import plan as job_plan
    from pipeline.job.manifest import versions
    from pipeline.stages.stats import totals_from_stats
    from schemas import LAYOUT_VERSION, Attempt, JobManifest, UnitStats, arrow_schema

    table = pa.Table.from_pylist(stats, schema=arrow_schema(UnitStats))
    client.put_object(Bucket=BUCKET, Key="output/stats/attempt-0001.parquet", Body=parquet_bytes(table))
    target = job_plan.model_fingerprint(config.model.path)
    drafter = job_plan.model_fingerprint(config.speculative.drafter)
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    attempt = Attempt(
        number=1,
        started_at=now,
        ended_at=now,
        status="succeeded",
        skipped_rows=0,
        units_planned=units,
        units_skipped=0,
        footers_read=len(inputs.files),
        processed_rows=inputs.rows,
        wall_seconds=3600.0,
    )
    manifest = JobManifest(
        layout_version=LAYOUT_VERSION,
        job_id="resume-planning-bench",
        status="succeeded",
        started_at=now,
        ended_at=now,
        config=config.redacted(),
        results_fingerprint=job_plan.results_fingerprint(config, target, drafter),
        versions=versions(),
        model=target,
        drafter=drafter,
        accelerator=config.resources.accelerator,
        input_files=inputs.files,
        totals=totals_from_stats(table, inputs.rows, 3600.0),
        attempts=[attempt],
    )
    body = json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    client.put_object(Bucket=BUCKET, Key="output/_job.json", Body=body.encode())


def setup(endpoint: str, args) -> None:
    from pipeline.inputs.units import plan_units
    from pipeline.inputs import inspect_inputs
    from pipeline.storage import Storage

    client = s3_client(endpoint, args.threads)
    config = job_config(endpoint, args.rows_per_unit)
    started = time.time()
    write_input(client, args)
    inputs = inspect_inputs(INPUT, Storage(endpoint_url=endpoint))
    units = plan_units(inputs.files, args.rows_per_unit)
    print(
        f"setup: input of {len(inputs.files)} files, {inputs.rows:,} rows: {time.time() - started:.1f} s; "
        f"{len(units):,} units of <= {args.rows_per_unit} rows",
        flush=True,
    )
    started = time.time()
    stats = commit_all(client, units, args)
    print(
        f"setup: {len(units):,} markers ({min(args.output_files, len(units))} with output files), "
        f"{args.threads} threads: {time.time() - started:.1f} s",
        flush=True,
    )
    write_finished_job(client, config, inputs, stats, len(units))


# ---------------------------------------------------------------- measurement (child process)


def count_requests() -> list[tuple[str, str, float]]:
    """Patch s3fs so every S3 call it makes is recorded as (method, key or prefix, seconds)."""
    import s3fs.core
    from fsspec.asyn import sync_wrapper

    calls, original = [], s3fs.core.S3FileSystem._call_s3

    async def counted(self, method, *akwarglist, **kwargs):
        started = time.perf_counter()
        try:
            return await original(self, method, *akwarglist, **kwargs)
        finally:
            calls.append((method, kwargs.get("Key") or kwargs.get("Prefix", ""), time.perf_counter() - started))

    s3fs.core.S3FileSystem._call_s3 = counted
    s3fs.core.S3FileSystem.call_s3 = sync_wrapper(counted)  # the sync twin was bound to the original
    return calls


def area(key: str) -> str:
    """Where a key or prefix is: input/, or the output location's folder or file."""
    if not key:
        return "(no key)"
    if not key.startswith("output/"):
        return key.split("/", 1)[0] + "/"
    rest = key[len("output/") :]
    return rest.split("/", 1)[0] + "/" if "/" in rest else rest or "output/"


def plan(endpoint: str, rows_per_unit: int, footer_cache: bool) -> dict:
    """What run_job does before its lease: returns the steps' seconds and what was planned."""
    from pipeline.commit.outputs import OutputLocation
    from pipeline.inputs.units import plan_units
    from pipeline.inputs import inspect_inputs
    from pipeline.storage import Storage
    from schemas import JobManifest

    storage = Storage(endpoint_url=endpoint)
    location = OutputLocation(storage, OUTPUT)
    steps, t = {}, time.perf_counter()
    known = JobManifest.model_validate(location.read_manifest()).input_files if footer_cache else None
    steps["_job.json"], t = time.perf_counter() - t, time.perf_counter()
    inputs = inspect_inputs(INPUT, storage, known=known)
    steps["inputs"], t = time.perf_counter() - t, time.perf_counter()
    units = plan_units(inputs.files, rows_per_unit)
    steps["units"], t = time.perf_counter() - t, time.perf_counter()
    committed = location.committed_units()
    steps["_commits/"], t = time.perf_counter() - t, time.perf_counter()
    todo = [u for u in units if u.unit_id not in committed]
    steps["filter"] = time.perf_counter() - t
    return {"steps": steps, "units": len(units), "todo": len(todo), "footers_read": inputs.footers_read}


def rerun(endpoint: str, rows_per_unit: int) -> dict:
    from pipeline.job.runner import run_job

    manifest = run_job(job_config(endpoint, rows_per_unit), progress=False)
    attempt = manifest.attempts[-1]
    return {
        "units": attempt.units_planned,
        "todo": attempt.units_planned - attempt.units_skipped,
        "footers_read": attempt.footers_read,
        "status": manifest.status,
    }


def child(scenario: str, endpoint: str, rows_per_unit: int) -> None:
    """One measurement; prints its figures as one JSON line."""
    import pipeline.job.runner  # noqa: F401  (imports every module the scenarios use, before the clock starts)

    calls = count_requests()
    rss_before, cpu, started = peak_rss_mb(), cpu_seconds(), time.perf_counter()
    if scenario == "rerun":
        result = rerun(endpoint, rows_per_unit)
    else:
        result = plan(endpoint, rows_per_unit, footer_cache=scenario == "cached")
    result.update(
        wall=time.perf_counter() - started, cpu=cpu_seconds() - cpu, rss_before=rss_before, rss_peak=peak_rss_mb()
    )
    by_method: dict[str, list] = {}
    for method, key, seconds in calls:
        count = by_method.setdefault(method, [0, 0.0, {}])
        count[0] += 1
        count[1] += seconds
        count[2][area(key)] = count[2].get(area(key), 0) + 1
    reads = [key for method, key, _ in calls if method in READS]
    result.update(
        requests=by_method,
        output_reads=sum(key.startswith(("output/outputs/", "output/errors/")) for key in reads),
        input_reads=sum(key.startswith("input/") for key in reads),
    )
    print(json.dumps(result))


def measure(scenario: str, endpoint: str, rows_per_unit: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", scenario, "--endpoint", endpoint, "--rows-per-unit", str(rows_per_unit)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def print_result(scenario: str, r: dict) -> None:
    requests = r["requests"]

    def count(method: str) -> int:
        return requests.get(method, [0])[0]

    print(
        f"\n{SCENARIOS[scenario]}: {r['wall']:.1f} s wall ({r['cpu']:.1f} s driver CPU), {count('list_objects_v2')} "
        f"LIST, {count('get_object')} GET, {count('head_object')} HEAD, {count('put_object')} PUT, peak RSS "
        f"{r['rss_peak']:.0f} MB ({r['rss_before']:.0f} MB after imports), {r['output_reads']} output files read, "
        f"{r['input_reads']} input reads"
    )
    print(
        f"  units {r['units']:,}, left to do {r['todo']:,}, footers read {r['footers_read']}"
        + (f", job {r['status']}" if "status" in r else "")
    )
    if "steps" in r:
        print("  steps: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in r["steps"].items()))
    print(f"  {'request':20}{'count':>6}{'seconds in them':>17}   where")
    for method, (n, seconds, areas) in sorted(requests.items()):
        where = ", ".join(f"{name} {k}" for name, k in sorted(areas.items()))
        print(f"  {method:20}{n:6d}{seconds:17.2f}   {where}")
    print(
        f"  targets: wall {r['wall']:.1f} <= {TARGET_SECONDS} s {verdict(r['wall'] <= TARGET_SECONDS)}; "
        f"RSS {r['rss_peak']:.0f} <= {TARGET_RSS_MB} MB {verdict(r['rss_peak'] <= TARGET_RSS_MB)}; "
        f"output files read {r['output_reads']} == 0 {verdict(r['output_reads'] == 0)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=200, help="input Parquet files")
    parser.add_argument("--rows", type=int, default=10_000_000, help="input rows in all")
    parser.add_argument("--rows-per-unit", type=int, default=100, help="100 gives 100,000 units of 10M rows")
    parser.add_argument("--row-group", type=int, default=50_000, help="rows per Parquet row group")
    parser.add_argument("--output-files", type=int, default=100, help="units whose output file is written too")
    parser.add_argument("--threads", type=int, default=32, help="marker writes at a time")
    parser.add_argument("--keep", action="store_true", help="leave the moto server running (prints its endpoint)")
    parser.add_argument("--child", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.endpoint, args.rows_per_unit)

    server, endpoint = start_moto()
    try:
        setup(endpoint, args)
        for scenario in SCENARIOS:
            print_result(scenario, measure(scenario, endpoint, args.rows_per_unit))
    finally:
        if args.keep:
            print(f"\nmoto keeps running at {endpoint} (pid {server.pid}; bucket {BUCKET})")
        else:
            server.terminate()


if __name__ == "__main__":
    main()
