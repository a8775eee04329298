"""Structured output: a response_format (pipeline/config/rows.py) as vLLM's structured-output
parameters, checked before any engine starts, and each output checked against it after.

The engine constrains every token to the format, so an output breaks it only when it is cut
off (max_tokens, a stop string) or the format itself allows more than the check does. Such a
row is marked (`parsed` false, `parse_error`), never passed off as valid.
"""

from __future__ import annotations

import functools
import json
import types
from typing import Any, Optional

from pipeline.config import ResponseFormat


def _values(fmt: ResponseFormat | dict | None) -> Optional[dict[str, Any]]:
    if fmt is None:
        return None
    return fmt.model_dump(mode="json") if isinstance(fmt, ResponseFormat) else fmt


def structured_outputs(fmt: ResponseFormat | dict | None):
    """vLLM's StructuredOutputsParams of a response_format; None for none or `text`."""
    from vllm.sampling_params import StructuredOutputsParams

    f = _values(fmt)
    if f is None or f["type"] == "text":
        return None
    if f["type"] == "json_schema":
        return StructuredOutputsParams(json=f["json_schema"]["schema"])
    if f["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(**{f["type"]: f[f["type"]]})


def check_supported(fmt: ResponseFormat | dict | None, tokenizer, backend: str = "auto") -> None:
    """Raises ValueError when vLLM's structured-output backend (auto: xgrammar, then guidance)
    cannot compile the format: the check the engine makes when a request arrives."""
    if _values(fmt) is None or _values(fmt)["type"] == "text":
        return  # the driver imports no vLLM for a job without structured output
    from vllm import SamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.exceptions import VLLMError

    params = structured_outputs(fmt)
    request = SamplingParams(structured_outputs=params)
    model = types.SimpleNamespace(is_diffusion=False)  # all the check reads of the model config
    try:
        request._validate_structured_outputs(model, StructuredOutputsConfig(backend=backend), tokenizer)
    except VLLMError as exc:  # not a ValueError
        raise ValueError(str(exc)) from None


@functools.lru_cache(maxsize=64)
def _json_validator(schema_text: str):
    import jsonschema

    schema = json.loads(schema_text)
    return jsonschema.validators.validator_for(schema)(schema)


@functools.lru_cache(maxsize=64)
def _compiled(kind: str, source: str):
    import xgrammar

    return xgrammar.Grammar.from_regex(source) if kind == "regex" else xgrammar.Grammar.from_ebnf(source)


def parse_check(fmt: dict[str, Any] | None, text: str) -> tuple[Optional[bool], Optional[str]]:
    """(parsed, parse_error) of an output under its response_format; (None, None) without one."""
    if fmt is None or fmt["type"] == "text":
        return None, None
    kind = fmt["type"]
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            return False, f"not JSON: {exc}"
        if kind == "json_object":
            return (True, None) if isinstance(value, dict) else (False, f"a JSON {type(value).__name__}, not an object")
        error = next(
            iter(_json_validator(json.dumps(fmt["json_schema"]["schema"], sort_keys=True)).iter_errors(value)), None
        )
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return False, f"does not follow the schema at {where}: {error.message}"
        return True, None
    if kind == "choice":
        return (True, None) if text in fmt["choice"] else (False, f"{text[:80]!r} is none of the choices")
    # regex and grammar: matched by xgrammar, the engine's own grammar library, so that the
    # check speaks the dialect the constraint was compiled in.
    from xgrammar.testing import _is_grammar_accept_string

    if _is_grammar_accept_string(_compiled(kind, fmt[kind]), text):
        return True, None
    return False, f"does not match the {kind} in full (cut off at {len(text)} characters?)"
