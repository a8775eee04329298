"""The drafter probe: a few of the job's own rows through an engine with the drafter, at the
job's lengths, before any unit of the job is committed.

A drafter trained for another base model with the same shapes (Llama-3.1-70B's drafter on
Llama-3.3-70B) passes every static check in drafter_check.py, and public drafters rarely
declare their target. Only acceptance shows it: such a drafter is accepted almost never, so
speculation only costs. The probe measures the mean acceptance length at the configured depth
and refuses the drafter below `speculative.probe.min_mean_acceptance_length`, and below
`speculative.probe.min_tokens_per_target_pass`, which also counts the drafts the job's grammar
cut (vLLM's acceptance counters leave them out).

In a job the probe runs on the job's own first engine (pipeline/cluster/job_board.py, measured by
pipeline/graph/engine_stage.py): one engine start per replica. `specbatch check-drafter --probe` runs it
on an engine of its own (`probe_job_input`). Rows come from a few units spread over the input
(each read from its own row groups only) and are prepared exactly as the job prepares them.
With a depth schedule the rows run at the concurrency where the schedule drafts deepest, since
the schedule may draft nothing at all of them at once. Rows that end within 2k tokens of
max_model_len are left out (see `near_limit`).
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any, Optional, Sequence

from pipeline.inputs.units import WorkUnit, read_unit
from pipeline.config import JobConfig
from pipeline.inputs.shape import RowShape
from pipeline.speculation.drafter_read import DrafterMismatch
from pipeline.stages.stats import Acceptance
from pipeline.storage import Storage
from schemas import utc_timestamp
from schemas.drafter import ProbeResult

log = logging.getLogger(__name__)

PROBE_UNITS = 4  # units the probe's rows come from, spread over the input


class DrafterRejected(DrafterMismatch):
    """The probe measured acceptance below the floor."""

    def __init__(self, message: str, result: ProbeResult):
        super().__init__(message)
        self.result = result


def near_limit(row: dict[str, Any], config: JobConfig) -> bool:
    """The row ends within 2k tokens of max_model_len. There vLLM stops running the drafter for
    the whole batch and verifies filler drafts that are never accepted
    (docs/acceptance-near-length-limit.md): such a row says nothing about the drafter and pulls
    down the acceptance of the rows beside it."""
    k = config.speculative.num_speculative_tokens
    return (
        len(row["prompt_token_ids"]) + json.loads(row["sampling"])["max_tokens"] + 2 * k > config.engine.max_model_len
    )


def probe_rows(
    config: JobConfig, storage: Storage, units: Sequence[WorkUnit], n: int
) -> tuple[list[dict[str, Any]], int]:
    """Up to `n` rows prepared as the job prepares them, from up to PROBE_UNITS units spread
    evenly over `units`, none near the length limit; rows the job would refuse are left out.
    Returns (rows, near-limit rows met on the way)."""
    from pipeline.stages.preprocess import Preprocessor, RowError

    if not units or n < 1:
        return [], 0
    step = max(1, len(units) // PROBE_UNITS)
    chosen = list(units)[::step][:PROBE_UNITS]
    preprocessor = Preprocessor.for_job(config, storage)
    per_unit: list[list[dict[str, Any]]] = []
    skipped = 0
    for unit in chosen:
        usable = []
        for row in read_unit(storage, unit, RowShape.for_job(config)).to_pylist():
            if len(usable) == n:
                break
            try:
                prepared = {"id": row["id"], **preprocessor.prepare(row, unit.text_column)}
            except RowError:
                continue
            if near_limit(prepared, config):
                skipped += 1
                continue
            usable.append(prepared)
        per_unit.append(usable)
    rows = [row for turn in itertools.zip_longest(*per_unit) for row in turn if row is not None][:n]  # units in turn
    return rows, skipped


def probe_concurrency(config: JobConfig, rows: int) -> Optional[int]:
    """Sequences at once for the probe: all rows (None), or with a depth schedule the most at
    which it drafts at its largest depth."""
    spec = config.speculative
    if not spec.depth_schedule:
        return None
    deepest = max(k for _, _, k in spec.depth_schedule)
    hi = next(hi for _, hi, k in spec.depth_schedule if k == deepest)
    return None if hi >= rows else hi


def probe_result(config: JobConfig, measured: dict[str, Any], near_limit_rows: int = 0) -> ProbeResult:
    """The probe's verdict from one measurement (pipeline/speculation/measure.py's figures)."""
    spec, m = config.speculative, measured
    acceptance = Acceptance(m["num_drafts"], m["draft_tokens"], m["accepted_tokens"], list(m["accepted_per_position"]))
    mal = acceptance.mean_acceptance_length
    floor = spec.probe.min_mean_acceptance_length
    tpp = acceptance.tokens_per_target_pass(m["generated_tokens"], m.get("completions", m["prompts"]))
    return ProbeResult(
        measured_at=utc_timestamp(),
        rows=m["prompts"],
        near_limit_rows_skipped=near_limit_rows,
        num_speculative_tokens=spec.num_speculative_tokens,
        max_model_len=config.engine.max_model_len,
        prompt_tokens=m["prompt_tokens"],
        generated_tokens=m["generated_tokens"],
        seconds=m["seconds"],
        tokens_per_second=m["generated_tokens"] / m["seconds"] if m["seconds"] else 0.0,
        **acceptance.summary(),
        accepted_per_position=acceptance.rate_per_position,
        floor=floor,
        tokens_per_target_pass=tpp,
        tokens_per_target_floor=spec.probe.min_tokens_per_target_pass,
        passed=_passes(mal, tpp, floor, spec.probe.min_tokens_per_target_pass),
    )


def _passes(mal: Optional[float], tpp: Optional[float], floor: float, tpp_floor: Optional[float]) -> bool:
    """At or above both floors; tokens per target pass unknown (no decode pass, or a probe
    recorded before it was measured) is judged by the acceptance floor alone."""
    return mal is not None and mal >= floor and (tpp is None or tpp_floor is None or tpp >= tpp_floor)


def measure(config: JobConfig, rows: Sequence[dict[str, Any]], near_limit_rows: int = 0) -> ProbeResult:
    """Runs where the engine may run (a GPU worker): an engine of its own with the drafter at
    the configured depth, the rows generated once."""
    from pipeline.speculation.measure import measure_depth

    (m,) = measure_depth(config, config.speculative.num_speculative_tokens, rows)
    return probe_result(config, m, near_limit_rows)


def run_probe(config: JobConfig, rows: Sequence[dict[str, Any]], near_limit_rows: int = 0) -> ProbeResult:
    """The standalone probe (`specbatch check-drafter --probe`) on the cluster, in a Ray task
    with one replica's resources; its worker exits afterwards, freeing the engine's memory."""
    import ray

    from pipeline.cluster import engine_task_options
    from pipeline.stages.engine import prepare_process_env

    @ray.remote(max_calls=1, max_retries=0)
    def probe_task(config_json: dict, rows: list, near_limit_rows: int) -> dict:
        job = JobConfig.model_validate(config_json)
        prepare_process_env(job)
        return measure(job, rows, near_limit_rows).model_dump(mode="json")

    options = engine_task_options(config)
    group = getattr(options.get("scheduling_strategy"), "placement_group", None)
    try:
        result = ray.get(
            probe_task.options(**options).remote(config.model_dump(mode="json"), list(rows), near_limit_rows)
        )
    finally:
        if group is not None:  # the devices go back before the job's engines ask for them
            ray.util.remove_placement_group(group)
    return ProbeResult.model_validate(result)


def job_probe_rows(config: JobConfig, storage: Storage, units: Sequence[WorkUnit]) -> tuple[list[dict[str, Any]], int]:
    """`speculative.probe.rows` rows of `units` for the probe, and the near-limit rows left
    out. No rows, with a warning, when every row read ends near the length limit: the probe
    cannot judge the drafter there (the guard still watches). DrafterMismatch when every row
    read was refused."""
    rows, near_limit_rows = probe_rows(config, storage, units, config.speculative.probe.rows)
    if rows:
        return rows, near_limit_rows
    if near_limit_rows:
        log.warning(
            "drafter probe skipped: all %d rows read end within 2k tokens of engine.max_model_len, where vLLM stops "
            "drafting; raise max_model_len by %d for speculation to pay",
            near_limit_rows,
            2 * config.speculative.num_speculative_tokens,
        )
        return [], near_limit_rows
    raise DrafterMismatch(
        f"the probe found no usable row in {config.input_uri} (every row read was refused); fix the input rows, or "
        "set speculative.probe.rows: 0 to skip the probe"
    )


def probe_job_input(
    config: JobConfig, storage: Storage, units: Optional[Sequence[WorkUnit]] = None
) -> Optional[ProbeResult]:
    """`speculative.probe.rows` of the job's input (of `units`, default all of it) through the
    probe on an engine of its own (check-drafter); DrafterRejected below the floor, None when
    every row read ends near the length limit."""
    from pipeline.inputs.units import plan_units
    from pipeline.inputs import inspect_inputs

    if units is None:
        units = plan_units(
            inspect_inputs(config.input_uri, storage, shape=RowShape.for_job(config)).files,
            config.resources.rows_per_unit,
        )
    rows, near_limit_rows = job_probe_rows(config, storage, units)
    if not rows:
        return None
    result = run_probe(config, rows, near_limit_rows)
    rejected = refusal(config, result)
    if rejected:
        raise rejected
    return result


def rejudged(config: JobConfig, result: ProbeResult) -> ProbeResult:
    """An earlier probe's figures against today's floor (a resume may have lowered it)."""
    probe = config.speculative.probe
    passed = _passes(
        result.mean_acceptance_length,
        result.tokens_per_target_pass,
        probe.min_mean_acceptance_length,
        probe.min_tokens_per_target_pass,
    )
    return result.model_copy(
        update={
            "floor": probe.min_mean_acceptance_length,
            "passed": passed,
            "tokens_per_target_floor": probe.min_tokens_per_target_pass,
        }
    )


def refusal(config: JobConfig, result: ProbeResult) -> Optional[DrafterRejected]:
    """The refusal for a probe below the floor, naming the pitfall and the figures."""
    if result.passed:
        return None
    mal, tpp = result.mean_acceptance_length, result.tokens_per_target_pass
    where = (
        f"drafter {config.speculative.drafter} refused by the probe: on {result.rows} rows of the job's input at depth "
        f"{result.num_speculative_tokens}"
    )
    if mal is not None and mal >= result.floor:  # below the tokens per pass floor only: the drafts were cut
        return DrafterRejected(
            f"{where}, {tpp:.2f} tokens per target pass, below the floor speculative.probe.min_tokens_per_target_pass "
            f"= {result.tokens_per_target_floor}, while vLLM's mean acceptance length reads {mal:.2f}: vLLM leaves out "
            "the drafts a grammar cut, and this job's structured output cuts most of them, so speculation would only "
            "cost. Turn speculation off for this job (speculative.enabled: false); speculative.probe.rows: 0 skips "
            "the probe.",
            result,
        )
    measured = (
        "it drafted nothing"
        if mal is None
        else f"mean acceptance length {mal:.2f} (acceptance rate {result.acceptance_rate:.3f})"
    )
    return DrafterRejected(
        f"{where}, {measured}, below the floor "
        f"speculative.probe.min_mean_acceptance_length = {result.floor}. This is what a drafter trained for another "
        "base model looks like, even one with the same shapes and tokenizer (e.g. a Llama-3.1 drafter on "
        "Llama-3.3): speculation would only cost. Use the drafter trained for this target, or turn speculation off "
        "(speculative.enabled: false); speculative.probe.rows: 0 skips the probe.",
        result,
    )
