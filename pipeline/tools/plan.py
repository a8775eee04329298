"""`specbatch run CONFIG --dry-run [--json]`: everything the run does before its engines, and
nothing after. No vLLM engine, no engine actor, no Ray (neither started nor joined), and nothing
written to the output location: no lease, no manifest, no converted input. Exit 0 when the real
run would be accepted, 2 when it would be refused, with the real run's message.

In the real run's order (pipeline/job/runner.run_job), each step calling the run's own code:

 1. the output location: a file is refused, a `_job.json` of another layout is refused; the
    models' fingerprints; on a rerun, changed settings or input files are refused;
 2. the input check: footers only (pipeline/inputs/check.py). For `input_format: openai_batch`, files
    already converted under OUTPUT_URI/_inputs are taken as they are, and files not converted
    yet are converted into a temporary local folder, deleted at the end: every line is checked
    as the real run checks it, and the rows and units are exact. (It costs what the real
    conversion costs: one read of each such JSONL file, and its converted size on local disk.)
 3. the plan: work units (pipeline/inputs/units.plan_units) less those committed (one `_commits/`
    listing) plus those the run would redo for their error rows;
 4. when any unit is left: the preflight (pipeline/job/preflight.check_before_engines) and the
    static drafter check (pipeline/speculation/drafter_check.check_drafter). The drafter probe generates
    with an engine: it is not run, and the plan says so;
 5. the lease, read and not taken (pipeline/commit/lease.OutputLease.check);
 6. the cluster: with a Ray address (--address, RAY_ADDRESS) the checks need that cluster's
    nodes and are skipped, said so; without one, a job whose engines need only CPUs is packed
    onto the local Ray the run would start (this machine's CPUs, at least 4: startup.local_ray_cpus).

Then the estimates, which refuse nothing (pipeline/tools/estimates.py).

Requests at 10M prompts in 10k Parquet files on S3, 4,096 rows per unit (2,442 units):
  config 1 GET; output location: 1 HEAD (a file?), 1 HEAD + 1 GET (_job.json, on a rerun);
  models: none for local folders, 1 LIST each in object storage (plus the run's own copy of
  the config and tokenizer files, and of the drafter, into the model cache when not cached yet);
  input: 10 LISTs and 10k ranged GETs of footers, 16 at a time (0 GETs on a rerun whose files
  _job.json recorded): the real run's check; units: 3 LISTs of `_commits/`, and on a rerun the
  `stats/` listing and one GET per attempt's stats file; preflight: a footer and a column chunk
  of the first file of each kind; lease: 1 GET; token sample: at most 16 footers and 16 row
  groups' column chunks (id, text, sampling columns; never `metadata`), or every row of an
  input kind that has fewer rows than its share of the sample; calibration: 1 GET.
  About 10.1k requests, the footers being nearly all of them, as in the real run's check; the
  driver holds one InputFile per file and one WorkUnit per unit, nothing per row.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from typing import Optional

from pipeline.cluster import check_schedulable
from pipeline.cluster.startup import local_ray_cpus
from pipeline.commit.lease import OutputLease
from pipeline.inputs.units import WorkUnit
from pipeline.config import JobConfig, load_config
from pipeline.job.plan import REFUSALS, JobPlan, RunOptions, plan_job, results_fingerprint
from pipeline.job.preflight import check_before_engines
from pipeline.speculation.drafter_check import check_drafter
from pipeline.speculation.probe import refusal, rejudged
from pipeline.tools.estimates import estimate_cost, estimate_tokens
from pipeline.speculation.calibrations import JobCalibration, calibrated_setting, job_calibration
from pipeline.speculation.policy import job_costs, planned_decision, verdict_text
from pipeline.speculation.trial import too_few_units
from pipeline.tools.plan_sections import files_and_units, first_prompts, grouping_section, inputs_section
from pipeline.tools.plan_text import format_plan
from schemas.plan import DryRunPlan, PlanCheck


def dry_run(
    config_uri: str, output_uri: Optional[str] = None, flags: RunOptions = RunOptions(), as_json: bool = False
) -> int:
    """Print the plan (text, or one JSON object with `as_json`) and return 0 when the run with
    `flags` would be accepted. A refusal prints the plan so far and raises the real run's exception."""
    out = sys.stdout
    plan = DryRunPlan(accepted=False, config_uri=config_uri)
    try:
        config = load_config(config_uri, {"output_uri": output_uri} if output_uri else None)
        plan.output_uri = config.output_uri
        with tempfile.TemporaryDirectory(prefix="specbatch-dry-run-") as scratch:
            make_plan(config, plan, scratch, flags)
    except REFUSALS as exc:
        plan.refused = str(exc)
        out.write(plan.model_dump_json(indent=2) + "\n" if as_json else format_plan(plan))
        raise
    plan.accepted = True
    out.write(plan.model_dump_json(indent=2) + "\n" if as_json else format_plan(plan))
    return 0


