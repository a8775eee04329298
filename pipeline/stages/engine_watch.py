"""Whether the actor's engine is still making progress.

vLLM's engine reports every step to its stat loggers (with `disable_log_stats=False`, which the
job's engine arguments set, each step sends its scheduler's stats, also a step that only
prefills part of a prompt). `EngineClock` is one of those loggers: it notes the time of the last
step, and the slowest step seen while requests were in the engine. An engine that has requests
and reports no step for its limit is hung, as a GPU fault or an NCCL hang leaves one: alive to
Ray, never answering. The limit is `retries.engine_stall_seconds`, or `STEP_MULTIPLE` times the
slowest step the engine has shown when that is longer, so that a model whose steps are slow on
its hardware is judged by its own pace.

`engine_stacks` takes the Python stacks of the engine's processes with py-spy (a dependency of
`ray[default]`, what `ray stack` uses), without pausing them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# A step may take this many times the slowest step seen before the engine counts as hung.
STEP_MULTIPLE = 20.0
# A stack dump of one process may take this long (py-spy reads the process's memory).
STACKS_TIMEOUT_SECONDS = 20.0
STACKS_MAX_CHARS = 12_000


class EngineClock:
    """The engine's pace, noted by its stat logger on the actor's event loop."""

    def __init__(self, floor_seconds: float):
        self.floor_seconds = floor_seconds
        self.last_step_at = time.time()
        self.busy_since: Optional[float] = None  # when requests last went into an idle engine
        self.slowest_step = 0.0

    def step(self) -> None:
        now = time.time()
        if self.busy_since is not None and self.last_step_at >= self.busy_since:  # busy across the whole gap
            self.slowest_step = max(self.slowest_step, now - self.last_step_at)
        self.last_step_at = now

    def busy(self, has_requests: bool) -> None:
        """Called as the watch looks: the engine has requests in it, or not."""
        if not has_requests:
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = time.time()

    def seconds_without_progress(self) -> float:
        """Seconds the engine has held requests with no step; 0 when it holds none."""
        if self.busy_since is None:
            return 0.0
        return time.time() - max(self.last_step_at, self.busy_since)

    def limit(self) -> float:
        return max(self.floor_seconds, STEP_MULTIPLE * self.slowest_step)

    def stat_logger_factory(self):
        """A vLLM per-engine stat logger factory that notes each step on this clock."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        clock = self

        class StepLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                clock.step()

            def log_engine_initialized(self):
                pass

        return StepLogger


def engine_stacks(pids: list[int]) -> str:
    """The Python stacks of each process (py-spy dump, non-blocking: it reads a stopped or busy
    process as it is); what could not be read says why."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    parts = []
    for pid in pids:
        try:
            done = subprocess.run(
                [spy, "dump", "--nonblocking", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=STACKS_TIMEOUT_SECONDS,
            )
            text = done.stdout if done.returncode == 0 else f"py-spy failed ({done.returncode}): {done.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"py-spy could not run: {exc}"
        parts.append(f"--- process {pid}\n{text.strip()[:STACKS_MAX_CHARS]}")
    return "\n".join(parts)
