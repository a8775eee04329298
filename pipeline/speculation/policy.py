"""The speculation policy: whether a job speculates, at which depth, and whether it paid. Decided
here alone; the pilot page, the dry run, the console, `specbatch status`, the report, `_job.json`
and the data card print the words this module writes.

Its evidence, each measured apart: what the hardware and engine settings cost (a calibration's
step costs, `specbatch calibrate` or `pilot`, on any prompts); what the job's traffic accepts
(the share of drafts kept by position, from the probe's rows before the first unit and from the
committed units after); for a job without a calibration, the trial (both settings timed on the
job's own engine, pipeline/speculation/trial.py). Combined (pipeline/speculation/speedup.py),
speculation runs at E_k x T_off / T_k the speed of off. Every speedup carries its spread; it
"paid" only when the whole spread lies above 1.0, it "cost more than it saved" only when it lies
below, and otherwise it made no difference a measurement can show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Sequence

from pipeline.config import JobConfig
from pipeline.speculation.speedup import NO_SPEEDUP, Speedup, Traffic, Verdict, costs_from, predict, row_speedup
from pipeline.stages.engine import schedule_text
from schemas import GuardEvent, JobTotals, ProbeResult, SpeculationVerdict, TrialArm, TrialVerdict
from schemas.report import CalibrationReport, CalibrationRow, SpeculationCosts

if TYPE_CHECKING:
    from pipeline.speculation.calibrations import JobCalibration


# ---------------------------------------------------------------- the decisions


def setting_text(config: JobConfig) -> str:
    spec = config.speculative
    return schedule_text(spec.depth_schedule) if spec.depth_schedule else f"k={spec.num_speculative_tokens}"


def trial_concurrency(config: JobConfig) -> int:
    """Sequences at once in one engine in the job's steady state: its units in flight, up to max_num_seqs."""
    return min(config.resources.units_in_flight * config.resources.rows_per_unit, config.engine.max_num_seqs)


def job_costs(config: JobConfig, calibration: Optional[JobCalibration]) -> Optional[SpeculationCosts]:
    """The step costs the job's speculation is judged by: its calibration's, at its concurrency
    and at the depth it drafts there."""
    if calibration is None or calibration.report is None or not config.speculative.enabled:
        return None
    concurrency = trial_concurrency(config)
    return costs_from(calibration.report, depth_at(config, concurrency), concurrency, calibration.uri)


def depth_at(config: JobConfig, concurrency: int) -> int:
    """The depth the job drafts at with `concurrency` sequences running."""
    spec = config.speculative
    for lo, hi, k in spec.depth_schedule or []:
        if lo <= concurrency <= hi:
            return k
    return spec.num_speculative_tokens


# ---------------------------------------------------------------- before the job: a calibration's recommendation, the
# decision a run will make


def recommended_row(rows: Sequence[CalibrationRow]) -> CalibrationRow:
    """At one concurrency (fixed depths only): the fastest depth whose speedup paid over its
    whole spread (ties: the shallower), else off; when off was not measured, the fastest."""
    off = next((r for r in rows if r.depth == 0), None)
    if off is None:
        return max(rows, key=lambda r: (r.tokens_per_second_per_gpu, -r.depth))
    paid = [r for r in rows if (row_speedup(r) or NO_SPEEDUP).verdict == "paid"]
    return max(paid, key=lambda r: (r.tokens_per_second_per_gpu, -r.depth)) if paid else off


def recommendation_text(report: CalibrationReport, concurrency: int) -> str:
    """Why the calibration recommends what it does at `concurrency`: each depth's words."""
    rows = [r for r in report.rows if r.concurrency == concurrency and r.schedule is None and r.depth]
    chosen = recommended_row([r for r in report.rows if r.concurrency == concurrency and r.schedule is None])
    said = "; ".join(f"k={r.depth} {(row_speedup(r) or NO_SPEEDUP).words()}" for r in rows) or "no depth measured"
    head = f"speculation k={chosen.depth}" if chosen.depth else "speculation off"
    runs = min((len(r.seconds_runs) for r in report.rows), default=0)
    return f"{head}: at {concurrency} sequences at once, vLLM alone, {runs} runs each: {said}"


def prediction_text(setting: str, speedup: Speedup, concurrency: int, costs: SpeculationCosts, traffic: Traffic) -> str:
    """The predicted verdict, and what it rests on: which calibration, and whose acceptance."""
    own = Traffic.of_calibration(costs).length(costs.depth)
    same = list(traffic.acceptance) == list(costs.calibration_acceptance)
    theirs = f"; the calibration's own sample: {own:.2f}" if own is not None and not same else ""
    return (
        f"speculation {setting} {speedup.words()} at {concurrency} sequences at once, predicted from the step costs of "
        f"the calibration of {costs.measured_at} (at {costs.concurrency} sequences; {costs.calibration_uri}) and the "
        f"acceptance of {traffic.source} (mean acceptance length {traffic.length(costs.depth):.2f}{theirs})"
    )


