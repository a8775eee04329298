"""What the job's input check reads from an object store, and how long it takes:

    python benchmarks/input_check.py [--files 200] [--mb 20] [--repeats 3]
    python benchmarks/input_check.py --files 10 --mb 2        # smoke run

Writes that many Parquet files of about that size (columns `id` and `prompt`, random hex
text, a few row groups each) to moto's S3 server, run in its own process on 127.0.0.1, then
runs, side by side and alternating, `--repeats` times each:

  (a) `inspect_inputs` as shipped, but with `PARALLEL_FOOTERS` = 1: one footer at a time;
  (b) `inspect_inputs` as shipped: `PARALLEL_FOOTERS` footers at a time;
  (c) `inspect_inputs` with `known=` the files (b) found: a rerun, which reads no footer;
  (d) for reference, the check of commit 02186e4 (every file opened with s3fs's default
      readahead, the whole `id` column streamed, one file after the other), extracted with
      `git show` at run time; repeated only while a run takes under SLOW_SECONDS.

Bytes and requests are counted by wrapping `S3FileSystem._call_s3`, which every s3fs request
goes through: bytes read are the `ContentLength` of each GetObject response (the size of the
range served). The table shows the median run of each variant; the target is bytes read
<= 1% of the input's bytes. moto runs on this machine's cores: a real object store's round
trips are longer, which is where reading footers in parallel pays most.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import s3fs.core

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import inputs  # noqa: E402
from pipeline.storage import Storage  # noqa: E402

BUCKET = "bench"
INPUT_URI = f"s3://{BUCKET}/in/"
OLD_COMMIT = "02186e4"
TARGET = 0.01  # bytes read / input bytes
ROW_GROUPS = 4
PROMPT_BYTES = 512  # random bytes per prompt, written as 1,024 hex characters
SLOW_SECONDS = 10.0


# ---------------------------------------------------------------- counting requests


@dataclass
class S3Traffic:
    """Requests by S3 method and bytes served by GetObject, since the last reset."""

    requests: Counter = field(default_factory=Counter)
    bytes_read: int = 0

    def install(self) -> None:
        original = s3fs.core.S3FileSystem._call_s3

        async def counted(fs, method, *args, **kwargs):
            response = await original(fs, method, *args, **kwargs)
            self.requests[method] += 1
            if method == "get_object":
                self.bytes_read += response.get("ContentLength", 0)
            return response

        s3fs.core.S3FileSystem._call_s3 = counted

    def reset(self) -> None:
        self.requests, self.bytes_read = Counter(), 0


# ---------------------------------------------------------------- moto and the input


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process (as an object store would be: its work does not
    share the client's GIL), with the bucket created once it answers."""
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    for _ in range(150):
        try:
            client.create_bucket(Bucket=BUCKET)
            return server, endpoint
        except Exception:
            time.sleep(0.2)
    server.terminate()
    raise RuntimeError(f"moto did not answer on {endpoint}")


def parquet_file(index: int, rows: int) -> bytes:
    """`rows` rows of unique ids and random hex prompts, in ROW_GROUPS row groups."""
    hex_text = os.urandom(rows * PROMPT_BYTES).hex().encode()
    offsets = pa.array(range(0, (rows + 1) * 2 * PROMPT_BYTES, 2 * PROMPT_BYTES), pa.int32())
    prompts = pa.StringArray.from_buffers(rows, offsets.buffers()[1], pa.py_buffer(hex_text))
    ids = pa.array([f"f{index:04d}-r{row:07d}" for row in range(rows)])
    sink = io.BytesIO()
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), sink, row_group_size=math.ceil(rows / ROW_GROUPS))
    return sink.getvalue()


def rows_for(megabytes: float) -> int:
    """Rows that make a file of about that size, from a trial file of 1,000 rows."""
    trial = 1000
    return max(ROW_GROUPS, round(trial * megabytes * 2**20 / len(parquet_file(0, trial))))


def write_input(endpoint: str, files: int, megabytes: float) -> tuple[int, int]:
    """Generate and upload the files, 8 at a time; returns the input's bytes and rows."""
    client = boto3.client("s3", endpoint_url=endpoint)
    rows = rows_for(megabytes)

    def upload(index: int) -> int:
        body = parquet_file(index, rows)
        client.put_object(Bucket=BUCKET, Key=f"in/part-{index:05d}.parquet", Body=body)
        return len(body)

    with ThreadPoolExecutor(8) as pool:
        return sum(pool.map(upload, range(files))), rows * files


