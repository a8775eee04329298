"""`specbatch demo` as a new user runs it: a quiet console. Ray's and vLLM's logs go to their
log folder (its path is printed), engines shut down cleanly, and the summary is on stdout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SPECBATCH = str(Path(sys.executable).with_name("specbatch"))


def test_a_successful_demo_prints_no_error_and_no_traceback(tmp_path):
    out = subprocess.run(
        [SPECBATCH, "demo", "--workdir", str(tmp_path / "demo"), "--rows", "24"],
        capture_output=True, text=True, timeout=900,
    )
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-4000:]
    assert "specbatch demo: succeeded" in out.stdout
    assert "ERROR" not in console and "Traceback" not in console, console[-4000:]
    assert "Warning" not in console, console[-4000:]  # no deprecation warning of ours either
    assert "Ray's and vLLM's logs:" in out.stderr and "24/24 rows" in out.stderr
