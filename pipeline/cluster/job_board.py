"""The job board: one small actor per graph where the engine actors check in.

Every engine posts how its start went (process, `import vllm`, engine construction), so the
driver can say where the time to the first committed unit went and how many engines the job
started. With the drafter probe on, the board holds the probe's rows: the first engine with a
unit to run is handed them and measures them on its own engine before its units generate, and
every engine waits for that verdict before its first commit. A failing verdict makes each
engine refuse its units (nothing is committed) and the driver stops the job with the probe's
refusal. One engine start per replica: the probe costs no engine of its own.

An engine restarted by Ray (engine death, lost node) keeps its actor id: when the engine that
claimed the probe is restarted before it posted the verdict, it is handed the rows again; a
claim left by an engine that is gone for good is taken over after CLAIM_STALE_SECONDS.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Optional

from schemas import EngineStart, ReplicaProgress, TrialVerdict
from schemas.board import NO_PROBE, BoardReading, ProbeClaim, ProbeVerdict

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# A claim this old without a verdict is taken over: the engine that claimed it is gone.
CLAIM_STALE_SECONDS = 600.0
# Engines waiting for the verdict look again this often (and take over a stale claim).
VERDICT_WAIT_SECONDS = 60.0


class JobBoard:
    def __init__(self, probe_rows: list[dict[str, Any]], near_limit_rows: int = 0):
        self.rows, self.near_limit_rows = probe_rows, near_limit_rows
        self.claimant: Optional[str] = None
        self.claimed_at = 0.0
        self.verdict: Optional[ProbeVerdict] = None if probe_rows else NO_PROBE
        self.decided = asyncio.Event()
        if self.verdict is not None:
            self.decided.set()
        self.starts: list[EngineStart] = []
        self.engines: list[ActorHandle] = []
        self.trial_claimant: Optional[str] = None
        self.trial: Optional[TrialVerdict] = None
        self.progress: dict[str, ReplicaProgress] = {}  # actor id -> its engine's last progress report

    async def check_in(self, start: EngineStart, engine: Optional[ActorHandle] = None) -> None:
        """Records an engine's start, and its actor's handle for the driver to stop it by."""
        self.starts.append(EngineStart.model_validate(start))
        if engine is not None:
            self.engines.append(engine)

    async def hand_over_engines(self) -> list[ActorHandle]:
        """The engine actors' handles, once: the board holds them no longer."""
        engines, self.engines = self.engines, []
        return engines

    async def claim(self, actor_id: str) -> Optional[ProbeClaim]:
        """The probe's rows, to the first engine that has a unit to run (an engine without
        work never holds the others up); again to the same engine when Ray restarted it, and
        to another once the claim is CLAIM_STALE_SECONDS old with no verdict (its engine went
        away). None once the verdict is in, or while another engine measures."""
        if self.verdict is not None:
            return None
        stale = self.claimant is not None and time.time() - self.claimed_at > CLAIM_STALE_SECONDS
        if self.claimant not in (None, actor_id) and not stale:
            return None
        self.claimant, self.claimed_at = actor_id, time.time()
        return ProbeClaim(rows=self.rows, near_limit_rows=self.near_limit_rows)

    async def post(self, verdict: ProbeVerdict) -> None:
        self.verdict = ProbeVerdict.model_validate(verdict)
        self.decided.set()

    async def wait_verdict(self, timeout: float) -> Optional[ProbeVerdict]:
        """The verdict once it is in; None after `timeout` seconds without one."""
        try:
            await asyncio.wait_for(self.decided.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return self.verdict

    async def claim_trial(self, actor_id: str) -> bool:
        """True for the engine that runs the speculation trial: the first to ask, and the same
        engine again when Ray restarted it before its verdict (it measures again)."""
        if self.trial is None and self.trial_claimant in (None, actor_id):
            self.trial_claimant = actor_id
            return True
        return False

    async def post_trial(self, verdict: TrialVerdict) -> None:
        self.trial = TrialVerdict.model_validate(verdict)

    async def trial_verdict(self) -> Optional[TrialVerdict]:
        return self.trial

    async def report_progress(self, progress: ReplicaProgress) -> None:
        """An engine's progress, every few seconds."""
        progress = ReplicaProgress.model_validate(progress)
        self.progress[progress.actor_id] = progress

    async def read_progress(self) -> list[ReplicaProgress]:
        return list(self.progress.values())

    async def read(self) -> BoardReading:
        """What the driver records: every engine start, the probe's verdict and the trial's,
        once they are in."""
        return BoardReading(starts=list(self.starts), verdict=self.verdict, trial=self.trial)


def start_board(probe_rows: list[dict[str, Any]], near_limit_rows: int = 0) -> ActorHandle:
    """The board for one graph, on the driver's node, taking no CPU from the graph."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return (
        ray.remote(num_cpus=0, max_restarts=0)(JobBoard)
        .options(scheduling_strategy=here)
        .remote(probe_rows, near_limit_rows)
    )
