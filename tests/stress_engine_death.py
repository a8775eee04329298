"""EngineCore SIGKILLed again and again in one job, in turn once a unit committed, as soon as
the replacement's EngineCore appears, and as soon as its worker appears: after each,
none of the dead engine's processes may be alive when the next engine starts, and none of the
job's engine processes 10 s after the job ends. Not part of the suite (about 15 minutes for
twelve kills); tests/test_resilience.py kills one EngineCore per run in CI.

    .venv/bin/python -m tests.stress_engine_death [--kills 12]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from pipeline.commit.outputs import OutputLocation
from pipeline.storage import Storage
from tinykit.random_kit import build_random_kit
from tests.test_resilience import (
    alive,
    assert_exactly_once,
    kill_engine_cores,
    make_job,
    start_job,
    vllm_processes,
    wait_for_commits,
    wait_for_new_engine_core,
)

# When each kill comes: once a unit committed; as soon as the replacement's EngineCore
# appears; as soon as its worker appears (loading the model, then the queues' handshake).
# One kill per engine start at most: an actor starts its engine twice, then fails the job.
WHEN = ("steady", "engine core starting", "steady", "worker loading")


def wait_for_worker(before: dict, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not any("Worker" in p.name() for pid, p in vllm_processes().items() if pid not in before):
        assert proc.poll() is None and time.time() < deadline, "no worker started"
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=12)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="specbatch-stress-"))
    kit = build_random_kit(str(root / "kit"))
    config_path, ids, _ = make_job(
        root,
        kit,
        rows=8 * 4 * args.kills,
        retries={"max_actor_restarts": 4 * args.kills, "isolate_after_attempts": 99},
    )
    location = OutputLocation(Storage(), str(root / "out"))
    before = vllm_processes()
    proc = start_job(config_path)
    log = root / "job.log"
    print(f"job output: {log}", flush=True)
    threading.Thread(target=lambda: log.write_text("".join(iter(proc.stdout.readline, ""))), daemon=True).start()
    wait_for_commits(location, 1, proc, timeout=600)
    outlived = []
    for kill in range(args.kills):
        when = WHEN[kill % len(WHEN)]
        if when == "steady":
            wait_for_commits(location, len(location.committed_units()) + 1, proc, timeout=600)
        elif when == "worker loading":
            wait_for_worker(before, proc)
        dying = list(vllm_processes(proc.pid).values())  # the job's session, as test_resilience does
        killed = len([p for p in dying if "EngineCore" in p.name()])
        wait_for_new_engine_core(kill_engine_cores(proc), proc)
        left = alive(dying)
        outlived += left
        print(
            f"kill {kill + 1}/{args.kills} ({when}): {killed} EngineCore killed, {len(dying)} processes of the "
            f"dead engine, alive when the replacement started: {left or 'none'}",
            flush=True,
        )
    proc.wait(timeout=1800)
    assert proc.returncode == 0, f"the job failed: {log}"
    time.sleep(10)
    after = alive(p for pid, p in vllm_processes().items() if pid not in before)
    assert_exactly_once(location, ids)
    print(
        f"{args.kills} kills: processes that outlived their engine into the next start: {len(outlived)}; "
        f"engine processes alive 10 s after the job: {after or 'none'}; every id exactly once"
    )


if __name__ == "__main__":
    main()
