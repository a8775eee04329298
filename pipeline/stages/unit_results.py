"""The result stage of the engine actor: a unit's engine results as the rows and stats it
commits. A row the preprocess stage refused, a request that raised, a request vLLM ended with
finish_reason `error`: an error row each. Every other request: one output row per sample."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pyarrow as pa

from pipeline.config import SpeculativeConfig
from pipeline.stages.completions import output_rows
from pipeline.stages.engine import schedule_text
from pipeline.stages.engine_requests import EngineCrash
from pipeline.stages.stats import Acceptance
from schemas import ErrorRow, OutputRow, UnitStats, arrow_schema

# Errors of a request that are the row's own (vLLM refused it): retrying cannot help.
FINAL_GENERATE_ERRORS = (ValueError, TypeError)


@dataclass
class UnitResults:
    outputs: list[dict] = field(default_factory=list)
    output_index: list[int] = field(default_factory=list)  # each output's row in the unit (for its metadata)
    errors: list[dict] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    generated_rows: int = 0


@dataclass
class Identity:
    """What every output row of this actor says about where it came from."""

    model_id: str
    drafter_id: Optional[str]
    decode: Callable[[int], str]
    reasoning_parser: Any = None


def error_row(row: dict, stage: str, kind: str, field: Optional[str], message: str, retryable: bool = False) -> dict:
    return ErrorRow(
        id=row["id"],
        source=row["source"],
        row=row["row"],
        stage=stage,
        error_kind=kind,
        field=field,
        message=message,
        retryable=retryable,
        unit_id=row["unit_id"],
    ).model_dump()


def request_error(row: dict, result: Any) -> Optional[dict]:
    """The error row of a request that gave no usable output, else None."""
    if isinstance(result, BaseException) or result is None:
        final = isinstance(result, (EngineCrash, *FINAL_GENERATE_ERRORS))
        return error_row(row, "generate", type(result).__name__, None, str(result), retryable=not final)
    if not result.finished:
        return error_row(row, "generate", "Unfinished", None, "the engine returned no final output", retryable=True)
    if any(c.finish_reason == "error" for c in result.outputs):
        # vLLM ended the request itself, e.g. "grammar rejected tokens": its text is not an output.
        return error_row(
            row,
            "generate",
            "RequestFailed",
            None,
            "vLLM ended the request with finish_reason 'error' (its engine log says why, e.g. a grammar that "
            "rejected a token)",
            retryable=True,
        )
    return None


def collect(unit_id: str, rows: list[dict], results: dict[int, Any], who: Identity) -> UnitResults:
    out = UnitResults()
    for row in rows:
        if row["error_kind"] is not None:
            out.errors.append(error_row(row, "validate", row["error_kind"], row["error_field"], row["error_message"]))
    for i in sorted(results):
        row, result = rows[i], results[i]
        error = request_error(row, result)
        if error is not None:
            out.errors.append(error)
            continue
        samples, acceptance = output_rows(result, json.loads(row["sampling"]), who.decode, who.reasoning_parser)
        out.acceptance = out.acceptance + acceptance
        out.prompt_tokens += len(result.prompt_token_ids or row["prompt_token_ids"])
        out.cached_prompt_tokens += result.num_cached_tokens or 0  # once per request, as its prompt, whatever its n
        out.generated_tokens += sum(sample["generated_tokens"] for sample in samples)
        shared = dict(
            id=row["id"],
            max_tokens_clipped=bool(row["max_tokens_clipped"]),
            model=who.model_id,
            drafter=who.drafter_id,
            lora=row.get("lora"),
            source=row["source"],
            row=row["row"],
            unit_id=unit_id,
        )
        out.outputs += [{**sample, **shared} for sample in samples]
        out.output_index += [i] * len(samples)
        out.generated_rows += 1
    return out


def unit_stats(
    unit: tuple[str, str, int],
    rows: int,
    out: UnitResults,
    spec: SpeculativeConfig,
    where: dict[str, str],
    started: float,
    engine_seconds: float,
    disabled_by_guard: bool,
) -> UnitStats:
    unit_id, source, first_row = unit
    errors = out.errors
    return UnitStats(
        unit_id=unit_id,
        source=source,
        first_row=first_row,
        **where,
        rows=rows,
        output_rows=out.generated_rows,
        error_rows=len(errors),
        samples=len(out.outputs),
        retryable_error_rows=sum(e["retryable"] for e in errors),
        clipped_rows=sum(1 for o in out.outputs if o["max_tokens_clipped"] and o["sample_index"] == 0),
        first_error=f"{errors[0]['error_kind']}: {errors[0]['id']}" if errors else None,
        prompt_tokens=out.prompt_tokens,
        cached_prompt_tokens=out.cached_prompt_tokens,
        generated_tokens=out.generated_tokens,
        started_at=started,
        wall_seconds=0.0,
        engine_seconds=engine_seconds,
        tokens_per_second=out.generated_tokens / engine_seconds if engine_seconds > 0 else 0.0,
        speculative=spec.enabled,
        num_speculative_tokens=spec.num_speculative_tokens if spec.enabled else 0,
        depth_schedule=schedule_text(spec.depth_schedule) if spec.enabled and spec.depth_schedule else None,
        **out.acceptance.summary(),
        accepted_per_position=out.acceptance.accepted_per_position,
        tokens_per_target_pass=out.acceptance.tokens_per_target_pass(out.generated_tokens, len(out.outputs)),
        speculation_disabled_by_guard=disabled_by_guard,
    )


def tables(out: UnitResults, carried: pa.Table) -> dict[str, pa.Table]:
    """The unit's outputs and errors, in the output contract. Each output row gets its input
    row's `carried` columns: `metadata`, and the columns of `copied` (rows.copy_columns) by name."""
    index = pa.array(out.output_index, type=pa.int64())
    output_table = pa.Table.from_pylist(out.outputs, schema=arrow_schema(OutputRow)).append_column(
        "metadata", carried.column("metadata").take(index)
    )
    if "copied" in carried.column_names:
        copied = carried.column("copied").combine_chunks().take(index)
        for i in range(copied.type.num_fields):
            output_table = output_table.append_column(copied.type.field(i), copied.field(i))
    return {"outputs": output_table, "errors": pa.Table.from_pylist(out.errors, schema=arrow_schema(ErrorRow))}
