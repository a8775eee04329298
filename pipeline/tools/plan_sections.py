"""The dry run's sections of the plan (schemas.DryRunPlan) other than its checks: the inputs and
their files (with the first prompt of each file shown), the units, the prefix grouping."""

from __future__ import annotations

import posixpath
from collections import Counter
from typing import Optional

from pipeline.inputs.units import WorkUnit
from pipeline.config import JobConfig
from pipeline.inputs import InputReport
from pipeline.inputs.openai_batch import CONVERTED
from pipeline.inputs.prefixes import grouped_unit_count
from pipeline.job.plan import JobPlan
from pipeline.job.preflight import first_row_text
from pipeline.storage import Storage
from pipeline.tools.plan_text import FILES_SHOWN
from schemas.plan import DryRunPlan, PlanFile, PlanGrouping, PlanInputs, PlanUnits


def inputs_section(config: JobConfig, storage: Storage, inputs: InputReport, scratch: str) -> PlanInputs:
    rows = Counter()
    for f in inputs.files:
        rows[f.text_column] += f.rows
    converted = checked = None
    if config.input_format == "openai_batch":
        checked = len({_source_base(f.uri) for f in inputs.files if _in_scratch(f.uri, scratch)})
        converted = len({_source_base(f.uri) for f in inputs.files if not _in_scratch(f.uri, scratch)})
    return PlanInputs(
        input_format=config.input_format,
        files=len(inputs.files),
        footers_read=inputs.footers_read,
        rows=inputs.rows,
        prompt_rows=rows["prompt"],
        chat_rows=rows["messages"],
        converted_files=converted,
        conversions_checked=checked,
        file_list=[],
    )


def _in_scratch(uri: str, scratch: str) -> bool:
    return uri.startswith(scratch.rstrip("/") + "/")


def _source_base(uri: str) -> str:
    return posixpath.basename(uri).split(".", 1)[0]


def _shown_uri(config: JobConfig, storage: Storage, uri: str, scratch: str) -> str:
    """A file converted into the scratch folder, named where the run will convert it."""
    return storage.join(config.output_uri, CONVERTED, posixpath.basename(uri)) if _in_scratch(uri, scratch) else uri


def files_and_units(
    plan: DryRunPlan,
    config: JobConfig,
    storage: Storage,
    scratch: str,
    units: list[WorkUnit],
    committed: set[str],
    again: set[str],
    todo: list[WorkUnit],
    rerun_of: Optional[str],
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
        rows_per_unit=config.resources.rows_per_unit,
        units=len(units),
        committed=len(committed & ids),
        again=len(again & ids),
        left=len(todo),
        rows_left=sum(u.rows for u in todo),
        rerun_of=rerun_of,
    )


def first_prompts(plan: DryRunPlan, config: JobConfig, storage: Storage, inputs: InputReport) -> None:
    """The first row of each file shown, rendered by the job's template (and chat template)."""
    from pipeline.inputs.shape import RowShape
    from pipeline.stages.preprocess import load_tokenizer
    from pipeline.storage.model_cache import localize

    shape, shown = RowShape.for_job(config), {f.uri: f for f in plan.inputs.file_list[:FILES_SHOWN]}
    tokenizer = None
    for file in (f for f in inputs.files if f.uri in shown):
        value = first_row_text(storage, file, shape)
        if value is not None and file.text_column == "messages":
            tokenizer = tokenizer or load_tokenizer(
                localize(config.model.tokenizer or config.model.path, storage, weights=False)
            )
            value = tokenizer.apply_chat_template(
                value, tokenize=False, add_generation_prompt=True, **config.chat.template_kwargs
            )
        shown[file.uri].first_prompt = value


def grouping_section(config: JobConfig, job: JobPlan, prompt_tokens: int) -> PlanGrouping:
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