def planned_decision(
    config: JobConfig, calibration: Optional[JobCalibration], trial_skipped: Optional[TrialVerdict] = None
) -> str:
    """The decision a run of this config will make, before any engine (the dry run, the pilot):
    with a calibration, its prediction on the calibration sample's acceptance, which the run
    makes again on the acceptance of its probe's rows; without one, the trial, or why none."""
    spec = config.speculative
    if not spec.enabled or not spec.drafter:
        return "speculation off: no drafter runs (speculative.enabled: false, or no speculative.drafter)"
    setting, concurrency = setting_text(config), trial_concurrency(config)
    costs = job_costs(config, calibration)
    if costs is not None:
        traffic = Traffic.of_calibration(costs)
        speedup = predict(costs, traffic)
        if speedup is not None:
            if not spec.trial:
                then = (
                    "speculative.trial is off: the run keeps its setting; its verdict is predicted from its own units"
                )
            elif speedup.verdict == "cost_more":
                then = "the run turns it off at its first engine unless its probe's acceptance predicts otherwise"
            else:
                then = (
                    "the run predicts again from its probe's acceptance before its first unit, and turns it off if "
                    "that predicts a loss"
                )
            return f"{prediction_text(setting, speedup, concurrency, costs, traffic)}: {then}"
    where = calibration.where if calibration is not None else "no calibration was looked for"
    if trial_skipped is not None:
        return f"{trial_skipped.reason}; {where}: nothing will measure speculation against off"
    if spec.trial:
        return (
            f"speculation {setting}: {where}: the trial measures it against off on the job's first units, at "
            f"{concurrency} sequences at once, and keeps it only if it paid"
        )
    return f"speculation {setting}: {where}, and the trial is off: nothing will measure speculation against off"


# ---------------------------------------------------------------- the job's first engine, its trial


def early_decision(config: JobConfig, costs: SpeculationCosts, probe: Optional[ProbeResult]) -> TrialVerdict:
    """At the first engine, before any unit: the calibration's costs with the probe's acceptance
    on the job's first rows. Predicted to cost more than it saves: speculation off for the job.
    No timed arm, no engine restart unless it is turned off."""
    setting, concurrency = setting_text(config), trial_concurrency(config)
    traffic = Traffic.of_probe(probe)
    speedup = predict(costs, traffic) if traffic else None
    if speedup is None:
        reason = (
            f"speculation {setting}: kept as configured: the probe measured no drafts at depth {costs.depth} to "
            "predict its speedup from"
        )
        return TrialVerdict(
            outcome="kept", reason=reason, setting=setting, concurrency=concurrency, method="prediction"
        )
    lose = speedup.verdict == "cost_more"
    said = prediction_text(setting, speedup, concurrency, costs, traffic)
    return TrialVerdict(
        outcome="turned-off" if lose else "kept",
        reason=f"{said}: {'turned off for this job' if lose else 'kept'}",
        setting=setting,
        concurrency=concurrency,
        **_trial_figures(speedup),
        method="prediction",
    )


def _trial_figures(speedup: Speedup) -> dict[str, float]:
    return dict(zip(("speedup_vs_off", "speedup_low", "speedup_high"), speedup.rounded()))


def trial_speedup(on: TrialArm, off: TrialArm) -> Optional[Speedup]:
    """The trial's speedup: the arms' rates, with the spread of their units' own rates."""
    if off.tokens_per_second <= 0:
        return None
    median = on.tokens_per_second / off.tokens_per_second
    return Speedup.of_rates(on.unit_tokens_per_second, off.unit_tokens_per_second, median=median)


def rest_seconds(arm: TrialArm, rows_left: int, engines: int) -> float:
    """Engine seconds per engine of the rows left, at this arm's rate and tokens per row."""
    if arm.rows == 0 or arm.tokens_per_second <= 0:
        return 0.0
    return rows_left * (arm.generated_tokens / arm.rows) / arm.tokens_per_second / max(engines, 1)


