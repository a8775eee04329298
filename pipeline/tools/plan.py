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
import posixpath
import sys
import tempfile
from collections import Counter
from typing import Optional

from pipeline.cluster import check_schedulable
from pipeline.cluster.startup import local_ray_cpus
from pipeline.commit.lease import OutputLease
from pipeline.inputs.units import WorkUnit
from pipeline.config import JobConfig, load_config
from pipeline.inputs import InputReport
from pipeline.inputs.openai_batch import CONVERTED
from pipeline.inputs.prefixes import grouped_unit_count
from pipeline.job.plan import REFUSALS, JobPlan, RunOptions, plan_job, results_fingerprint
from pipeline.job.preflight import check_before_engines, first_row_text
from pipeline.speculation.drafter_check import check_drafter
from pipeline.speculation.probe import refusal, rejudged
from pipeline.storage import Storage
from pipeline.tools.estimates import estimate_cost, estimate_tokens
from schemas.plan import DryRunPlan, PlanCheck, PlanFile, PlanGrouping, PlanInputs, PlanUnits

FILES_SHOWN = 10
PROMPT_LINES_SHOWN = 12


def dry_run(config_uri: str, output_uri: Optional[str] = None, flags: RunOptions = RunOptions(), as_json: bool = False) -> int:
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
    plan.inputs = _inputs_section(config, storage, inputs, scratch)
    plan.inputs.duplicate_ids = len(job.ids.duplicates)
    _files_and_units(
        plan, config, storage, scratch, job.units, job.committed, job.again, todo, previous.job_id if previous else None
    )
    plan.units.head = job.head
    if config.rows.templated:
        _first_prompts(plan, config, storage, inputs)
    if restart and location.has_manifest():
        plan.warnings.append(
            f"--restart: the run would delete what {config.output_uri} holds ({len(location.committed_units()):,} committed "
            "units) before it starts"
        )
    # 4. the checks before the engines, when an engine would start
    with _Step(plan, "preflight") as step:
        if todo:
            check_before_engines(config, inputs, storage)
            step.done("pass", "the tokenizer loads, the first row of each input kind renders, max_tokens fits in "
                              "max_model_len" + (", the response_format compiles" if config.sampling.response_format else ""))
        else:
            step.done("skipped", "nothing left to run: the run starts no engine and skips it")
    if config.speculative.enabled:
        with _Step(plan, "drafter") as step:
            if todo:
                report = check_drafter(
                    config.model.path, config.speculative.drafter, config.speculative.checks_as_warnings, storage=storage
                )
                tally = Counter(c.status for c in report.checks)
                summary = ", ".join(f"{n} {s}" for s, n in sorted(tally.items()))
                step.done("warn" if report.warnings else "pass",
                          f"static checks (shapes, vocab, declared target): {summary}; target {report.target_identity}")
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
            f"{rows_above} of {plan.tokens.sample_rows} sampled rows ask for more than sampling.max_tokens x sampling.n "
            "(their own max_tokens or n): the output bound counts rows by the sample's mean, an estimate for rows not sampled"
        )
    plan.grouping = _grouping_section(config, job, plan.tokens.prompt_tokens)
    plan.cost, plan.cost_note = estimate_cost(config, location, plan.tokens.output_tokens_upper_bound_left, plan.warnings)


# ---------------------------------------------------------------- the sections


def _inputs_section(config: JobConfig, storage: Storage, inputs: InputReport, scratch: str) -> PlanInputs:
    rows = Counter()
    for f in inputs.files:
        rows[f.text_column] += f.rows
    converted = checked = None
    if config.input_format == "openai_batch":
        checked = len({_source_base(f.uri) for f in inputs.files if _in_scratch(f.uri, scratch)})
        converted = len({_source_base(f.uri) for f in inputs.files if not _in_scratch(f.uri, scratch)})
    return PlanInputs(
        input_format=config.input_format, files=len(inputs.files), footers_read=inputs.footers_read, rows=inputs.rows,
        prompt_rows=rows["prompt"], chat_rows=rows["messages"], converted_files=converted, conversions_checked=checked,
        file_list=[],
    )


def _in_scratch(uri: str, scratch: str) -> bool:
    return uri.startswith(scratch.rstrip("/") + "/")


def _source_base(uri: str) -> str:
    return posixpath.basename(uri).split(".", 1)[0]


def _shown_uri(config: JobConfig, storage: Storage, uri: str, scratch: str) -> str:
    """A file converted into the scratch folder, named where the run will convert it."""
    return storage.join(config.output_uri, CONVERTED, posixpath.basename(uri)) if _in_scratch(uri, scratch) else uri