class _Step:
    """Records a check in the plan: a refusal as `fail` (then re-raised), else what `done` says."""

    def __init__(self, plan: DryRunPlan, name: str):
        self.plan, self.name = plan, name

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and isinstance(exc, REFUSALS):
            self.plan.checks.append(PlanCheck(name=self.name, status="fail", message=str(exc)))
        return False

    def done(self, status: str, message: str) -> None:
        self.plan.checks.append(PlanCheck(name=self.name, status=status, message=message))


def make_plan(config: JobConfig, plan: DryRunPlan, scratch: str, flags: RunOptions = RunOptions()) -> None:
    restart, take_over, retry_errors, address = flags.restart, flags.take_over, flags.retry_errors, flags.address
    # 1-3. the output location and the models, the input check (OpenAI batch files not
    # converted yet are converted into `scratch`), the units: what run_job plans, read-only
    job = plan_job(config, restart=restart, retry_errors=retry_errors, scratch=scratch)
    location, previous, inputs, todo = job.location, job.previous, job.inputs, job.todo
    storage = location.storage
    plan.inputs = inputs_section(config, storage, inputs, scratch)
    plan.inputs.duplicate_ids = len(job.ids.duplicates)
    files_and_units(
        plan, config, storage, scratch, job.units, job.committed, job.again, todo, previous.job_id if previous else None
    )
    plan.units.head = job.head
    if config.rows.templated:
        first_prompts(plan, config, storage, inputs)
    if restart and location.has_manifest():
        plan.warnings.append(
            f"--restart: the run would delete what {config.output_uri} holds ({len(location.committed_units()):,} "
            "committed units) before it starts"
        )
    # 4. the checks before the engines, when an engine would start
    with _Step(plan, "preflight") as step:
        if todo:
            check_before_engines(config, inputs, storage)
            step.done(
                "pass",
                "the tokenizer loads, the first row of each input kind renders, max_tokens fits in "
                "max_model_len" + (", the response_format compiles" if config.sampling.response_format else ""),
            )
        else:
            step.done("skipped", "nothing left to run: the run starts no engine and skips it")
    if config.speculative.enabled:
        with _Step(plan, "drafter") as step:
            if todo:
                report = check_drafter(
                    config.model.path,
                    config.speculative.drafter,
                    config.speculative.checks_as_warnings,
                    storage=storage,
                )
                tally = Counter(c.status for c in report.checks)
                summary = ", ".join(f"{n} {s}" for s, n in sorted(tally.items()))
                step.done(
                    "warn" if report.warnings else "pass",
                    f"static checks (shapes, vocab, declared target): {summary}; target {report.target_identity}",
                )
                plan.warnings += [f"drafter check downgraded to a warning: {w}" for w in report.warnings]
            else:
                step.done("skipped", "nothing left to run: the run starts no engine and skips it")
        _probe_check(plan, config, job)
    # 5. the lease: read, not taken
    with _Step(plan, "lease") as step:
        taken = OutputLease(location, config.lease, job.job_id, job.attempt_number).check(take_over)
        step.done("pass", taken or "no other run holds the output location")
    # 6. the cluster
    with _Step(plan, "cluster") as step:
        _cluster_check(step, config, todo, address)
    # the estimates
    plan.tokens = estimate_tokens(config, storage, inputs, todo)
    rows_above = plan.tokens.sample_rows_above_bound
    if rows_above and not plan.tokens.exact:
        plan.warnings.append(
            f"{rows_above} of {plan.tokens.sample_rows} sampled rows ask for more than sampling.max_tokens x "
            "sampling.n (their own max_tokens or n): the output bound counts rows by the sample's mean, an estimate "
            "for rows not sampled"
        )
    plan.grouping = grouping_section(config, job, plan.tokens.prompt_tokens)
    calibration = job_calibration(config, location, job.target, job.drafter)
    config = _speculation_section(plan, config, job, calibration)
    plan.cost, plan.cost_note = estimate_cost(
        config, calibration, plan.tokens.output_tokens_upper_bound_left, plan.warnings
    )


