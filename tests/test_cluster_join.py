"""Which Ray cluster a local `specbatch run` joins: none it happens to find on the machine.

Ray remembers the last cluster started on a machine in `ray_current_cluster` under its temp
dir, and a plain `ray.init()` joins it, or fails once it is dead. A local run must start a Ray
of its own next to a live `ray start` head (a whole `specbatch run`, whose `_job.json` says which
cluster ran the job) and next to the stale file that head leaves when it is killed (the run's own
Ray start, `pipeline.cluster.startup.ray_init`, in a process of its own). Each has its own RAY_TMPDIR, so
the session's Ray and other tests are not touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port, job_config, ray_head_command, stop_ray_head, write_prompts

ROWS = 8


def run_cli(tmp_path: Path, name: str, kit: dict, env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    ids = [f"{name}-{i}" for i in range(ROWS)]
    write_prompts(
        tmp_path / name / "in" / "p.parquet", {"id": ids, "prompt": [f"def {name}{i}():" for i in range(ROWS)]}
    )
    config = tmp_path / name / "job.yaml"
    config.write_text(yaml.safe_dump(job_config(str(tmp_path / name / "in"), str(tmp_path / name / "out"), kit)))
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(config)], env=env, capture_output=True, text=True, timeout=600
    )
    manifest_path = tmp_path / name / "out" / "_job.json"
    return done, json.loads(manifest_path.read_text()) if manifest_path.exists() else {}


@pytest.fixture
def ray_tmpdir():
    path = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.engine
def test_a_local_run_starts_its_own_ray_next_to_a_live_head_and_its_stale_file(tmp_path, random_kit, ray_tmpdir):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = ray_tmpdir
    gcs_port = free_port()
    subprocess.run(ray_head_command(gcs_port, free_port()), check=True, env=env, capture_output=True, timeout=180)
    address_file = Path(ray_tmpdir, "ray", "ray_current_cluster")
    try:
        assert address_file.read_text().strip().endswith(f":{gcs_port}")  # what a plain ray.init() would join
        live, manifest = run_cli(tmp_path, "live", random_kit, env)
        assert live.returncode == 0, live.stderr[-3000:]
        cluster = manifest["attempts"][-1]["ray_cluster"]
        assert cluster.startswith("its own local Ray") and f":{gcs_port}" not in cluster
        assert "Ray: its own local Ray" in live.stderr
    finally:
        stop_ray_head(ray_tmpdir)

    assert address_file.read_text().strip().endswith(f":{gcs_port}")  # the head is dead, its file stays
    # Next to the stale file, the run's own Ray start (what `specbatch run` calls, in a process
    # of its own with the same environment): a plain ray.init() would fail on the dead head.
    stale = subprocess.run([sys.executable, "-c", STALE_START], env=env, capture_output=True, text=True, timeout=300)
    assert stale.returncode == 0, stale.stderr[-3000:]
    assert stale.stdout.strip().startswith("its own local Ray") and f":{gcs_port}" not in stale.stdout


STALE_START = """
import ray
from pipeline.cluster.startup import ray_init
print(ray_init()[1])
ray.shutdown()
"""
