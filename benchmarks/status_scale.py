"""What `specbatch status` costs at 10M prompts in 100,000 units, on moto's S3 server.

    python benchmarks/status_scale.py [--files 200] [--rows 10000000] [--rows-per-unit 100]

Setup (its own moto process on 127.0.0.1): an output location as a job of `--rows` rows in
`--files` input files leaves it, with no input or output file (status reads none): `_job.json`
(the input files, one attempt), a commit marker per unit (a running job's status lists them),
`stats/attempt-0001.parquet` with one row per unit, every unit with one error row (the worst
case for errors by kind), and the error files of the units status reads at its default
`--error-files` (an even spread of 1,000). The running job's stats file lacks its last
`--recent` units (the driver rewrites it every minute: about a minute of commits), whose
markers status reads; its driver's `_progress.json` names 8 engines.

Measured, each in a fresh process, every S3 request counted where s3fs sends it
(`S3FileSystem._call_s3`) with the bytes of each GET:
  (a) a finished job without error rows;
  (b) a finished job whose every unit has error rows (errors by kind from 1,000 of them);
  (c) the same job running, its driver alive (counts from one listing of `_commits/`, ETA).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")

from resume_planning import BUCKET, parquet_bytes, peak_rss_mb, s3_client, start_moto  # noqa: E402

SCENARIOS = {"clean": "finished, no error rows", "errors": "finished, every unit with error rows", "running": "running"}
REPLICAS, UNITS_IN_FLIGHT = 8, 2


def manifest_doc(args, status: str, error_rows: int, units: int) -> dict:
    from pipeline.job.manifest import versions
    from schemas import LAYOUT_VERSION, Attempt, InputFile, JobManifest, JobTotals, ModelFingerprint

    per_file = -(-args.rows // args.files)
    files = [
        InputFile(
            uri=f"s3://{BUCKET}/input/part-{i:05d}.parquet",
            size=per_file * 40,
            version=f"v{i}",
            rows=min(per_file, args.rows - first),
            text_column="prompt",
        )
        for i, first in enumerate(range(0, args.rows, per_file))
    ]
    started = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)).isoformat(timespec="seconds")
    running = status == "running"
    attempt = Attempt(
        number=1,
        started_at=started,
        ended_at=None if running else started,
        status=status,
        skipped_rows=0,
        units_planned=units,
    )
    model = ModelFingerprint(path="s3://models/target", config_sha256="0" * 64, architectures=["LlamaForCausalLM"])
    return JobManifest(
        layout_version=LAYOUT_VERSION,
        job_id="status-bench",
        status=status,
        started_at=started,
        config={
            "resources": {"rows_per_unit": args.rows_per_unit, "replicas": REPLICAS, "units_in_flight": UNITS_IN_FLIGHT}
        },
        versions=versions(),
        model=model,
        accelerator="cpu",
        input_files=files,
        totals=JobTotals(input_rows=args.rows, output_rows=args.rows - error_rows, error_rows=error_rows, units=units),
        attempts=[attempt],
    ).model_dump(mode="json")


def setup(endpoint: str, args) -> None:
    import pyarrow as pa

    from pipeline.inputs.units import plan_units
    from schemas import ErrorRow, InputFile, UnitStats, arrow_schema

    client = s3_client(endpoint, 32)
    doc = manifest_doc(args, "succeeded", 0, 0)
    units = plan_units([InputFile.model_validate(f) for f in doc["input_files"]], args.rows_per_unit)
    now, tokens = time.time(), [uuid.uuid4().hex[:12] for _ in units]
    columns = {name: [] for name in arrow_schema(UnitStats).names}
    # the units commit one after another over the last two hours, every engine slot always full
    gap = 7000 / len(units)
    engine = REPLICAS * UNITS_IN_FLIGHT * gap
    for i, unit in enumerate(units):
        row = dict(
            unit_id=unit.unit_id,
            source=unit.source,
            first_row=unit.first_row,
            actor_id=f"actor-{i % REPLICAS}",
            node_id="node-0",
            rows=unit.rows,
            output_rows=unit.rows - 1,
            error_rows=1,
            samples=unit.rows - 1,
            retryable_error_rows=0,
            clipped_rows=0,
            first_error=f"empty_prompt: r{unit.first_row}",
            prompt_tokens=12 * unit.rows,
            generated_tokens=16 * unit.rows,
            started_at=now - 7200 + i * gap,
            wall_seconds=engine,
            engine_seconds=engine,
            tokens_per_second=16 * unit.rows / engine,
            speculative=True,
            num_speculative_tokens=3,
            depth_schedule=None,
            num_drafts=8 * unit.rows,
            draft_tokens=24 * unit.rows,
            accepted_tokens=12 * unit.rows,
            acceptance_rate=0.5,
            mean_acceptance_length=2.5,
            accepted_per_position=[6 * unit.rows, 4 * unit.rows, 2 * unit.rows],
            speculation_disabled_by_guard=False,
            commit_token=tokens[i],
        )
        for name, values in columns.items():  # a field this row leaves out is null
            values.append(row.get(name))
    table = pa.table(columns, schema=arrow_schema(UnitStats))
    stats = parquet_bytes(table)
    client.put_object(Bucket=BUCKET, Key="output/stats/attempt-0001.parquet", Body=stats)
    client.put_object(
        Bucket=BUCKET, Key="bench/stats-running.parquet", Body=parquet_bytes(table.slice(0, len(units) - args.recent))
    )
    print(
        f"setup: {len(units):,} units, stats file {len(stats) / 1e6:.1f} MB, _job.json "
        f"{len(json.dumps(doc)) / 1e3:.0f} KB",
        flush=True,
    )
    put_markers(client, units, table.to_pylist(), tokens)

    sample = [len(units) * k // 1000 for k in range(1000)] if len(units) > 1000 else range(len(units))

    def put_errors(k_i: tuple[int, int]) -> None:
        k, i = k_i
        unit = units[i]
        row = ErrorRow(
            id=f"r{unit.first_row}",
            source=unit.source,
            row=unit.first_row,
            stage="validate",
            error_kind=("empty_prompt", "invalid_sampling")[k % 2],
            field="prompt",
            message="the prompt is empty",
            unit_id=unit.unit_id,
        ).model_dump()
        body = parquet_bytes(pa.Table.from_pylist([row], schema=arrow_schema(ErrorRow)))
        client.put_object(Bucket=BUCKET, Key=f"output/errors/{unit.unit_id}.{tokens[i]}.parquet", Body=body)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(put_errors, enumerate(sample)))


def put_markers(client, units, stats: list[dict], tokens: list[str]) -> None:
    """A commit marker per unit, as the engines leave them, 32 at a time."""
    from schemas import CommitMarker

    def put(i: int) -> None:
        unit = units[i]
        files = {
            "outputs": f"outputs/{unit.unit_id}.{tokens[i]}.parquet",
            "errors": f"errors/{unit.unit_id}.{tokens[i]}.parquet",
        }
        marker = CommitMarker(
            unit_id=unit.unit_id,
            token=tokens[i],
            files=files,
            rows={"outputs": unit.rows - 1, "errors": 1},
            stats={k: v for k, v in stats[i].items() if v is not None},
        )
        client.put_object(
            Bucket=BUCKET, Key=f"output/_commits/{unit.unit_id}.json", Body=marker.model_dump_json().encode()
        )

    started = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(put, range(len(units)), chunksize=64))
    print(f"setup: {len(units):,} markers, 32 at a time: {time.perf_counter() - started:.0f} s", flush=True)


def running_location(client, doc: dict) -> None:
    """What a running job's driver leaves besides: its lease, its stats file a minute behind, its `_progress.json`."""
    from pipeline.commit.lease import Lease
    from schemas import JobProgress, ReplicaProgress

    now = time.time()
    lease = Lease(
        owner="bench",
        job_id="status-bench",
        attempt=1,
        acquired_at=doc["started_at"],
        heartbeat_at=now,
        stale_after_seconds=180,
    )
    client.put_object(Bucket=BUCKET, Key="output/_lease.json", Body=lease.model_dump_json().encode())
    client.copy_object(
        Bucket=BUCKET,
        Key="output/stats/attempt-0001.parquet",
        CopySource={"Bucket": BUCKET, "Key": "bench/stats-running.parquet"},
    )
    replicas = [
        ReplicaProgress(
            actor_id=f"actor-{r}", node_id="node-0", requests_in_flight=200, last_output_at=now - 1, reported_at=now - 2
        )
        for r in range(REPLICAS)
    ]
    progress = JobProgress(
        attempt=1, written_at=now - 3, generating_since=now - 7200, last_commit_at=now - 1, replicas=replicas
    )
    client.put_object(Bucket=BUCKET, Key="output/_progress.json", Body=progress.model_dump_json().encode())