def _speculation_section(plan: DryRunPlan, config: JobConfig, job: JobPlan, calibration: JobCalibration) -> JobConfig:
    """The speculation decision the run would make, in the policy's words (with the setting
    speculative.depth_from: calibration gives it), and the config it would run."""
    calibrated = ""
    if config.speculative.enabled and config.speculative.depth_from == "calibration":
        config, said = calibrated_setting(config, calibration)
        calibrated = f"{said}; "
    previous = job.previous
    if not job.todo and previous is not None and previous.speculation is not None:
        plan.speculation = f"nothing left to run; the job's verdict stays: {verdict_text(previous.speculation)}"
        return config
    spec = config.speculative
    skipped = None
    if spec.enabled and spec.trial and job_costs(config, calibration) is None and job.todo:
        skipped = too_few_units(config, len(job.todo), sum(u.rows for u in job.todo), job.head)
    plan.speculation = calibrated + planned_decision(config, calibration, skipped)
    return config


def _probe_check(plan: DryRunPlan, config: JobConfig, job: JobPlan) -> None:
    """The probe as the run would take it: an earlier verdict of the same settings is kept
    (a refusal refuses again, as the run does), else it would run on the job's first engine."""
    rows, previous = config.speculative.probe.rows, job.previous
    same = previous is not None and previous.results_fingerprint == results_fingerprint(config, job.target, job.drafter)
    if rows and job.todo and same and previous.probe:
        with _Step(plan, "drafter_probe"):
            rejected = refusal(config, rejudged(config, previous.probe))
            if rejected:
                raise rejected
        message = "passed in an earlier attempt; the run keeps that result"
    elif not rows:
        message = "off (speculative.probe.rows: 0)"
    elif not job.todo:
        message = "nothing left to run: the run starts no engine and skips it"
    else:
        rows = min(rows, sum(unit.rows for unit in job.todo))  # a small input has fewer than probe.rows
        message = (
            f"not run: the probe generates up to {rows} rows with the drafter on the job's first engine, which a dry "
            "run does not start; the real run measures them before any unit commits and refuses a drafter below "
            f"{config.speculative.probe.min_mean_acceptance_length} mean acceptance length"
        )
    plan.checks.append(PlanCheck(name="drafter_probe", status="skipped", message=message))


def _cluster_check(step: _Step, config: JobConfig, todo: list[WorkUnit], address: Optional[str]) -> None:
    address = address or os.environ.get("RAY_ADDRESS")
    resources = config.resources
    if not todo:
        step.done("skipped", "nothing left to run: the run starts no Ray and skips them")
    elif address:
        step.done(
            "skipped",
            f"not run: schedulability and shared paths need the nodes of the Ray cluster at {address}, "
            "and a dry run joins no Ray cluster",
        )
    elif resources.gpus_per_replica or resources.resources_per_replica:
        step.done(
            "skipped",
            "not run: the run's own local Ray would offer this machine's GPUs and resources, which only "
            "Ray detects, and a dry run starts no Ray",
        )
    else:
        cpus = float(local_ray_cpus())
        check_schedulable(config, [{"CPU": cpus}], [])
        step.done(
            "pass",
            f"the graph fits on the run's own local Ray ({cpus:g} logical CPUs on this machine's "
            f"{os.cpu_count()} cores); one node, so no shared paths are needed",
        )
