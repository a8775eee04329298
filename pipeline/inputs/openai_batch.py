"""OpenAI batch files: read as a job's input (`input_format: openai_batch`), written from a
job's output (`specbatch export --format openai_batch OUTPUT_URI [--to DEST]`).

Reading. `input_uri` names JSONL files of OpenAI batch requests, one per line:
{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}.
Before the job's Parquet input check each file is converted once, streaming (lines read and rows
written in batches), into Parquet files of the prompt row contract under
`OUTPUT_URI/_inputs/`: `<stem>-<hash of the file's URI>-<hash of URI, size, version>.chat.parquet`
for its chat lines and `....completions.parquet` for its completion lines, then a marker
`<...>.json`. A file whose marker is listed there is not converted again. The job then runs over
those Parquet files unchanged; each row's `metadata` is a JSON string holding what the export
needs ({"url", "model", "file", "line"}).

Like OpenAI's own batch validation, a file with any line that cannot be run refuses the whole job
before any engine starts (InputError): the message names the file, the line, the custom_id and
the field of each problem (the first LISTED_PROBLEMS, and their count). With
`unsupported_requests: errors` such a line with a custom_id is written as a row with no prompt
and its problem in `metadata` (`unsupported_row`); the preprocess stage makes it the row's
`unsupported_request` error, so the export writes it as an error line. A value of the right type
but out of range (temperature 7) is the request's own fault, as at OpenAI's endpoint: that row
goes to errors/ and the rest of the job runs.

Writing. `results.jsonl` holds one line per custom_id in OpenAI's batch output shape, its samples
the choices of one chat.completion or text_completion body; `errors.jsonl` one line per failed
custom_id. Units are read one output file at a time (all samples of an id are in one unit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.inputs import InputError, InputReport, inspect_inputs, short_name
from pipeline.storage import Storage
from schemas import InputFile

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
CONVERTED = "_inputs"
ROWS_PER_BATCH = 8192  # lines parsed before a row group is written
LISTED_PROBLEMS = 20
PARALLEL_FILES = 8
MARKERS_PER_READ = 256  # commit markers the export holds at once

UNSUPPORTED = "unsupported_request"  # the metadata key of an unsupported line's row, and its error_kind
MESSAGES = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))


def row_schema(kind: str) -> pa.Schema:
    """The prompt row contract of a converted file: `messages` for chat lines, `prompt` for
    completion lines (a file has one of the two)."""
    text = pa.field("messages", MESSAGES) if kind == "chat" else pa.field("prompt", pa.string())
    return pa.schema([
        pa.field("id", pa.string(), nullable=False), text,
        pa.field("max_tokens", pa.int64()), pa.field("temperature", pa.float64()), pa.field("top_p", pa.float64()),
        pa.field("seed", pa.int64()), pa.field("n", pa.int64()), pa.field("stop", pa.list_(pa.string())),
        pa.field("response_format", pa.string()), pa.field("sampling", pa.string()), pa.field("metadata", pa.string()),
    ])


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
STRUCTURED_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice", "grammar": "grammar"}


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
                    raise LineProblem(f"{where}.content[{j}]", f"type {json.dumps(kind)} is not supported (text parts only)")
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
    expected = {"text": (), "json_object": (), "json_schema": ("json_schema",), "regex": ("regex",),
                "choice": ("choice",), "grammar": ("grammar",)}
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
    (key, spec), = given.items()
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
    fmt = (_response_format(body.pop("response_format")) if "response_format" in body
           else _structured_outputs(body.pop("structured_outputs")) if "structured_outputs" in body else None)
    row["response_format"] = json.dumps(fmt, sort_keys=True) if fmt else None
    for name in list(body):
        if name in SHARED_FIELDS:
            where, type_name = SHARED_FIELDS[name]
            value = _typed(body, name, type_name)
            if where.startswith("sampling."):
                sampling[where[len("sampling."):]] = value
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
    meta = {"url": url if url in URLS else None, "model": body.get("model") if isinstance(body.get("model"), str) else None,
            "file": file, "line": line, UNSUPPORTED: {"field": problem.field, "message": str(problem)}}
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
    meta = {"url": url, "model": body.get("model") if isinstance(body.get("model"), str) else None, "file": file, "line": line}
    row["metadata"] = json.dumps(meta, sort_keys=True)
    return kind, row


# ---------------------------------------------------------------- files


@contextlib.contextmanager
def atomic_file(storage: Storage, uri: str) -> Iterator[Any]:
    """A binary file written under a temporary name and renamed to `uri` when the block ends
    without error (removed otherwise): a reader never sees it half-written. Written as a
    stream (a multipart upload on S3), never held in memory."""
    fs, path = storage.fs(uri)
    staging = f"{path}.tmp-{uuid.uuid4().hex}"
    if "file" in fs.protocol:
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
    try:
        with fs.open(staging, "wb") as f:
            yield f
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(staging)
        raise
    if "file" in fs.protocol:
        os.replace(staging, path)
    else:  # S3 has no rename: a server-side copy, then the staging object goes
        storage.retrying(f"rename {uri}", lambda: fs.mv(staging, path))


class _Sink:
    """One converted Parquet file, written in row groups as lines are read."""

    def __init__(self, storage: Storage, uri: str, kind: str):
        self.uri, self.schema, self.rows, self.pending = uri, row_schema(kind), 0, []
        self._file = atomic_file(storage, uri)
        self._writer = pq.ParquetWriter(self._file.__enter__(), self.schema, compression="zstd")

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= ROWS_PER_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self._writer.write_table(pa.Table.from_pylist(self.pending, schema=self.schema))
            self.rows, self.pending = self.rows + len(self.pending), []

    def close(self, keep: bool) -> None:
        if keep:
            self.flush()
        self._writer.close()
        if keep:
            self._file.__exit__(None, None, None)
        else:
            with contextlib.suppress(InputError):
                self._file.__exit__(InputError, InputError("discarded"), None)


def identity_hash(*parts: Any) -> str:
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()


def converted_base(uri: str, size: int, version: str, unsupported: str = "refuse") -> str:
    """`<stem>-<hash of the URI>-<hash of URI, size, version>`: the first two name the source,
    the last its content (and, with unsupported_requests: errors, that setting: its
    conversion holds rows the other one refuses)."""
    content = identity_hash(uri, size, version) if unsupported == "refuse" else identity_hash(uri, size, version, unsupported)
    return f"{short_name(uri)}-{identity_hash(uri)[:8]}-{content[:12]}"


def _source_key(converted_uri: str) -> str:
    return posixpath.basename(converted_uri).split(".", 1)[0].rsplit("-", 1)[0]


def expand_sources(storage: Storage, input_uri: str) -> dict[str, dict[str, Any]]:
    """A JSONL file, a folder of `.jsonl` files (recursively) or a glob -> {URI: {size, version}}."""
    return storage.expand_input(input_uri, ".jsonl")


class _FileConversion:
    """One JSONL file's conversion: its rows to a Parquet sink per kind, its problems (the
    first LISTED_PROBLEMS listed, all counted), and its custom_id hashes, so duplicates are
    found without holding the ids. Once a problem is seen nothing more is written."""

    def __init__(self, storage: Storage, uri: str, folder: str, base: str, unsupported: str = "refuse"):
        self.storage, self.uri, self.folder, self.base = storage, uri, folder, base
        self.error_lines = unsupported == "errors"
        self.sinks: dict[str, _Sink] = {}
        self.problems: list[str] = []
        self.count = self.lines = self.unsupported = 0
        self.hashes, self.line_numbers = [], []
        self.ids_batch, self.lines_batch = [], []

    def note(self, line: int, custom_id: Any, field: str, message: str) -> None:
        self.count += 1
        if len(self.problems) < LISTED_PROBLEMS:
            who = f"custom_id {json.dumps(custom_id)}" if isinstance(custom_id, str) and custom_id else "no custom_id"
            self.problems.append(f"{self.uri}, line {line}, {who}: {field}: {message}")

    def take(self, line: int, raw: bytes) -> None:
        self.lines = line
        if not raw.strip():
            return
        try:
            request = json.loads(raw)
        except ValueError as exc:
            return self.note(line, None, "(line)", f"not JSON ({exc})")
        custom_id = request.get("custom_id") if isinstance(request, dict) else None
        try:
            kind, row = convert_request(request, line, self.uri)
        except LineProblem as exc:
            if not (self.error_lines and isinstance(custom_id, str) and custom_id):
                return self.note(line, custom_id, exc.field, str(exc))
            kind, row = unsupported_row(request, custom_id, exc, line, self.uri)
            self.unsupported += 1
        self.ids_batch.append(hashlib.blake2b(custom_id.encode(), digest_size=8).digest())
        self.lines_batch.append(line)
        if len(self.ids_batch) >= ROWS_PER_BATCH:
            self._flush_ids()
        if self.count:
            return  # refused already: nothing more is written
        if kind not in self.sinks:
            self.sinks[kind] = _Sink(self.storage, self.storage.join(self.folder, f"{self.base}.{kind}.parquet"), kind)
        self.sinks[kind].add(row)

    def _flush_ids(self) -> None:
        if self.ids_batch:
            self.hashes.append(np.frombuffer(b"".join(self.ids_batch), dtype=np.uint64))
            self.line_numbers.append(np.array(self.lines_batch, dtype=np.int64))
            self.ids_batch, self.lines_batch = [], []

    def check_duplicates(self) -> None:
        self._flush_ids()
        duplicates = _duplicates(self.hashes, self.line_numbers)
        wanted = {line for line, _ in duplicates[:LISTED_PROBLEMS]}
        named = _custom_ids_at(self.storage, self.uri, wanted) if duplicates else {}
        for line, first in duplicates:
            self.note(line, named.get(line), "custom_id", f"used again (first on line {first})")

    def close(self, keep: bool) -> None:
        for sink in self.sinks.values():
            sink.close(keep)


def _convert_file(storage: Storage, uri: str, info: dict, folder: str, unsupported: str) -> tuple[list[str], list[str], int]:
    """Convert one JSONL file -> (converted URIs, problems (the first LISTED_PROBLEMS), count of
    problems). Nothing is kept unless every line converts (or, with unsupported_requests:
    errors, becomes its error row)."""
    base = converted_base(uri, info["size"], info["version"], unsupported)
    conversion = _FileConversion(storage, uri, folder, base, unsupported)
    fs, path = storage.fs(uri)
    try:
        with storage.retrying(f"open {uri}", lambda: fs.open(path, "rb")) as f:
            for line, raw in enumerate(f, 1):
                conversion.take(line, raw)
        conversion.check_duplicates()
    except BaseException:
        conversion.close(keep=False)
        raise
    conversion.close(keep=conversion.count == 0)
    if conversion.count:
        return [], conversion.problems, conversion.count
    sinks = conversion.sinks
    marker = {"source": uri, "size": info["size"], "version": info["version"], "lines": conversion.lines,
              "files": {k: posixpath.basename(s.uri) for k, s in sinks.items()}, "rows": {k: s.rows for k, s in sinks.items()},
              "unsupported_lines": conversion.unsupported}
    storage.write_json(storage.join(folder, f"{base}.json"), marker)
    return sorted(s.uri for s in sinks.values()), [], 0


def _duplicates(hashes: list[np.ndarray], lines: list[np.ndarray]) -> list[tuple[int, int]]:
    """(line, the line of its first use) of every custom_id used before in the file, found by
    sorting 8-byte hashes of the ids (16 bytes a line, where a set of the ids could take GBs)."""
    if not hashes:
        return []
    h, n = np.concatenate(hashes), np.concatenate(lines)
    order = np.lexsort((n, h))
    h, n = h[order], n[order]
    same = np.concatenate([[False], h[1:] == h[:-1]])
    first_of_group = np.maximum.accumulate(np.where(same, 0, np.arange(len(h))))
    return sorted((int(n[i]), int(n[first_of_group[i]])) for i in np.flatnonzero(same))


def _custom_ids_at(storage: Storage, uri: str, wanted: set[int]) -> dict[int, str]:
    """The custom_ids of some lines (of refused duplicates only: a second read of the file)."""
    found: dict[int, str] = {}
    fs, path = storage.fs(uri)
    with fs.open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            if line in wanted:
                found[line] = json.loads(raw).get("custom_id")
                if len(found) == len(wanted):
                    break
    return found


def convert_batch_files(
    input_uri: str, storage: Storage, folder: str, scratch: Optional[str] = None, unsupported: str = "refuse"
) -> list[str]:
    """Convert every JSONL file of `input_uri` not converted yet into `folder`; returns the
    converted Parquet URIs of all of them, in order. InputError lists every problem.
    `scratch` (a dry run's temporary folder): the files not converted yet in `folder` are
    converted there instead, and nothing is written to `folder`. `unsupported`: the job's
    unsupported_requests."""
    sources = expand_sources(storage, input_uri)
    if not sources:
        raise InputError(
            f"input_uri {input_uri!r} matches no JSONL file; set input_uri to a .jsonl file, a folder holding .jsonl "
            "files or a glob; for Parquet prompt files set input_format: parquet"
        )
    listed = storage.list_files(folder)
    done = {posixpath.basename(u)[: -len(".json")] for u in listed if u.endswith(".json")}
    parquet = [u for u in listed if u.endswith(".parquet")]
    converted, todo = {}, []
    for uri, info in sources.items():
        base = converted_base(uri, info["size"], info["version"], unsupported)
        if base in done:
            converted[uri] = sorted(u for u in parquet if posixpath.basename(u).startswith(base + "."))
        else:
            todo.append((uri, info))
    with ThreadPoolExecutor(PARALLEL_FILES) as pool:
        results = list(pool.map(lambda item: _convert_file(storage, item[0], item[1], scratch or folder, unsupported), todo))
    problems, count = [], 0
    for (uri, _), (files, file_problems, file_count) in zip(todo, results):
        converted[uri] = files
        problems += file_problems
        count += file_count
    if count:
        shown = problems[:LISTED_PROBLEMS]
        head = f"{count} problem{'s' if count > 1 else ''}" + (f", the first {len(shown)}" if count > len(shown) else "")
        raise InputError(
            f"OpenAI batch input {input_uri!r} refused ({head}):\n  " + "\n  ".join(shown)
            + "\nFix these lines (each a request of OpenAI's batch format with a custom_id unique in its file) and run again"
            + (", or set unsupported_requests: errors to run the rest and get each such line back as an error line."
               if unsupported == "refuse" else ".")
        )
    return [u for uri in sources for u in converted[uri]]


def inspect_job_inputs(
    config, storage: Storage, known: Optional[list[InputFile]] = None, scratch: Optional[str] = None
) -> InputReport:
    """The job's input check (`pipeline.inputs.inspect_inputs`), after converting OpenAI batch
    files when `config.input_format` is openai_batch (`scratch`: see `convert_batch_files`)."""
    if config.input_format == "parquet":
        return inspect_inputs(config.input_uri, storage, known)
    converted = convert_batch_files(
        config.input_uri, storage, storage.join(config.output_uri, CONVERTED), scratch, config.unsupported_requests
    )
    if not converted:
        raise InputError(
            f"input_uri {config.input_uri!r}: its JSONL files hold no request; point input_uri at files with request lines"
        )
    now, names = {_source_key(u) for u in converted}, {posixpath.basename(u) for u in converted}
    replaced = sorted(f.uri for f in known or [] if _source_key(f.uri) in now and posixpath.basename(f.uri) not in names)
    if replaced:
        raise InputError(
            f"OpenAI batch files (or unsupported_requests) changed since this job started at {config.output_uri} (their earlier conversions: "
            + ", ".join(replaced) + "). Use a new output_uri, or rerun with --restart to start over."
        )
    with ThreadPoolExecutor(PARALLEL_FILES) as pool:
        reports = list(pool.map(lambda uri: inspect_inputs(uri, storage, known), converted))
    files = [f for r in reports for f in r.files]
    return InputReport(files, sum(f.rows for f in files), footers_read=sum(r.footers_read for r in reports))


# ---------------------------------------------------------------- export