def _files_and_units(
    plan: DryRunPlan, config: JobConfig, storage: Storage, scratch: str, units: list[WorkUnit], committed: set[str],
    again: set[str], todo: list[WorkUnit], rerun_of: Optional[str],
) -> None:
    per_file = Counter(u.source for u in units)
    file_rows: dict[str, tuple[int, str]] = {}
    for u in units:
        rows, kind = file_rows.get(u.source, (0, u.text_column))
        file_rows[u.source] = (rows + u.rows, kind)
    plan.inputs.file_list = [
        PlanFile(uri=_shown_uri(config, storage, uri, scratch), rows=rows, text_column=kind, units=per_file[uri])
        for uri, (rows, kind) in file_rows.items()
    ]
    ids = {u.unit_id for u in units}
    plan.units = PlanUnits(
        rows_per_unit=config.resources.rows_per_unit, units=len(units), committed=len(committed & ids),
        again=len(again & ids), left=len(todo), rows_left=sum(u.rows for u in todo), rerun_of=rerun_of,
    )


def _first_prompts(plan: DryRunPlan, config: JobConfig, storage: Storage, inputs: InputReport) -> None:
    """The first row of each file shown, rendered by the job's template (and chat template)."""
    from pipeline.inputs.shape import RowShape
    from pipeline.stages.preprocess import load_tokenizer
    from pipeline.storage.model_cache import localize

    shape, shown = RowShape.for_job(config), {f.uri: f for f in plan.inputs.file_list[:FILES_SHOWN]}
    tokenizer = None
    for file in (f for f in inputs.files if f.uri in shown):
        value = first_row_text(storage, file, shape)
        if value is not None and file.text_column == "messages":
            tokenizer = tokenizer or load_tokenizer(localize(config.model.tokenizer or config.model.path, storage, weights=False))
            value = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True, **config.chat.template_kwargs)
        shown[file.uri].first_prompt = value


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
        message = (f"not run: the probe generates up to {rows} rows with the drafter on the job's first engine, which a dry "
                   "run does not start; the real run measures them before any unit commits and refuses a drafter below "
                   f"{config.speculative.probe.min_mean_acceptance_length} mean acceptance length")
    plan.checks.append(PlanCheck(name="drafter_probe", status="skipped", message=message))


def _cluster_check(step: _Step, config: JobConfig, todo: list[WorkUnit], address: Optional[str]) -> None:
    address = address or os.environ.get("RAY_ADDRESS")
    resources = config.resources
    if not todo:
        step.done("skipped", "nothing left to run: the run starts no Ray and skips them")
    elif address:
        step.done("skipped", f"not run: schedulability and shared paths need the nodes of the Ray cluster at {address}, "
                             "and a dry run joins no Ray cluster")
    elif resources.gpus_per_replica or resources.resources_per_replica:
        step.done("skipped", "not run: the run's own local Ray would offer this machine's GPUs and resources, which only "
                             "Ray detects, and a dry run starts no Ray")
    else:
        cpus = float(local_ray_cpus())
        check_schedulable(config, [{"CPU": cpus}], [])
        step.done("pass", f"the graph fits on the run's own local Ray ({cpus:g} logical CPUs on this machine's "
                          f"{os.cpu_count()} cores); one node, so no shared paths are needed")


# ---------------------------------------------------------------- the text


def _grouping_section(config: JobConfig, job: JobPlan, prompt_tokens: int) -> PlanGrouping:
    grouping = job.grouping
    record, sharing = grouping.record, grouping.record.sharing
    saved = None
    if sharing and sharing.prompt_chars:
        gain = max(0, sharing.shared_chars_grouped - sharing.shared_chars_in_input_order)
        saved = round(prompt_tokens * gain / sharing.prompt_chars)
    units = len(job.units)
    if grouping.copy_to_write:
        units = grouped_unit_count(grouping.kinds, config.resources.rows_per_unit)
    return PlanGrouping(decision=record, units=units, copy_written=bool(record.files), prefill_tokens_saved=saved)


def _grouping_lines(g: PlanGrouping) -> list[str]:
    d, s = g.decision, g.decision.sharing
    lines = [f"  prefixes  {'grouped' if d.grouped else 'not grouped'} (resources.group_prefixes: {d.setting}): {d.reason}"]
    if s:
        share = lambda chars: f"{chars / s.prompt_chars:.0%}" if s.prompt_chars else "0%"  # noqa: E731
        lines.append(f"            {s.prefix_groups:,} shared prefixes over {s.rows_in_groups:,} of {s.rows:,} rows; sorted by prefix, "
                     f"rows share at least {share(s.shared_chars_grouped)} of the prompt text, "
                     f"{share(s.shared_chars_in_input_order)} in the input's order{f' ({s.job_common_chars:,} characters every row shares)' if s.job_common_chars else ''}")
    if g.prefill_tokens_saved is not None and d.grouped:
        lines.append(f"            prefill it expects to save: at least ~{g.prefill_tokens_saved:,} prompt tokens, when the engines' KV "
                     "cache holds a fraction of the job's prefixes (as on GPUs with large models)")
    if d.grouped:
        where = "planned over the grouped copy" + ("" if g.copy_written else ", which the run writes first under the output's _grouped/")
        lines.append(f"            {g.units:,} units {where}")
    return lines


