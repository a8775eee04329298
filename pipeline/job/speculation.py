"""The driver's one place to consult the speculation policy (pipeline/speculation/policy.py). The
attempt builds one `JobSpeculation` with the job's calibration, and asks it, in order: the
setting the job runs (speculative.depth_from: calibration), whether a trial too small to pay is
skipped, what each graph's engines run (the drafter or not; the timed trial, or the prediction
from the calibration's step costs and the probe's acceptance), and the verdict at the end. The
acceptance guard's events and the trial's verdict come back through `_job.json`, and are read
here from it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from pipeline.config import JobConfig
from pipeline.inputs.units import WorkUnit
from pipeline.speculation.calibrations import calibrated_setting, job_calibration
from pipeline.speculation.guard import AcceptanceGuard
from pipeline.speculation.policy import job_costs, speculation_verdict
from pipeline.speculation.trial import too_few_units
from schemas import HeadUnits, JobManifest, SpeculationVerdict, TrialVerdict

if TYPE_CHECKING:
    from pipeline.job.plan import JobPlan
    from schemas.board import TrialPlan


class JobSpeculation:
    def __init__(self, config: JobConfig, plan: JobPlan):
        self.calibration = job_calibration(config, plan.location, plan.target, plan.drafter)

    def configured(self, config: JobConfig, say: Callable[[str], None]) -> JobConfig:
        """The config the job runs: with speculative.depth_from: calibration, the setting its
        calibration recommends (said), else as written."""
        if not (config.speculative.enabled and config.speculative.depth_from == "calibration"):
            return config
        config, said = calibrated_setting(config, self.calibration)
        say(said)
        return config

    def trial_skipped(
        self, config: JobConfig, todo: list[WorkUnit], head: Optional[HeadUnits]
    ) -> Optional[TrialVerdict]:
        """The trial's skip, before any engine, when the job has too few units for it to pay;
        None when it runs, or when the job predicts instead (a calibration: no unit is timed)."""
        if not config.speculative.trial or job_costs(config, self.calibration) is not None:
            return None
        return too_few_units(config, len(todo), sum(u.rows for u in todo), head)

    def graph(
        self, config: JobConfig, manifest: JobManifest, disabled: bool, rows: int, head: Optional[HeadUnits]
    ) -> tuple[JobConfig, bool, Optional[TrialPlan]]:
        """What the next graph's engines run: (config, whether they speculate, the trial's plan).
        Without the drafter once the guard, the trial or the prediction turned speculation off;
        with the trial's plan (a prediction's, with a calibration) while the job has no verdict."""
        from pipeline.graph.engine_trial import trial_plan

        if disabled or (manifest.trial is not None and manifest.trial.outcome == "turned-off"):
            return config.without_speculation(), False, None
        if not config.speculative.enabled:
            return config, False, None
        if config.speculative.trial and manifest.trial is None:
            return config, True, trial_plan(config, rows, head, job_costs(config, self.calibration))
        return config, True, None

    def guard(self, config: JobConfig, speculating: bool, attempt: int) -> Optional[AcceptanceGuard]:
        guard = config.speculative.guard
        return AcceptanceGuard(guard, attempt) if guard and speculating else None

    def verdict(self, config: JobConfig, manifest: JobManifest) -> Optional[SpeculationVerdict]:
        """Did speculation pay, over the committed units: the policy's record, in its words."""
        m = manifest
        return speculation_verdict(config, m.totals, m.guard_events, self.calibration, m.trial, m.probe)
