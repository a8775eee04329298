"""`ray job submit` against a real Ray head on 127.0.0.1, started and stopped by the test."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from ray.job_submission import JobStatus, JobSubmissionClient

from pipeline.outputs import OutputLocation
from pipeline.storage import Storage
from tests.conftest import free_port, job_config, ray_head_command, stop_ray_head, write_prompts

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def job_status(client: JobSubmissionClient, job_id: str) -> JobStatus:
    """A just-submitted job can be unknown to the head for a moment (404): still pending."""
    try:
        return client.get_job_status(job_id)
    except RuntimeError as exc:
        if "does not exist" in str(exc):
            return JobStatus.PENDING
        raise


def test_ray_job_submit_runs_the_job(tmp_path, random_kit):
    ids = [f"r{i}" for i in range(24)]
    write_prompts(tmp_path / "in" / "p.parquet", {"id": ids, "prompt": [f"class C{i}:" for i in range(24)]})
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(job_config(str(tmp_path / "in"), str(tmp_path / "out"), random_kit)))

    gcs_port, dashboard_port = free_port(), free_port()
    ray_temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # Token authentication, as a real cluster should run: the token comes from the environment.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    start = ray_head_command(gcs_port, dashboard_port, f"--temp-dir={ray_temp}")
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=180)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        for _ in range(5):  # the head's job agent can take a few seconds to come up after `ray start`
            submit = subprocess.run(
                [
                    RAY, "job", "submit", "--address", address, "--submission-id", "specbatch-test",
                    "--working-dir", str(ROOT), "--runtime-env", str(ROOT / "jobs" / "runtime_env.yaml"), "--no-wait",
                    "--", sys.executable, "jobs/entrypoint.py", "--config", str(config_path), "--job-id", "submitted-1",
                ],
                env=env, capture_output=True, text=True, timeout=180,
            )
            if submit.returncode == 0 or "already exists" in submit.stderr:
                break
            time.sleep(3)
        assert submit.returncode == 0 or "already exists" in submit.stderr, submit.stderr[-3000:]
        # Status and logs through the SDK: its answers are typed, the CLI's are prose.
        client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
        deadline = time.time() + 600
        while time.time() < deadline and not job_status(client, "specbatch-test").is_terminal():
            time.sleep(3)
        status, logs = client.get_job_status("specbatch-test"), client.get_job_logs("specbatch-test")
        assert status == JobStatus.SUCCEEDED, f"{status}\n{logs[-3000:]}"
    finally:
        stop_ray_head(ray_temp)
        shutil.rmtree(ray_temp, ignore_errors=True)

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