def old_check() -> Callable:
    """`inspect_inputs(input_uri, storage)` of commit OLD_COMMIT, imported from a temp file."""
    source = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:pipeline/inputs/__init__.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"inputs_{OLD_COMMIT}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
    return module.inspect_inputs


# ---------------------------------------------------------------- the variants


def variants(storage: Storage) -> dict[str, Callable[[], int]]:
    """Each variant runs one check and returns the rows it found."""
    known = []
    inspect_old = old_check()

    def one_at_a_time() -> int:
        shipped, inputs.PARALLEL_FOOTERS = inputs.PARALLEL_FOOTERS, 1
        try:
            return inputs.inspect_inputs(INPUT_URI, storage).rows
        finally:
            inputs.PARALLEL_FOOTERS = shipped

    def parallel() -> int:
        report = inputs.inspect_inputs(INPUT_URI, storage)
        known[:] = report.files
        return report.rows

    def rerun() -> int:
        report = inputs.inspect_inputs(INPUT_URI, storage, known=known)
        assert report.footers_read == 0, report.footers_read
        return report.rows

    return {
        "(a) footers, 1 at a time": one_at_a_time,
        f"(b) footers, {inputs.PARALLEL_FOOTERS} at a time": parallel,
        "(c) rerun, known= (b)'s files": rerun,
        f"(d) old check ({OLD_COMMIT})": lambda: inspect_old(INPUT_URI, storage).rows,
    }


@dataclass
class Run:
    wall: float
    bytes_read: int
    requests: Counter


def measure(check: Callable[[], int], traffic: S3Traffic, expected_rows: int) -> Run:
    traffic.reset()
    started = time.perf_counter()
    rows = check()
    wall = time.perf_counter() - started
    assert rows == expected_rows, (rows, expected_rows)
    return Run(wall, traffic.bytes_read, traffic.requests)


def print_table(runs: dict[str, list[Run]], input_bytes: int) -> None:
    print(
        f"\n{'variant':34} {'runs':>4} {'wall s':>7} {'bytes read':>14} {'% input':>8} {'GET':>5} {'HEAD':>5} "
        f"{'LIST':>5}"
    )
    medians = {}
    for name, measured in runs.items():
        run = medians[name] = sorted(measured, key=lambda r: r.wall)[len(measured) // 2]
        print(
            f"{name:34} {len(measured):4d} {run.wall:7.2f} {run.bytes_read:14,d} "
            f"{100 * run.bytes_read / input_bytes:7.3f}% {run.requests['get_object']:5d} "
            f"{run.requests['head_object']:5d} {run.requests['list_objects_v2']:5d}"
        )
    one, parallel = list(medians.values())[:2]
    print(f"\nwall time, 1 at a time / {inputs.PARALLEL_FOOTERS} at a time: {one.wall / parallel.wall:.2f}")
    print(
        f"target: bytes read <= {TARGET:.0%} of input bytes; "
        f"(b) reads {parallel.bytes_read / input_bytes:.3%}: "
        f"{'met' if parallel.bytes_read <= TARGET * input_bytes else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--mb", type=float, default=20.0, help="approximate size of each file, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    server, endpoint = start_moto()
    try:
        started = time.perf_counter()
        input_bytes, rows = write_input(endpoint, args.files, args.mb)
        print(
            f"setup: {args.files} files, {input_bytes:,d} bytes ({input_bytes / 2**30:.2f} GiB), "
            f"{rows:,d} rows, written to moto in {time.perf_counter() - started:.1f} s"
        )

        storage = Storage(endpoint_url=endpoint)
        storage.expand_input(INPUT_URI)  # s3fs's client and connections are made once, not in (a)'s first run
        traffic = S3Traffic()
        traffic.install()
        checks = variants(storage)
        runs = {name: [] for name in checks}
        for _ in range(args.repeats):
            for name, check in checks.items():
                if name.startswith("(d)") and any(r.wall >= SLOW_SECONDS for r in runs[name]):
                    continue
                runs[name].append(measure(check, traffic, rows))
        print_table(runs, input_bytes)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