def measure(endpoint: str, scenario: str, args) -> None:
    """In a fresh process: one `job_status` of the location as the scenario leaves it."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    from pipeline.storage import Storage
    from pipeline.tools.status import job_status

    units = -(-args.rows // args.rows_per_unit)
    client = s3_client(endpoint, 4)
    status = "running" if scenario == "running" else "succeeded"
    doc = manifest_doc(args, status, units if scenario != "clean" else 0, units)
    client.put_object(Bucket=BUCKET, Key="output/_job.json", Body=json.dumps(doc).encode())
    if scenario == "running":
        running_location(client, doc)
    else:
        client.delete_object(Bucket=BUCKET, Key="output/_lease.json")

    calls, original = [], s3fs.S3FileSystem._call_s3

    async def counting(self, method, *a, **kw):
        response = {}
        try:
            response = await original(self, method, *a, **kw)
            return response
        finally:  # a 404 counts too
            calls.append((method, response.get("ContentLength", 0) if method == "get_object" else 0))

    # the listings go through the sync `call_s3`, which s3fs binds to the original at import
    s3fs.S3FileSystem._call_s3, s3fs.S3FileSystem.call_s3 = counting, sync_wrapper(counting)
    rss_before = peak_rss_mb()
    start = time.perf_counter()
    report = job_status(Storage(endpoint_url=endpoint), f"s3://{BUCKET}/output")
    wall = time.perf_counter() - start
    requests = Counter(method for method, _ in calls)
    if scenario == "running":  # a LIST page's bytes (s3fs does not see them): one page of _commits/ again
        page = client.list_objects_v2(Bucket=BUCKET, Prefix="output/_commits/", MaxKeys=1000)
        print(
            f"a LIST page of _commits/: {len(page.get('Contents', []))} keys, "
            f"{int(page['ResponseMetadata']['HTTPHeaders'].get('content-length', 0)) / 1e3:.0f} KB",
            flush=True,
        )
    got = sum(size for _, size in calls)
    print(
        f"{SCENARIOS[scenario]}: {wall:.2f} s, {', '.join(f'{n} {m}' for m, n in sorted(requests.items()))}, "
        f"{got / 1e6:.1f} MB read, peak RSS {peak_rss_mb():.0f} MB ({rss_before:.0f} MB after imports); "
        f"{report.rows_done:,} of {report.input_rows:,} rows, {report.units_committed:,} units, "
        f"errors {report.errors_by_kind} from {report.error_units_read:,} of {report.error_units:,} units"
        + (
            f", {report.markers_read:,} markers read, last commit {report.last_commit_age_seconds:.0f} s ago"
            if report.status == "running"
            else ""
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rows-per-unit", type=int, default=100)
    parser.add_argument(
        "--recent", type=int, default=170, help="units committed since the running job's stats file (a minute's)"
    )
    parser.add_argument("--measure", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        import pipeline.tools.status  # noqa: F401  (imports before the clock and the RSS baseline)

        measure(args.endpoint, args.measure, args)
        return
    server, endpoint = start_moto()
    try:
        setup(endpoint, args)
        for scenario in SCENARIOS:
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--measure",
                    scenario,
                    "--endpoint",
                    endpoint,
                    "--files",
                    str(args.files),
                    "--rows",
                    str(args.rows),
                    "--rows-per-unit",
                    str(args.rows_per_unit),
                    "--recent",
                    str(args.recent),
                ],
                check=True,
            )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
