"""One OpenAI batch request line -> one prompt row (pipeline/inputs/openai_batch.py reads the
files): the envelope ({"custom_id", "method", "url", "body"}), the body's fields as the prompt
row contract's columns or vLLM sampling parameters, and the problem (LineProblem, naming the
field) of a line specbatch cannot run. An unsupported line kept as a row (`unsupported_requests:
errors`) carries its problem in its metadata, which the preprocess stage turns into the row's
error."""

from __future__ import annotations

import json
from typing import Any, Optional

import pyarrow as pa

from pipeline.inputs.shape import MESSAGES_TYPE, SAMPLING_FIELDS

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

UNSUPPORTED = "unsupported_request"  # the metadata key of an unsupported line's row, and its error_kind


def row_schema(kind: str) -> pa.Schema:
    """The prompt row contract of a converted file: `messages` for chat lines, `prompt` for
    completion lines (a file has one of the two)."""
    text = pa.field("messages", MESSAGES_TYPE) if kind == "chat" else pa.field("prompt", pa.string())
    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            text,
            *SAMPLING_FIELDS,
            pa.field("metadata", pa.string()),
        ]
    )


# ---------------------------------------------------------------- the body of a request line


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


TYPES = {
    "int": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "strings": (lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "a list of strings"),
    "ints": (lambda v: isinstance(v, list) and all(_is_int(i) for i in v), "a list of integers"),
}
# Body field -> (row column, or "sampling.<SamplingParams name>"; its type), for both urls.
SHARED_FIELDS = {
    "max_tokens": ("max_tokens", "int"),
    "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"),
    "seed": ("seed", "int"),
    "n": ("n", "int"),
    "presence_penalty": ("sampling.presence_penalty", "number"),
    "frequency_penalty": ("sampling.frequency_penalty", "number"),
    # vLLM's extra request fields, named as its SamplingParams
    "top_k": ("sampling.top_k", "int"),
    "min_p": ("sampling.min_p", "number"),
    "repetition_penalty": ("sampling.repetition_penalty", "number"),
    "min_tokens": ("sampling.min_tokens", "int"),
    "stop_token_ids": ("sampling.stop_token_ids", "ints"),
    "ignore_eos": ("sampling.ignore_eos", "bool"),
    "skip_special_tokens": ("sampling.skip_special_tokens", "bool"),
    "spaces_between_special_tokens": ("sampling.spaces_between_special_tokens", "bool"),
    "include_stop_str_in_output": ("sampling.include_stop_str_in_output", "bool"),
    "bad_words": ("sampling.bad_words", "strings"),
    "prompt_logprobs": ("sampling.prompt_logprobs", "int"),
}
# Accepted and not used for generation (`model` is kept for the export to echo).
IGNORED_FIELDS = ("model", "user", "metadata", "store")
# Accepted only at their default value (null is always the default).
DEFAULT_ONLY = {"stream": False, "echo": False, "best_of": 1}
CHAT_ROLES = ("system", "developer", "user", "assistant")
STRUCTURED_KINDS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class LineProblem(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default  # 0 is not false, true is not 1


def _typed(body: dict, name: str, kind: str) -> Any:
    value = body[name]
    ok, expected = TYPES[kind]
    if not ok(value):
        raise LineProblem(f"body.{name}", f"expected {expected}, got {json.dumps(value)[:60]}")
    return float(value) if kind == "number" else value


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise LineProblem("body.messages", "expected a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(message, dict):
            raise LineProblem(where, "expected an object {role, content}")
        for key in message:
            if key not in ("role", "content"):
                raise LineProblem(f"{where}.{key}", "not supported (a message is its role and text content)")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise LineProblem(f"{where}.role", f"{json.dumps(role)} is not supported (one of {', '.join(CHAT_ROLES)})")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise LineProblem(
                        f"{where}.content[{j}]", f"type {json.dumps(kind)} is not supported (text parts only)"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM's server joins text parts
        if not isinstance(content, str):
            raise LineProblem(f"{where}.content", "expected a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def _response_format(value: Any, field: str = "body.response_format") -> Optional[dict]:
    """OpenAI's response_format, plus the contract's vLLM extras (regex, choice, grammar);
    None for {"type": "text"}."""
    if not isinstance(value, dict):
        raise LineProblem(field, "expected an object with a type")
    kind = value.get("type")
    expected = {
        "text": (),
        "json_object": (),
        "json_schema": ("json_schema",),
        "regex": ("regex",),
        "choice": ("choice",),
        "grammar": ("grammar",),
    }
    if kind not in expected:
        raise LineProblem(f"{field}.type", f"{json.dumps(kind)} is not supported (one of {', '.join(expected)})")
    extra = set(value) - {"type", *expected[kind]}
    if extra:
        raise LineProblem(f"{field}.{sorted(extra)[0]}", f"not supported with type {kind}")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise LineProblem(f"{field}.json_schema", "expected an object with a schema object")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise LineProblem(f"{field}.json_schema.{sorted(unknown)[0]}", "not supported")
    elif kind == "choice" and not TYPES["strings"][0](value.get("choice")):
        raise LineProblem(f"{field}.choice", "expected a list of strings")
    elif kind in ("regex", "grammar") and not isinstance(value.get(kind), str):
        raise LineProblem(f"{field}.{kind}", "expected a string")
    return value


def _structured_outputs(value: Any) -> dict:
    """vLLM's `structured_outputs` {json | json_object | regex | choice | grammar} as the
    row's response_format."""
    field = "body.structured_outputs"
    if not isinstance(value, dict):
        raise LineProblem(field, "expected an object")
    given = {k: v for k, v in value.items() if v is not None}
    unknown = set(given) - set(STRUCTURED_KINDS)
    if unknown:
        raise LineProblem(f"{field}.{sorted(unknown)[0]}", "not supported")
    if len(given) != 1:
        raise LineProblem(field, f"expected exactly one of {', '.join(STRUCTURED_KINDS)}")
    ((key, spec),) = given.items()
    if key == "json":
        spec = json.loads(spec) if isinstance(spec, str) else spec
        return _response_format({"type": "json_schema", "json_schema": {"schema": spec}}, field)
    if key == "json_object":
        return {"type": "json_object"}
    return _response_format({"type": key, key: spec}, field)


def _envelope(request: Any) -> tuple[str, str, str, dict]:
    """(custom_id, url, kind, body) of a request line, its envelope checked."""
    if not isinstance(request, dict):
        raise LineProblem("(line)", "expected a JSON object {custom_id, method, url, body}")
    unknown = set(request) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise LineProblem(sorted(unknown)[0], "not a field of a batch request line")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineProblem("custom_id", "missing (a non-empty string is required)")
    if request.get("method") != "POST":
        raise LineProblem("method", f"{json.dumps(request.get('method'))} is not supported (POST)")
    url = request.get("url")
    if url not in URLS:
        raise LineProblem("url", f"{json.dumps(url)} is not supported (one of {', '.join(URLS)})")
    body = request.get("body")
    if not isinstance(body, dict):
        raise LineProblem("body", "expected an object")
    return custom_id, url, URLS[url], {k: v for k, v in body.items() if v is not None}  # null: not given, as at OpenAI


def _chat_body(body: dict, row: dict, sampling: dict) -> None:
    """Takes a chat request's own fields out of `body`."""
    if "messages" not in body:
        raise LineProblem("body.messages", "missing")
    row["messages"] = _messages(body.pop("messages"))
    if "max_completion_tokens" in body:
        value = _typed(body, "max_completion_tokens", "int")
        if "max_tokens" in body and body["max_tokens"] != value:
            raise LineProblem("body.max_completion_tokens", "differs from body.max_tokens; give one of them")
        body["max_tokens"] = body.pop("max_completion_tokens")
    if "top_logprobs" in body and body.get("logprobs") is not True:
        raise LineProblem("body.top_logprobs", "requires logprobs: true")
    if "logprobs" in body and _typed(body, "logprobs", "bool"):
        sampling["logprobs"] = _typed(body, "top_logprobs", "int") if "top_logprobs" in body else 0
    body.pop("logprobs", None), body.pop("top_logprobs", None)


def _completion_body(body: dict, row: dict, sampling: dict) -> None:
    """Takes a completion request's own fields out of `body`."""
    prompt = body.pop("prompt", None)
    if not isinstance(prompt, str):
        raise LineProblem("body.prompt", "expected a string (a list of prompts, or token ids, is not supported)")
    row["prompt"] = prompt
    if "logprobs" in body:
        sampling["logprobs"] = _typed(body, "logprobs", "int")
        del body["logprobs"]
    if body.get("suffix") == "":
        del body["suffix"]


def _shared_body(body: dict, row: dict, sampling: dict) -> None:
    """The fields both kinds share; anything left that specbatch cannot honour is refused."""
    for name, default in DEFAULT_ONLY.items():
        if name in body and not _same(body.pop(name), default):
            raise LineProblem(f"body.{name}", f"only {json.dumps(default)} is supported")
    if "stop" in body:
        stop = body.pop("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if not TYPES["strings"][0](stop):
            raise LineProblem("body.stop", "expected a string or a list of strings")
        row["stop"] = stop or None
    if "response_format" in body and "structured_outputs" in body:
        raise LineProblem("body.structured_outputs", "give response_format or structured_outputs, not both")
    fmt = (
        _response_format(body.pop("response_format"))
        if "response_format" in body
        else _structured_outputs(body.pop("structured_outputs"))
        if "structured_outputs" in body
        else None
    )
    row["response_format"] = json.dumps(fmt, sort_keys=True) if fmt else None
    for name in list(body):
        if name in SHARED_FIELDS:
            where, type_name = SHARED_FIELDS[name]
            value = _typed(body, name, type_name)
            if where.startswith("sampling."):
                sampling[where[len("sampling.") :]] = value
            else:
                row[where] = value
        elif name not in IGNORED_FIELDS:
            raise LineProblem(f"body.{name}", "not supported by specbatch (refused rather than ignored)")


def unsupported_row(request: dict, custom_id: str, problem: LineProblem, line: int, file: str) -> tuple[str, dict]:
    """A line specbatch cannot run, as a row the preprocess stage turns into its error
    (`unsupported_request`, unsupported_requests: errors): its id, no prompt, and the problem in
    its metadata."""
    url = request.get("url")
    body = request.get("body") if isinstance(request.get("body"), dict) else {}
    meta = {
        "url": url if url in URLS else None,
        "model": body.get("model") if isinstance(body.get("model"), str) else None,
        "file": file,
        "line": line,
        UNSUPPORTED: {"field": problem.field, "message": str(problem)},
    }
    return URLS.get(url, "completions"), {"id": custom_id, "metadata": json.dumps(meta, sort_keys=True)}


def unsupported_problem(metadata: Any) -> Optional[dict]:
    """The problem an unsupported line's row carries (unsupported_row), or None."""
    if not isinstance(metadata, str) or UNSUPPORTED not in metadata:
        return None
    try:
        problem = json.loads(metadata).get(UNSUPPORTED)
    except (ValueError, AttributeError):
        return None
    return problem if isinstance(problem, dict) else None


def convert_request(request: Any, line: int, file: str) -> tuple[str, dict]:
    """One request line (parsed JSON) -> (kind, row of the prompt row contract); LineProblem
    names the field of what cannot be run."""
    custom_id, url, kind, body = _envelope(request)
    row: dict[str, Any] = {"id": custom_id}
    sampling: dict[str, Any] = {}
    (_chat_body if kind == "chat" else _completion_body)(body, row, sampling)
    _shared_body(body, row, sampling)
    row["sampling"] = json.dumps(sampling, sort_keys=True) if sampling else None
    meta = {
        "url": url,
        "model": body.get("model") if isinstance(body.get("model"), str) else None,
        "file": file,
        "line": line,
    }
    row["metadata"] = json.dumps(meta, sort_keys=True)
    return kind, row
