"""`ray job submit` against a real Ray head on 127.0.0.1 (the `ray_head` fixture in conftest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from ray.job_submission import JobStatus

from pipeline.commit.outputs import OutputLocation
from pipeline.storage import Storage
from tests.conftest import job_config, write_prompts

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.mark.engine
def test_ray_job_submit_runs_the_job(tmp_path, random_kit, ray_head):
    ids = [f"r{i}" for i in range(24)]
    write_prompts(tmp_path / "in" / "p.parquet", {"id": ids, "prompt": [f"class C{i}:" for i in range(24)]})
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(job_config(str(tmp_path / "in"), str(tmp_path / "out"), random_kit)))

    # The client sends the token only with RAY_AUTH_MODE=token (ray_head.env has both).
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **ray_head.env}
    submit = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            "--address",
            ray_head.address,
            "--submission-id",
            "specbatch-test",
            "--working-dir",
            str(ROOT),
            "--runtime-env",
            str(ROOT / "jobs" / "runtime_env.yaml"),
            "--no-wait",
            "--",
            sys.executable,
            "jobs/entrypoint.py",
            "--config",
            str(config_path),
            "--job-id",
            "submitted-1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert submit.returncode == 0, submit.stderr[-3000:]
    # Status and logs through the SDK: its answers are typed, the CLI's are prose.
    client = ray_head.client
    deadline = time.time() + 600
    while time.time() < deadline and not client.get_job_status("specbatch-test").is_terminal():
        time.sleep(3)
    status, logs = client.get_job_status("specbatch-test"), client.get_job_logs("specbatch-test")
    assert status == JobStatus.SUCCEEDED, f"{status}\n{logs[-3000:]}"

    location = OutputLocation(Storage(), str(tmp_path / "out"))
    landed = location.read_table("outputs").column("id").to_pylist()
    assert Counter(landed) == Counter(ids)
    # The random drafter accepts nothing, and the stats say so.
    for row in location.read_table("stats").to_pylist():
        assert row["draft_tokens"] > 0 and row["acceptance_rate"] == 0.0 and row["mean_acceptance_length"] == 1.0
        assert row["accepted_per_position"] == [0, 0, 0]
    manifest = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert manifest["job_id"] == "submitted-1" and manifest["status"] == "succeeded"
    assert "job submitted-1 succeeded" in logs


def test_check_cluster_names_a_head_whose_job_agent_could_not_bind(tmp_path):
    """`ray start` says "Ray runtime started" while another program holds the head's dashboard
    agent port; `ray job submit` then fails with "500: No available agent to submit job" and a
    traceback. `specbatch check-cluster` says which port and what to do, in one message, exit 2."""
    import secrets
    import shutil
    import socket
    import tempfile

    from tests.conftest import free_port, ray_head_command, stop_ray_head

    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))  # another program on the agent's port, on every address
    holder.listen()
    taken = holder.getsockname()[1]
    dashboard = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    try:
        started = subprocess.run(
            ray_head_command(free_port(), dashboard, f"--temp-dir={temp_dir}", agent_port=taken),
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert started.returncode == 0 and "Ray runtime started" in started.stdout + started.stderr, started.stderr[
            -2000:
        ]
        check = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "check-cluster", "--address", f"http://127.0.0.1:{dashboard}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
        )
    finally:
        stop_ray_head(temp_dir)
        holder.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert check.returncode == 2, check.stdout + check.stderr
    said = check.stderr
    assert "Traceback" not in said and len(said.strip().splitlines()) == 1, said
    assert "No available agent to submit job" in said and "--dashboard-agent-listen-port" in said, said
    assert f"Failed to bind to port {taken}" in said, said  # read from the head's own agent log
