"""The job board: one small actor per graph where the engine actors check in.

Every engine posts how its start went (process, `import vllm`, engine construction), so the
driver can say where the time to the first committed unit went and how many engines the job
started. With the drafter probe on, the board holds the probe's rows: the first engine to
check in is handed them and measures them on its own engine before it generates anything, and
every engine waits for that verdict before its first commit. A failing verdict makes each
engine refuse its units (nothing is committed) and the driver stops the job with the probe's
refusal. One engine start per replica: the probe costs no engine of its own.

An engine restarted by Ray (engine death, lost node) keeps its actor id: when the engine that
claimed the probe is restarted before it posted the verdict, it is handed the rows again.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

class DrafterRefused(RuntimeError):
    """An engine's units when the probe refused the drafter: nothing is committed. The driver
    stops the job with the probe's refusal (probe.DrafterRejected, read from the board)."""


# Checked in with the verdict: no probe runs in this graph (off, already judged, or no rows).
NO_PROBE = {"result": None, "refusal": None}


class JobBoard:
    def __init__(self, probe_rows: list[dict[str, Any]], near_limit_rows: int = 0):
        self.rows, self.near_limit_rows = probe_rows, near_limit_rows
        self.claimant: Optional[str] = None
        self.verdict: Optional[dict] = None if probe_rows else NO_PROBE
        self.decided = asyncio.Event()
        if self.verdict is not None:
            self.decided.set()
        self.starts: list[dict] = []

    async def check_in(self, start: dict) -> Optional[dict]:
        """Records an engine's start; the probe's rows when this engine is to measure them."""
        self.starts.append(start)
        if self.verdict is not None or self.claimant not in (None, start["actor_id"]):
            return None
        self.claimant = start["actor_id"]
        return {"rows": self.rows, "near_limit_rows": self.near_limit_rows}

    async def post(self, verdict: dict) -> None:
        """{"result": ProbeResult as JSON, "refusal": the refusal's message or None}."""
        self.verdict = verdict
        self.decided.set()

    async def wait_verdict(self) -> dict:
        await self.decided.wait()
        return self.verdict

    async def read(self) -> dict:
        """What the driver records: every engine start, and the verdict once it is in."""
        return {"starts": list(self.starts), "verdict": self.verdict}


def start_board(probe_rows: list[dict[str, Any]], near_limit_rows: int = 0):
    """The board for one graph, on the driver's node, taking no CPU from the graph."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return ray.remote(num_cpus=0, max_restarts=0)(JobBoard).options(scheduling_strategy=here).remote(probe_rows, near_limit_rows)