def trial_decision(
    config: JobConfig, on: TrialArm, off: TrialArm, rows_left: int, engines: int, start_seconds: float
) -> TrialVerdict:
    """After both arms of the trial, with the engine off: speculation back on only when it paid
    (its whole spread above 1.0, and its median at least 1 + speculative.trial.margin) and the
    rest of the job saves more than the engine start that turning it back on costs."""
    margin = config.speculative.trial.margin
    restart = start_seconds if config.speculative.trial.payback_starts > 0 else 0.0
    speedup = trial_speedup(on, off)
    saving = rest_seconds(off, rows_left, engines) - rest_seconds(on, rows_left, engines)
    setting, concurrency = setting_text(config), trial_concurrency(config)
    measured = (
        trial_text(setting, speedup, concurrency, on, off)
        if speedup
        else f"speculation {setting}: the off arm generated nothing at {concurrency} sequences"
    )
    paid = speedup is not None and speedup.verdict == "paid"
    if paid and speedup.median >= 1 + margin and saving > restart:
        outcome, reason = "kept", f"{measured}: kept"
    elif paid and speedup.median >= 1 + margin:
        outcome = "turned-off"
        reason = (
            f"{measured}: turned off: the rest of the job would save about {saving:.0f} s, less than the "
            f"{start_seconds:.0f} s engine start that turning it back on costs"
        )
    elif paid:
        outcome, reason = "turned-off", f"{measured}: turned off (not {1 + margin:.2f}x or more: within the margin)"
    else:
        outcome, reason = "turned-off", f"{measured}: turned off"
    return TrialVerdict(
        outcome=outcome,
        reason=reason,
        setting=setting,
        concurrency=concurrency,
        speculation=on,
        off=off,
        **(_trial_figures(speedup) if speedup else {"speedup_vs_off": 0.0}),
        margin=margin,
        engine_start_seconds=round(start_seconds, 3),
    )


def trial_text(setting: str, speedup: Speedup, concurrency: int, on: TrialArm, off: TrialArm) -> str:
    return (
        f"speculation {setting} {speedup.words()} at {concurrency} sequences at once, measured by this job's trial on "
        f"its first {on.units} + {off.units} units"
    )


# ---------------------------------------------------------------- the job's verdict


def speculation_verdict(
    config: JobConfig,
    totals: JobTotals,
    events: list[GuardEvent],
    calibration: Optional[JobCalibration] = None,
    trial: Optional[TrialVerdict] = None,
    probe: Optional[ProbeResult] = None,
) -> Optional[SpeculationVerdict]:
    """Did speculation pay over the committed units? None when the job did not speculate. Its
    figures are those of the units that speculated (JobTotals). It rests on the job's trial when
    the trial timed both settings; else on a prediction from the calibration's step costs and
    the job's own acceptance (its units', else its probe's when no unit speculated: the
    prediction turned it off at the first engine); only without either on the floors."""
    spec = config.speculative
    if not spec.enabled:
        return None
    floor, tpp_floor = _floors(config)
    mal, tpp = totals.mean_acceptance_length, totals.tokens_per_target_pass
    basis = _basis(config, totals, calibration, trial, probe)
    flags = _below_floors(mal, tpp, floor, tpp_floor, decides=basis.speedup is None)
    below = bool(flags)
    flags += [f"the acceptance guard acted ({e.action}): {e.message}" for e in events]
    if mal is None and totals.units and not (trial is not None and trial.outcome == "turned-off"):
        flags.append("speculation was on but nothing was drafted (a depth schedule with k=0 at the job's concurrency?)")
    verdict, cost, unknown, text = _said(setting_text(config), basis, flags[0] if below else None)
    flags += _trial_flags(trial, basis, verdict, text)
    median, low, high = basis.speedup.rounded() if basis.speedup else (None, None, None)
    return SpeculationVerdict(
        floor=floor,
        mean_acceptance_length=mal,
        tokens_per_target_floor=tpp_floor,
        tokens_per_target_pass=tpp,
        below_floor=below,
        cost_more_than_saved=cost,
        cost_unknown_because=unknown,
        flags=flags,
        source=basis.source,
        source_detail=basis.text,
        calibration_uri=basis.uri,
        verdict=verdict,
        speedup=median,
        speedup_low=low,
        speedup_high=high,
        acceptance_from=basis.acceptance_from,
        text=text,
    )


def _said(
    setting: str, basis: _Basis, below: Optional[str]
) -> tuple[Optional[Verdict], Optional[bool], Optional[str], str]:
    """(verdict, cost_more_than_saved, why unknown, the sentence): from the speedup when one was
    measured or predicted, else from the floor the units fell below (`below`), else unknown."""
    if basis.speedup is not None:
        verdict = basis.speedup.verdict
        cost = {"paid": False, "cost_more": True}.get(verdict)
        return verdict, cost, None if cost is not None else basis.text, basis.text
    if below is not None:
        return None, True, None, f"speculation {setting} cost more than it saved: {below}"
    return None, None, basis.text, f"whether speculation {setting} paid is not known: {basis.text}"


