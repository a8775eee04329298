"""A row's sampling parameters: the job's defaults (`sampling` in the config) with the row's
overrides on top, checked like the config itself, and turned into vLLM's SamplingParams.

A row overrides max_tokens, temperature, top_p, seed, n and stop with columns of their own,
response_format with a column of JSON text, and any other parameter with its `sampling`
column (a JSON object). A bad override is the row's error, naming the column (and the key
inside `sampling`); the other rows go on.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from pydantic import ValidationError

from pipeline.config import JOB_ONLY_SAMPLING, SamplingConfig, closest

COLUMNS = ("max_tokens", "temperature", "top_p", "seed", "n", "stop")


class RowError(Exception):
    """The row cannot be generated: `kind`, the input column at fault and why."""

    def __init__(self, kind: str, field: Optional[str], message: str):
        super().__init__(message)
        self.kind, self.field, self.message = kind, field, message


def _json_object(row: dict[str, Any], column: str) -> Optional[dict]:
    text = row.get(column)
    if text is None or text == "":
        return None
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise RowError("invalid_sampling", column, f"{column} is not JSON text ({exc})") from None
    if not isinstance(value, dict):
        raise RowError("invalid_sampling", column, f"{column} must be a JSON object, got {type(value).__name__}")
    return value


def row_overrides(row: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """key -> (the input field it came from, value)."""
    overrides = {}
    for key, value in (_json_object(row, "sampling") or {}).items():
        if key in JOB_ONLY_SAMPLING:
            raise RowError("invalid_sampling", f"sampling.{key}", f"{key} is set for the whole job, not per row")
        overrides[key] = (f"sampling.{key}", value)
    response_format = _json_object(row, "response_format")
    if response_format is not None:
        overrides["response_format"] = ("response_format", response_format)
    for column in COLUMNS:
        value = row.get(column)
        if value is None:
            continue
        if isinstance(value, float) and math.isnan(value):
            raise RowError("invalid_sampling", column, f"{column} is NaN")
        overrides[column] = (column, value)
    return overrides


def resolve(row: dict[str, Any], defaults: SamplingConfig, default_values: dict[str, Any]) -> SamplingConfig:
    """The row's parameters; `default_values` is `defaults.model_dump()`, computed once."""
    overrides = row_overrides(row)
    if not overrides:
        return defaults
    try:
        return SamplingConfig.model_validate({**default_values, **{k: v for k, (_, v) in overrides.items()}})
    except ValidationError as exc:
        error = exc.errors()[0]
        if not error["loc"]:  # a rule across parameters (n > 1 at temperature 0): name what the row set
            fields = ", ".join(f for f, _ in overrides.values())
            raise RowError(
                "invalid_sampling", fields, f"{fields}: {error['msg'].removeprefix('Value error, ')}"
            ) from None
        key = str(error["loc"][0])
        field, _ = overrides.get(key, (f"sampling.{key}", None))
        inner = ".".join(str(p) for p in error["loc"][1:])
        where = f"{field}.{inner}" if inner else field
        if error["type"] == "extra_forbidden":
            close = closest(key, (k for k in SamplingConfig.model_fields if k not in JOB_ONLY_SAMPLING))
            hint = f" (did you mean {close!r}?)" if close else ""
            raise RowError("invalid_sampling", where, f"unknown sampling key {key!r}{hint}") from None
        raise RowError("invalid_sampling", where, f"{where}: {error['msg']}") from None


def engine_values(sampling: SamplingConfig) -> dict[str, Any]:
    """The resolved parameters as the prepared table carries them to the engine actors."""
    return sampling.model_dump(mode="json", exclude=set(JOB_ONLY_SAMPLING))


def sampling_params(values: dict[str, Any], **extra):
    """vLLM SamplingParams of resolved values (`engine_values`, or the prepared row's JSON)."""
    from vllm import SamplingParams

    from pipeline.stages.structured import structured_outputs

    v = dict(values)
    response_format = v.pop("response_format", None)
    return SamplingParams(
        **{
            k: value
            for k, value in v.items()
            if k not in ("logit_bias", "allowed_token_ids", "stop", "stop_token_ids", "bad_words")
        },
        stop=v["stop"] or None,
        stop_token_ids=v["stop_token_ids"] or None,
        bad_words=v["bad_words"] or None,
        logit_bias={int(k): b for k, b in v["logit_bias"].items()} or None,
        allowed_token_ids=v["allowed_token_ids"] or None,
        structured_outputs=structured_outputs(response_format),
        **extra,
    )


def row_sampling_params(row: dict[str, Any], **extra):
    """vLLM SamplingParams of one prepared row (its `sampling` JSON)."""
    return sampling_params(json.loads(row["sampling"]), **extra)
