"""What jobs cost, from what they wrote (each output's `_job.json` and committed `stats/` rows):
per job and overall, GPU-hours (billed: replicas x GPUs x wall time; busy: engine time),
tokens, cost per million generated / total tokens, tokens/s per GPU, acceptance; and, for jobs
with speculation on and off that did the same work (the same target model, accelerator kind,
prompts and sampling), the saving or loss; jobs that differ in prompts or sampling are not
compared, and the report says why. `specbatch report` (pipeline/tools/report.py) renders them.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pipeline.commit.outputs import ManifestInvalid, OutputLocation
from pipeline.config import ACCEPTANCE_FLOOR
from pipeline.speculation.calibrations import read_any_calibration
from pipeline.speculation.policy import verdict_text
from pipeline.stages.stats import Acceptance, prefix_cache_hit_rate, speculated
from pipeline.stages.stats import busy_seconds as engine_busy_seconds
from pipeline.storage import Storage
from pipeline.tools.prices import Prices
from schemas import JobManifest, TrialVerdict, utc_timestamp
from schemas.report import CalibrationReport, CostReport, JobFigures, ReportTotals, SpeculationComparison

MILLION = 1_000_000


@dataclass
class JobData:
    uri: str
    manifest: JobManifest
    stats: list[dict[str, Any]]
    calibration: Optional[CalibrationReport] = None  # the calibration the job's verdict rests on, when one does


def read_job(storage: Storage, uri: str) -> JobData:
    location = OutputLocation(storage, uri)
    try:
        manifest = location.job_manifest(same_layout=False)
    except ManifestInvalid as exc:
        raise ReportError(str(exc)) from None
    if manifest is None:
        raise ReportError(f"{uri}: no _job.json (not a specbatch job output)")
    stats = sorted(location.read_table("stats").to_pylist(), key=lambda r: r["started_at"])
    verdict = manifest.speculation
    calibration = (
        read_any_calibration(storage, verdict.calibration_uri) if verdict and verdict.calibration_uri else None
    )
    return JobData(uri=location.uri, manifest=manifest, stats=stats, calibration=calibration)


class ReportError(ValueError):
    pass


def busy_seconds(stats: Sequence[dict[str, Any]]) -> float:
    """Engine-busy seconds summed over actors (pipeline/stages/stats.busy_seconds)."""
    return engine_busy_seconds((row["actor_id"], row["started_at"], row["engine_seconds"]) for row in stats)


def per_million(cost: Optional[float], tokens: int) -> Optional[float]:
    return cost / tokens * MILLION if cost is not None and tokens else None


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def inputs_sha256(manifest: JobManifest) -> str:
    """The prompts a job read, by each input file's name, size and rows: a copy of the same files
    elsewhere is the same input, a file rewritten with other prompts is not."""
    return _sha256(sorted((posixpath.basename(f.uri.rstrip("/")), f.size, f.rows) for f in manifest.input_files))


def ran_by_unit(stats: Sequence[dict[str, Any]]) -> Optional[str]:
    """The setting each unit ran with, by rows: 'k=3', or 'k=3 for 600 rows, off for 1,800'."""
    rows: dict[str, int] = {}
    for r in stats:
        if not r["speculative"]:
            label = "off"
        else:
            label = f"schedule {r['depth_schedule']}" if r.get("depth_schedule") else f"k={r['num_speculative_tokens']}"
        rows[label] = rows.get(label, 0) + r["rows"]
    if len(rows) < 2:
        return next(iter(rows), None)
    return ", ".join(f"{label} for {n:,} rows" for label, n in rows.items())


def job_figures(job: JobData, prices: Prices) -> JobFigures:
    m, stats = job.manifest, job.stats
    resources, spec = m.config.get("resources", {}), m.config.get("speculative", {})
    replicas = resources.get("replicas", 1)
    if isinstance(replicas, dict):  # an autoscaling pool is billed for the engines that ran, at most its max
        replicas = max(1, min(replicas["max"], len({r["actor_id"] for r in stats})))
    units, price = prices.billing(m.accelerator, float(resources.get("gpus_per_replica", 0)))
    drafting = [r for r in stats if speculated(r["speculative"], r["num_drafts"], r.get("depth_schedule"))]
    acceptance = sum(
        (
            Acceptance(r["num_drafts"], r["draft_tokens"], r["accepted_tokens"], list(r["accepted_per_position"]))
            for r in drafting
        ),
        Acceptance(),
    )
    prompt_tokens = sum(r["prompt_tokens"] for r in stats)
    cached_prompt_tokens = sum(r.get("cached_prompt_tokens") or 0 for r in stats)  # null in an older stats file
    generated_tokens = sum(r["generated_tokens"] for r in stats)
    busy = busy_seconds(stats) if stats else 0.0
    # the attempt that started engines: a rerun with nothing left to do starts none
    start = next((a.start for a in reversed(m.attempts) if a.start and a.start.engine_starts), None)
    gpu_hours = replicas * units * m.totals.wall_seconds / 3600
    busy_gpu_hours = units * busy / 3600
    cost = gpu_hours * price if price is not None else None
    speculative = bool(spec.get("enabled", any(r["speculative"] for r in stats)))
    flags = list(m.speculation.flags) if m.speculation else []
    mal = acceptance.mean_acceptance_length
    if not m.speculation and mal is not None and mal < ACCEPTANCE_FLOOR:  # a job written before verdicts were
        flags.append(
            f"mean acceptance length {mal:.2f} is below the floor {ACCEPTANCE_FLOOR}: speculation cost more than it "
            "saved"
        )
    return JobFigures(
        job_id=m.job_id,
        output_uri=job.uri,
        status=m.status,
        started_at=m.started_at,
        model=m.model.path,
        model_sha256=m.model.config_sha256,
        inputs_sha256=inputs_sha256(m),
        sampling_sha256=_sha256(m.config.get("sampling", {})),
        drafter=m.drafter.path if m.drafter else None,
        accelerator=m.accelerator,
        replicas=replicas,
        gpus_per_replica=units,
        cpu_only=not float(resources.get("gpus_per_replica", 0)),
        speculative=speculative,
        num_speculative_tokens=int(spec.get("num_speculative_tokens", 0)) if speculative else 0,
        ran=ran_by_unit(stats),
        units=len(stats),
        speculative_units=sum(1 for r in stats if r["speculative"]),
        input_rows=m.totals.input_rows,
        output_rows=sum(r["output_rows"] for r in stats),
        failed_rows=sum(r["error_rows"] for r in stats),
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_prompt_tokens,
        computed_prompt_tokens=prompt_tokens - cached_prompt_tokens,
        prefix_cache_hit_rate=prefix_cache_hit_rate(cached_prompt_tokens, prompt_tokens),
        generated_tokens=generated_tokens,
        wall_seconds=m.totals.wall_seconds,
        busy_seconds=busy,
        gpu_hours=gpu_hours,
        busy_gpu_hours=busy_gpu_hours,
        utilization=_ratio(busy_gpu_hours, gpu_hours),
        price_per_gpu_hour=price,
        price_source=prices.source(m.accelerator, float(resources.get("gpus_per_replica", 0)))
        if price is not None
        else None,
        cost=cost,
        cost_per_million_generated_tokens=per_million(cost, generated_tokens),
        cost_per_million_total_tokens=per_million(cost, generated_tokens + prompt_tokens),
        tokens_per_second_per_gpu=_ratio(generated_tokens, gpu_hours * 3600),
        busy_tokens_per_second_per_gpu=_ratio(generated_tokens, busy_gpu_hours * 3600),
        engine_tokens_per_second=_ratio(generated_tokens, busy),
        wall_tokens_per_second=_ratio(generated_tokens, m.totals.wall_seconds),
        to_first_commit_seconds=start.to_first_commit_seconds if start else None,
        engine_starts=len(start.engine_starts) if start else 0,
        start_phases=start.phases if start else [],
        **acceptance.summary(),
        accepted_per_position=acceptance.rate_per_position,
        tokens_per_target_pass=acceptance.tokens_per_target_pass(
            sum(r["generated_tokens"] for r in drafting), sum(r["samples"] for r in drafting)
        )
        if all("samples" in r for r in stats)
        else None,
        speculation_flags=flags,
        speculation_verdict=verdict_text(m.speculation) if m.speculation else None,
        **_trial_figures(m.trial, price, units),
    )


def _trial_figures(trial: Optional[TrialVerdict], price: Optional[float], units: float) -> dict[str, Any]:
    """The job's own speculation trial: each setting's engine rate and what a generated million costs at it."""
    if trial is None:
        return {}
    on = trial.speculation.tokens_per_second if trial.speculation else None
    off = trial.off.tokens_per_second if trial.off else None

    def per_million_at(rate: Optional[float]) -> Optional[float]:
        return price * units / (rate * 3600) * MILLION if price is not None and rate else None

    return dict(
        trial=trial.reason,
        trial_outcome=trial.outcome,
        trial_concurrency=trial.concurrency,
        trial_tokens_per_second_on=on,
        trial_tokens_per_second_off=off,
        trial_cost_per_million_on=per_million_at(on),
        trial_cost_per_million_off=per_million_at(off),
    )


def totals(jobs: Sequence[JobFigures]) -> ReportTotals:
    cost = None if any(j.cost is None for j in jobs) else sum(j.cost for j in jobs)
    generated = sum(j.generated_tokens for j in jobs)
    prompt = sum(j.prompt_tokens for j in jobs)
    gpu_hours = sum(j.gpu_hours for j in jobs)
    acceptance = Acceptance(
        sum(j.num_drafts for j in jobs), sum(j.draft_tokens for j in jobs), sum(j.accepted_tokens for j in jobs)
    )
    return ReportTotals(
        jobs=len(jobs),
        input_rows=sum(j.input_rows for j in jobs),
        output_rows=sum(j.output_rows for j in jobs),
        failed_rows=sum(j.failed_rows for j in jobs),
        prompt_tokens=prompt,
        generated_tokens=generated,
        gpu_hours=gpu_hours,
        busy_gpu_hours=sum(j.busy_gpu_hours for j in jobs),
        cost=cost,
        cost_per_million_generated_tokens=per_million(cost, generated),
        cost_per_million_total_tokens=per_million(cost, generated + prompt),
        tokens_per_second_per_gpu=_ratio(generated, gpu_hours * 3600),
        **acceptance.summary(),
    )


def _comparable(jobs: Sequence[JobFigures]) -> dict[tuple[str, ...], list[JobFigures]]:
    """Jobs that ran as configured, grouped by what must be the same for their costs to compare:
    target model, accelerator kind, prompts and sampling."""
    groups: dict[tuple[str, ...], list[JobFigures]] = defaultdict(list)
    for job in jobs:
        ran_as_configured = job.speculative_units == (job.units if job.speculative else 0)
        if job.cost is not None and job.generated_tokens and ran_as_configured:
            groups[(job.model_sha256, job.accelerator, job.inputs_sha256, job.sampling_sha256)].append(job)
    return groups


def speculation_comparisons(jobs: Sequence[JobFigures]) -> list[SpeculationComparison]:
    """Per group of comparable jobs: each depth's pooled cost per million generated tokens
    against the pooled cost of the jobs with speculation off."""
    comparisons = []
    for (sha, accelerator, _, _), members in _comparable(jobs).items():
        off = [j for j in members if not j.speculative]
        if not off:
            continue
        off_total = totals(off)
        for depth in sorted({j.num_speculative_tokens for j in members if j.speculative}):
            on_total = totals([j for j in members if j.speculative and j.num_speculative_tokens == depth])
            on_cost, off_cost = on_total.cost_per_million_generated_tokens, off_total.cost_per_million_generated_tokens
            comparisons.append(
                SpeculationComparison(
                    model=members[0].model,
                    model_sha256=sha,
                    accelerator=accelerator,
                    num_speculative_tokens=depth,
                    jobs_on=[j.job_id for j in members if j.speculative and j.num_speculative_tokens == depth],
                    jobs_off=[j.job_id for j in off],
                    cost_per_million_generated_tokens_on=on_cost,
                    cost_per_million_generated_tokens_off=off_cost,
                    saving_per_million_generated_tokens=off_cost - on_cost,
                    saving_fraction=(off_cost - on_cost) / off_cost,
                    tokens_per_second_per_gpu_on=on_total.tokens_per_second_per_gpu,
                    tokens_per_second_per_gpu_off=off_total.tokens_per_second_per_gpu,
                )
            )
    return comparisons


def not_compared(jobs: Sequence[JobFigures]) -> list[str]:
    """Why a job with speculation on is not compared with the jobs with it off on its model and
    accelerator: they read other prompts, or sampled otherwise."""
    groups = _comparable(jobs)
    reasons = []
    for (sha, accelerator, inputs, sampling), members in groups.items():
        if not any(j.speculative for j in members) or any(not j.speculative for j in members):
            continue
        off = [
            j
            for (s, a, _, _), others in groups.items()
            if (s, a) == (sha, accelerator)
            for j in others
            if not j.speculative
        ]
        if not off:
            continue
        for job in (j for j in members if j.speculative):
            for other in off:
                differ = [
                    what
                    for what, same in (
                        ("prompts (input files)", other.inputs_sha256 == inputs),
                        ("sampling", other.sampling_sha256 == sampling),
                    )
                    if not same
                ]
                reasons.append(
                    f"{job.job_id} (k={job.num_speculative_tokens}) is not compared with {other.job_id} "
                    f"(speculation off): their {' and '.join(differ)} differ, so their costs do not compare"
                )
    return reasons


def build_report(jobs: Sequence[JobData], prices: Prices) -> CostReport:
    figures = [job_figures(job, prices) for job in jobs]
    warnings = []
    for job, f in zip(jobs, figures):
        if f.price_per_gpu_hour is None:
            warnings.append(
                f"{f.job_id}: "
                + prices.missing_price_message(
                    f.accelerator, job.manifest.config.get("resources", {}).get("gpus_per_replica", 0)
                )
            )
        if f.status != "succeeded":
            warnings.append(f"{f.job_id}: status {f.status!r}; figures cover the units committed so far")
        if not job.stats:
            warnings.append(f"{f.job_id}: no committed stats rows")
        if f.speculative and f.speculative_units < f.units:
            warnings.append(
                f"{f.job_id}: the drafter ran for {f.speculative_units} of {f.units} units (turned off by the "
                "acceptance guard); left out of the speculation on/off comparison"
            )
    comparisons = speculation_comparisons(figures)
    warnings.extend(not_compared(figures))
    for c in comparisons:
        if c.saving_fraction < 0:
            for f in figures:
                if f.job_id in c.jobs_on:
                    f.speculation_flags.append(
                        f"speculation k={c.num_speculative_tokens} cost {-c.saving_fraction:.1%} more per million "
                        "generated tokens than the jobs with it off on the same model, accelerator, prompts and "
                        "sampling"
                    )
    return CostReport(
        generated_at=utc_timestamp(),
        currency=prices.currency,
        prices=prices.model_dump(),
        output_uris=[j.uri for j in jobs],
        jobs=figures,
        overall=totals(figures),
        speculation=comparisons,
        warnings=warnings,
    )