def _trial_flags(trial: Optional[TrialVerdict], basis: _Basis, verdict: Optional[Verdict], text: str) -> list[str]:
    if trial is not None and trial.outcome == "turned-off":
        if basis.source == "trial" and verdict == "cost_more":
            return [f"the speculation trial measured it slower than off: it cost more than it saved ({trial.reason})"]
        return [trial.reason]
    if verdict == "cost_more":
        return [f"{text} (speculative.depth_from: calibration runs the calibrated setting)"]
    return []


@dataclass(frozen=True)
class _Basis:
    source: Literal["trial", "prediction", "none"]
    text: str
    speedup: Optional[Speedup] = None
    uri: Optional[str] = None
    acceptance_from: Optional[str] = None


def _basis(
    config: JobConfig,
    totals: JobTotals,
    calibration: Optional[JobCalibration],
    trial: Optional[TrialVerdict],
    probe: Optional[ProbeResult],
) -> _Basis:
    setting, concurrency = setting_text(config), trial_concurrency(config)
    if trial is not None and trial.speculation is not None and trial.off is not None:
        speedup = trial_speedup(trial.speculation, trial.off)
        if speedup is not None:
            return _Basis("trial", trial_text(setting, speedup, concurrency, trial.speculation, trial.off), speedup)
    costs = job_costs(config, calibration)
    traffic = Traffic.of_totals(totals) or Traffic.of_probe(probe)
    speedup = predict(costs, traffic) if costs and traffic else None
    if speedup is not None:
        text = prediction_text(setting, speedup, concurrency, costs, traffic)
        return _Basis("prediction", text, speedup, costs.calibration_uri, traffic.source)
    no_trial = trial.reason if trial is not None else "the job ran no speculation trial"
    how = (
        "`specbatch calibrate` or `specbatch pilot` on this job's config measures the step costs every later job of "
        "these models and settings is judged by"
    )
    if calibration is None or calibration.report is None:
        where = calibration.where if calibration is not None else "no calibration was looked for"
        return _Basis("none", f"{no_trial}; {where}: {how}")
    if costs is None:
        depth = depth_at(config, concurrency)
        return _Basis(
            "none", f"{no_trial}; {calibration.where} did not measure off and depth {depth} (with repeats): {how}"
        )
    return _Basis("none", f"{no_trial}; no draft was accepted or counted at depth {costs.depth} to predict from")


def _floors(config: JobConfig) -> tuple[float, Optional[float]]:
    """The mean acceptance length and tokens per target pass a job is held to: the guard's, else the probe's."""
    spec = config.speculative
    guard, probe = spec.guard, spec.probe
    floor = (
        guard.min_mean_acceptance_length
        if guard and guard.min_mean_acceptance_length
        else probe.min_mean_acceptance_length
    )
    tpp_floor = (
        guard.min_tokens_per_target_pass
        if guard and guard.min_tokens_per_target_pass
        else probe.min_tokens_per_target_pass
    )
    return floor, tpp_floor


def _below_floors(
    mal: Optional[float], tpp: Optional[float], floor: float, tpp_floor: float, decides: bool
) -> list[str]:
    """The flag of the first floor the units that speculated are below; it says speculation cost
    more than it saved only when it `decides` that (nothing measured or predicted the speedup)."""
    cost = ": speculation cost more than it saved" if decides else ""
    if mal is not None and mal < floor:
        return [
            f"mean acceptance length {mal:.2f} over the units that speculated is below the floor {floor}{cost} "
            "(a drafter trained for another base model looks like this)"
        ]
    if mal is not None and tpp is not None and tpp < tpp_floor:
        return [
            f"{tpp:.2f} tokens per target pass over the units that speculated, below the floor {tpp_floor}, while "
            f"vLLM's mean acceptance length reads {mal:.2f}{cost} (a grammar that cuts the drafts looks like this: "
            "vLLM's counters leave the cut drafts out)"
        ]
    return []


def verdict_text(verdict: SpeculationVerdict) -> str:
    """The verdict in one sentence, with what it rests on: every surface prints it in these words."""
    if verdict.text:
        return verdict.text
    # a job written before the policy kept its sentence
    if verdict.cost_more_than_saved is None:
        return f"whether speculation paid is not known: {verdict.cost_unknown_because or verdict.source_detail}"
    said = "cost more than it saved" if verdict.cost_more_than_saved else "paid"
    if verdict.source in ("trial", "calibration"):
        by = "this job's trial" if verdict.source == "trial" else "a calibration"
        return f"speculation {said}, by {by}: {verdict.source_detail}"
    return f"speculation {said}: {verdict.flags[0] if verdict.flags else 'nothing measured it against off'}"