def format_plan(plan: DryRunPlan) -> str:
    lines = []
    if plan.accepted:
        lines.append("specbatch run --dry-run: the job would be accepted (exit 0). Nothing was started or written.")
    else:
        lines.append("specbatch run --dry-run: the job would be REFUSED (exit 2); the reason is below. Nothing was "
                     "started or written.")
    lines.append(f"  config    {plan.config_uri}")
    if plan.output_uri:
        lines.append(f"  output    {plan.output_uri}")
    i = plan.inputs
    if i:
        kind = "OpenAI batch files, converted to " if i.input_format == "openai_batch" else ""
        lines.append(f"  input     {kind}{i.files:,} Parquet file{'s' if i.files != 1 else ''}, {i.rows:,} rows: "
                     f"{i.prompt_rows:,} prompt, {i.chat_rows:,} chat (messages); {i.footers_read:,} footers read")
        if i.duplicate_ids:
            lines.append(f"            {i.duplicate_ids:,} rows repeat an earlier row's id: each would be its row's error "
                         "(duplicate_id), the earlier row generated")
        if i.input_format == "openai_batch":
            lines.append(f"            {i.converted_files} JSONL file(s) already converted under the output's _inputs/, "
                         f"{i.conversions_checked} not yet: checked line by line in a temporary folder (deleted); "
                         "the run converts them")
        for f in i.file_list[:FILES_SHOWN]:
            lines.append(f"            {f.uri}  {f.rows:,} rows ({f.text_column}), {f.units:,} unit{'s' if f.units != 1 else ''}")
            if f.first_prompt is not None:
                lines += [f"              first prompt | {line}" for line in f.first_prompt.splitlines()[:PROMPT_LINES_SHOWN]]
        if len(i.file_list) > FILES_SHOWN:
            lines.append(f"            ... and {len(i.file_list) - FILES_SHOWN:,} more files")
    u = plan.units
    if u:
        lines.append(f"  units     {u.units:,} of up to {u.rows_per_unit:,} rows")
        if u.head:
            lines.append(f"            the first {u.head.rows:,} rows in units of {u.head.rows_per_unit:,} (the job's sequences "
                         "at once), which the speculation trial measures")
        rerun = f"rerun of job {u.rerun_of}: " if u.rerun_of else ""
        again = f" ({u.again:,} of them again, for their error rows)" if u.again else ""
        lines.append(f"            {rerun}{u.committed:,} committed, {u.left:,} left to run{again}, {u.rows_left:,} rows")
    t = plan.tokens
    if t:
        how = ("counted over every row" if t.exact else
               f"estimated from {t.sample_rows:,} sampled rows in {t.sample_row_groups} row groups, seed {t.sample_seed}")
        kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(t.prompt_tokens_by_kind.items()))
        lines.append(f"  tokens    prompt ~{t.prompt_tokens:,} ({kinds}; {how}, as the preprocess stage tokenizes); "
                     f"left to run ~{t.prompt_tokens_left:,}")
        bound = ("summed over every row" if t.exact else
                 "estimated: the sample's mean per row x the rows")
        lines.append(f"            output at most {t.output_tokens_upper_bound:,} (each row's max_tokens x n, {bound}; "
                     f"rows may stop earlier); left to run at most {t.output_tokens_upper_bound_left:,}")
        if t.sample_error_rows:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(t.sample_error_kinds.items()))
            lines.append(f"            {t.sample_error_rows} of {t.sample_rows} sampled rows would go to errors/ ({kinds})")
    if plan.grouping:
        lines += _grouping_lines(plan.grouping)
    if plan.checks:
        lines.append("  checks")
        for c in plan.checks:
            lines.append(f"            {c.name:<14}{c.status:<8}{c.message.splitlines()[0] if c.status == 'fail' else c.message}")
    c = plan.cost
    if c:
        price = (f", {c.currency} {_figure(c.cost)} at {c.price_per_gpu_hour:g} per GPU-hour ({c.price_source})"
                 if c.cost is not None else ", no price for the accelerator")
        at = f"schedule {c.schedule}" if c.schedule else (f"depth {c.depth}" if c.depth else "speculation off")
        lines.append(f"  cost      at most {_figure(c.gpu_hours)} GPU-hours{price}; wall time at most "
                     f"{_figure(c.wall_hours)} h at the pool's minimum replicas")
        lines.append(f"            from {c.calibration_uri} ({c.measured_at}): {c.tokens_per_second_per_gpu:,.1f} generated "
                     f"tok/s per GPU at {at}, {c.concurrency} sequences at once; {c.output_tokens:,} output tokens at most")
    elif plan.cost_note:
        lines.append(f"  cost      {plan.cost_note}")
    for w in plan.warnings:
        lines.append(f"  warning   {w}")
    if plan.refused:
        lines.append("  refused   (the message follows, as the real run gives it)")
    return "\n".join(lines) + "\n"


def _figure(x: float) -> str:
    """Hours and money: whole above 100, cents above 1, three significant digits below."""
    return f"{x:,.0f}" if x >= 100 else f"{x:,.2f}" if x >= 1 else f"{x:.3g}"
