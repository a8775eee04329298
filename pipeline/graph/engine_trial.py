"""One engine actor's part in the speculation trial (pipeline/speculation/trial.py).

Every unit passes `enter` before it goes into the engine and `leave` after. The first engine
with work claims the trial at the job board. With a calibration's step costs in its plan, it
times nothing: it waits for the probe's verdict, asks the speculation policy for its prediction
(pipeline/speculation/policy.py `early_decision`), restarts without the drafter when that
predicts a loss, and posts it. Without them, unless the probe's rate already says the job is
too small for it, it measures: its first units with the engine as started (speculation on;
`units` of them and `min_seconds` of engine time), then, when the off arm is worth an engine
start, it waits for those units to leave, restarts its engine without the drafter and measures
as many again;
then it decides, restarts with the drafter if speculation won, and posts the verdict. Units
that arrive while an arm drains or the engine restarts wait in `enter`, one lock for all, so
an arm's units have the engine to themselves. The other engines follow the posted verdict:
an engine told `turned-off` drains its units and restarts without the drafter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Optional

from ray.exceptions import RayActorError

from pipeline.cluster.job_board import VERDICT_WAIT_SECONDS
from pipeline.config import JobConfig
from pipeline.speculation.policy import early_decision, setting_text, trial_decision
from pipeline.speculation.trial import (
    ArmClock,
    arm_wants_more,
    worth_a_trial,
    worth_measuring_off,
)
from pipeline.stages.metrics import ReplicaMetrics
from schemas import HeadUnits, TrialVerdict, utc_timestamp
from schemas.board import TrialPlan
from schemas.report import SpeculationCosts

if TYPE_CHECKING:
    from ray.actor import ActorHandle

Restart = Callable[[bool], Awaitable[float]]
logger = logging.getLogger(__name__)


class EngineTrial:
    """`plan`: None when this graph runs no trial; `metrics`: the replica's, which names it. `enter` is
    given the actor's `restart(speculative)`, which restarts its engine and returns its start's
    seconds: held by the trial, it would make a reference cycle, and the actor's __del__, which
    stops its engine before Ray ends the actor's processes, would not run when Ray drops it."""

    def __init__(
        self,
        config: JobConfig,
        plan: Optional[TrialPlan],
        board: Optional[ActorHandle],
        metrics: ReplicaMetrics,
        start_seconds: float,
    ):
        self.config, self.plan, self.board, self.metrics = config, plan, board, metrics
        self.actor_id = metrics.tags["replica"]
        self.start_seconds = start_seconds
        self.done = plan is None or board is None or not config.speculative.enabled
        self.measuring: Optional[bool] = None  # None: not asked yet; False: follows the verdict
        self.arms: list[ArmClock] = []
        self.entered = 0  # units entered into the current arm
        self.restarts = 0
        self.in_flight = 0
        self.idle = asyncio.Condition()
        self.turn = asyncio.Lock()

    async def enter(self, restart: Restart) -> Optional[str]:
        """Waits for this unit's turn; returns the arm it measures ('on', 'off') or None."""
        async with self.turn:
            try:
                arm = None if self.done else await self._next_arm(restart)
            except RayActorError as exc:  # the board went with a lost node: the units go on, the trial ends here
                logger.warning(
                    "speculation trial: the job board is gone (%s); this engine keeps its setting", type(exc).__name__
                )
                self.done, arm = True, None
            self.in_flight += 1
            return arm

    async def leave(self, arm: Optional[str], started: float, engine_seconds: float, rows: int, tokens: int) -> None:
        if arm is not None:
            self.arms[-1].add(started, engine_seconds, rows, tokens)
        async with self.idle:
            self.in_flight -= 1
            self.idle.notify_all()

    async def _next_arm(self, restart: Restart) -> Optional[str]:
        if self.measuring is None:
            self.measuring = await self.board.claim_trial.remote(self.actor_id)
            if self.measuring and self.plan.costs is not None:
                return await self._predict(restart)
            if self.measuring:
                skip = await self._too_small()
                if skip is not None:
                    return await self._post(skip)
                self.arms.append(ArmClock(setting_text(self.config)))
        if not self.measuring:
            await self._follow(restart)
            return None
        plan = self.plan
        if arm_wants_more(self.config, self.entered, self.arms[-1], plan.rows, plan.unit_rows, plan.max_units):
            self.entered += 1
            return "on" if len(self.arms) == 1 else "off"
        await self._drained()
        on = self.arms[0].figures()
        rows = plan.rows - 2 * on.rows
        if len(self.arms) == 1:
            skip = worth_measuring_off(self.config, on, rows, plan.engines, self.start_seconds)
            if skip is not None:
                return await self._post(skip)
            await self._switch(restart, False)
            self.arms.append(ArmClock("off"))
            self.entered = 1
            return "off"
        verdict = trial_decision(self.config, on, self.arms[1].figures(), rows, plan.engines, self.start_seconds)
        if verdict.outcome == "kept":
            await self._switch(restart, True)
        return await self._post(verdict)

    async def _predict(self, restart: Restart) -> None:
        """With a calibration's step costs: the policy's prediction from the probe's acceptance,
        before this engine's first unit; speculation off for the job when it predicts a loss."""
        probe = None
        while probe is None:
            probe = await self.board.wait_verdict.remote(VERDICT_WAIT_SECONDS)
        verdict = early_decision(self.config, self.plan.costs, probe.result)
        if verdict.outcome == "turned-off" and not probe.refusal:
            await self._drained()
            await self._switch(restart, False)
        return await self._post(verdict)

    async def _too_small(self) -> Optional[TrialVerdict]:
        """The skipped verdict when the probe's rate says the job is too small for a trial."""
        verdict = (await self.board.read.remote()).verdict
        if verdict is None or verdict.result is None:
            return None
        rows_left = self.plan.rows - 2 * self.config.speculative.trial.units * self.plan.unit_rows
        return worth_a_trial(
            self.config, verdict.result.tokens_per_second, rows_left, self.plan.engines, self.start_seconds
        )

    async def _follow(self, restart: Restart) -> None:
        verdict = await self.board.trial_verdict.remote()
        if verdict is None:
            return
        self.done = True
        if verdict.outcome == "turned-off":
            await self._drained()
            await self._switch(restart, False)

    async def _post(self, verdict: TrialVerdict) -> None:
        verdict.engine_restarts, verdict.actor_id, verdict.decided_at = self.restarts, self.actor_id, utc_timestamp()
        await self.board.post_trial.remote(verdict)
        if verdict.speedup_vs_off is not None:
            self.metrics.record_trial(verdict.speedup_vs_off)
        self.done = True
        return None

    async def _drained(self) -> None:
        async with self.idle:
            await self.idle.wait_for(lambda: self.in_flight == 0)

    async def _switch(self, restart: Restart, speculative: bool) -> None:
        began = time.time()
        seconds = await restart(speculative)
        self.restarts += 1
        self.start_seconds = seconds or (time.time() - began)


def trial_plan(
    config: JobConfig, rows: int, head: Optional[HeadUnits], costs: Optional[SpeculationCosts] = None
) -> TrialPlan:
    """What the engines of a graph that runs the trial are told: the job's rows left, its
    replicas, and the rows of the units its arms measure (the head units', when it has them);
    with a calibration's step costs, the trial is the policy's prediction instead."""
    return TrialPlan(
        rows=rows,
        engines=config.resources.max_replicas,
        unit_rows=head.rows_per_unit if head else config.resources.rows_per_unit,
        max_units=head.rows // head.rows_per_unit // 2 if head else None,
        costs=costs,
    )
