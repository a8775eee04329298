"""`specbatch check-cluster [--address URL]`: does a Ray head take jobs? It submits a job that
does nothing (`python -c pass`, no CPU asked) through the head's Jobs API, as `ray job submit`
does, waits for it to end, deletes its record and says what it saw; exit 0 if it ran, 2 if not.

`ray start` says "Ray runtime started" even when the head's dashboard agent, which runs every
submitted job, could not start; a submission then fails with Ray's "500: No available agent to
submit job" and a traceback. Most often another program (another Ray on the same machine)
holds the agent's port, and the head's `dashboard_agent.log` says so. This check names that.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import socket
import sys
import time
import uuid
from typing import Optional
from urllib.parse import urlparse

NO_AGENT = "No available agent to submit job"
AGENT_STARTS_SECONDS = 15.0  # the agent answers a few seconds after `ray start` returns
EXAMPLE = "example:\n  specbatch check-cluster --address http://127.0.0.1:8265"


def check_cluster(address: str, wait_seconds: float = 60.0) -> tuple[bool, str]:
    """(ran, what to tell the user)."""
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except Exception as exc:  # connection refused, bad address, authentication
        return False, f"cannot reach the Jobs API at {address}: {_said(exc)}"
    started, job = time.time(), None
    while job is None:
        try:
            job = client.submit_job(
                entrypoint="python -c pass",
                submission_id=f"specbatch-check-{uuid.uuid4().hex[:12]}",
                entrypoint_num_cpus=0,
            )
        except RuntimeError as exc:
            if NO_AGENT not in str(exc):
                return False, f"the head at {address} refused a job: {_said(exc)}"
            bound = _bind_failure() if _on_this_machine(address) else None
            if bound or time.time() - started > AGENT_STARTS_SECONDS:
                return False, _no_agent(address, bound)
            time.sleep(1.0)
    while not (status := client.get_job_status(job)).is_terminal():
        if time.time() - started > wait_seconds:
            return (
                False,
                f"the head at {address} took the job {job} but it has not ended in {wait_seconds:.0f} s ({status})",
            )
        time.sleep(0.5)
    took = time.time() - started
    logs = client.get_job_logs(job).strip()
    client.delete_job(job)
    if str(status) != "SUCCEEDED":
        return False, f"the head at {address} ran a job that does nothing and it ended {status}: {logs[-500:]}"
    return True, f"the head at {address} takes jobs: one that does nothing ran in {took:.1f} s"


def _no_agent(address: str, bound: Optional[str]) -> str:
    why = (
        f"the head at {address} cannot run jobs: its dashboard agent is not running (Ray answers '{NO_AGENT}'). "
        "Most often another program holds the agent's port (52365 unless --dashboard-agent-listen-port says "
        "otherwise), another Ray on the same machine among them: its dashboard_agent.log, under the head's "
        "session folder (/tmp/ray/session_latest/logs), says 'Failed to bind to port N'."
    )
    if bound:
        why += f" On this machine it says: {bound}."
    return why + " Stop the head and start it again with --dashboard-agent-listen-port=PORT, a free port."


def _on_this_machine(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    return host in ("127.0.0.1", "localhost", "::1", socket.gethostname())


def _bind_failure() -> Optional[str]:
    """The last 'Failed to bind' line of the newest agent log on this machine that has one,
    among the Ray sessions of the last 10 minutes: a head on this machine whose agent gave up on
    its port (it tries for about 3 s). Not merely the newest session's: another Ray started on
    the machine since would hide it."""
    recent = time.time() - 600
    logs = {log: _mtime(log) for log in glob.glob("/tmp/ray*/session_*/logs/dashboard_agent.log")}
    for log in sorted((log for log, mtime in logs.items() if mtime > recent), key=logs.get, reverse=True):
        try:
            with open(log, errors="replace") as f:
                lines = [line for line in f if "Failed to bind to port" in line]
        except OSError:  # a session folder removed since
            continue
        match = re.search(r"Failed to bind to port \d+.*", lines[-1].strip()) if lines else None
        if match:
            return f"{log}: {match.group(0)}"
    return None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _said(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:600] or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specbatch check-cluster",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--address", help="the head's Jobs API (default: RAY_ADDRESS), e.g. http://HEAD:8265")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the job to end (default 60)")
    args = parser.parse_args(argv)
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        print(
            "specbatch check-cluster: no address: give --address http://HEAD:8265 or set RAY_ADDRESS", file=sys.stderr
        )
        return 2
    ok, message = check_cluster(address, args.wait)
    print(f"specbatch check-cluster: {message}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
