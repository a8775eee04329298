"""What a resume reads before it starts: the ids of every committed batch, from an object store.

    python benchmarks/resume_scan.py [--batches 1000] [--rows 64]

Commits that many batches to moto's S3 server on 127.0.0.1 (as a killed job leaves them,
before compaction), then times `OutputLocation.committed_id_digests()` (what a resume reads first) with one read
at a time and with the project's parallel reads, side by side.
moto runs on this machine's cores; a real object store's round trips are longer, which is
where parallel reads pay most.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import outputs  # noqa: E402
from pipeline.outputs import OutputLocation, batch_id_for  # noqa: E402
from pipeline.storage import Storage  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()

    import os
    import socket
    import subprocess

    import boto3

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Its own process, as an object store would be: its work does not share the client's GIL.
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
            break
        except Exception:
            time.sleep(0.2)
    location = OutputLocation(Storage(endpoint_url=endpoint), "s3://bench/scan")

    started = time.time()
    for b in range(args.batches):
        ids = [f"b{b}-{i}" for i in range(args.rows)]
        location.commit(batch_id_for(ids), {"outputs": pa.table({"id": ids, "text": ["x"] * args.rows}),
                                            "stats": pa.table({"rows": [args.rows]})})
    print(f"committed {args.batches} batches of {args.rows} rows in {time.time() - started:.1f} s")

    timings = {}
    for parallel in (1, outputs.PARALLEL_READS):
        outputs.PARALLEL_READS = parallel
        started = time.time()
        digests = location.committed_id_digests()
        timings[parallel] = time.time() - started
        assert len(digests) == args.batches * args.rows
        print(f"committed_id_digests, {parallel:2d} read(s) at a time: {timings[parallel]:6.2f} s")
    sequential, parallel = timings.values()
    print(f"ratio sequential/parallel: {sequential / parallel:.2f}")
    server.terminate()


if __name__ == "__main__":
    main()
