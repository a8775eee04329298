"""Job-level input checks, before any engine starts, from Parquet footers only.

The listing gives each file's size and version (ETag, or mtime on local disks); the footer
(one ranged read of its last 64 KiB, several files at a time) gives the schema, the row
count and per-row-group statistics. An input that matches nothing, a corrupt file, a missing
`id`, both or neither of `prompt`/`messages`, wrong column types and null or empty ids (from
the statistics) are refused with the file, the column and the rows. A file whose identity is
already recorded in `_job.json` by an earlier attempt is not read again.

What a footer cannot show is checked per row in the preprocess stage (blank ids, ids repeated
within a work unit) and lands in errors/ with the file, row and field.
"""

from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.inputs.shape import RowShape, plain_type
from pipeline.storage import Storage
from schemas import InputFile

MESSAGES_TYPE = "list<struct<role: string, content: string>>"
# Footers are read this many files at a time: the check's wall time is latency-bound.
PARALLEL_FOOTERS = 16


class InputError(ValueError):
    """The input cannot be run as a job; the message lists every problem found."""


@dataclass
class InputReport:
    files: list[InputFile]
    rows: int
    footers_read: int = 0  # files whose footer this check read (the rest came from _job.json)

    @property
    def text_columns(self) -> dict[str, str]:
        return {f.uri: f.text_column for f in self.files}


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_messages(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return set(names) == {"role", "content"} and all(_is_string(v) or pa.types.is_null(v) for v in names.values())


COLUMN_CHECKS = {
    "id": (_is_string, "string"),
    "prompt": (lambda t: _is_string(t) or pa.types.is_null(t), "string"),
    "messages": (lambda t: _is_messages(t) or pa.types.is_null(t), MESSAGES_TYPE),
    "max_tokens": (lambda t: pa.types.is_integer(t) or pa.types.is_null(t), "integer"),
    "temperature": (lambda t: pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_null(t), "float"),
    "top_p": (lambda t: pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_null(t), "float"),
    "seed": (lambda t: pa.types.is_integer(t) or pa.types.is_null(t), "integer"),
    "n": (lambda t: pa.types.is_integer(t) or pa.types.is_null(t), "integer"),
    "stop": (
        lambda t: (
            pa.types.is_null(t)
            or (pa.types.is_list(t) and (_is_string(t.value_type) or pa.types.is_null(t.value_type)))
        ),
        "list<string>",
    ),
    "response_format": (lambda t: _is_string(t) or pa.types.is_null(t), "string (JSON text)"),
    "sampling": (lambda t: _is_string(t) or pa.types.is_null(t), "string (JSON text of an object)"),
    "lora": (lambda t: _is_string(t) or pa.types.is_null(t), "string (an adapter name of lora.adapters)"),
}


def inspect_inputs(
    input_uri: str, storage: Storage, known: Optional[list[InputFile]] = None, shape: Optional[RowShape] = None
) -> InputReport:
    """Check every input file against the columns `shape` (the config's `rows` section) names;
    `known` files (from an earlier attempt's `_job.json`) with the same size and version are
    taken as they were recorded."""
    listed = storage.expand_input(input_uri)
    if not listed:
        raise InputError(
            f"input_uri {input_uri!r} matches no Parquet file; set input_uri to a Parquet file, a folder holding "
            ".parquet files or a glob (s3://bucket/prompts/*.parquet); for OpenAI batch .jsonl files set input_format: "
            "openai_batch"
        )
    return inspect_listed(input_uri, listed, storage, known, shape)


def inspect_listed(
    input_uri: str,
    listed: dict[str, dict],
    storage: Storage,
    known: Optional[list[InputFile]] = None,
    shape: Optional[RowShape] = None,
) -> InputReport:
    """`inspect_inputs` of the files `listed` (uri -> size and version, as Storage lists them)."""
    shape = shape or RowShape()
    cached = {(f.uri, f.size, f.version): f for f in known or []}
    todo = [(uri, info) for uri, info in listed.items() if (uri, info["size"], info["version"]) not in cached]
    with ThreadPoolExecutor(PARALLEL_FOOTERS) as pool:
        checked = dict(zip((uri for uri, _ in todo), pool.map(lambda item: _inspect_file(storage, *item, shape), todo)))
    files, problems = [], []
    for uri, info in listed.items():
        if uri in checked:
            file, file_problems = checked[uri]
            problems += file_problems
        else:
            file = cached[(uri, info["size"], info["version"])]
        if file is not None:
            files.append(file)
    metadata_types = {f.uri: f.metadata_type for f in files if f.metadata_type and f.metadata_type != "null"}
    if len(set(metadata_types.values())) > 1:
        by_file = "; ".join(f"{f}: {t}" for f, t in metadata_types.items())
        problems.append(f"column 'metadata' has different types across files ({by_file})")
    if problems:
        raise InputError(
            f"input {input_uri!r} refused:\n  "
            + "\n  ".join(problems)
            + "\nFix these files (the input contract: docs/contracts.md, 'Input'), or move them out of input_uri."
        )
    return InputReport(files, sum(f.rows for f in files), footers_read=len(todo))


def _footer(storage: Storage, uri: str, size: int) -> pq.FileMetaData:
    with storage.open_ranged(uri, size=size) as f:
        return pq.ParquetFile(f).metadata


def _inspect_file(storage: Storage, uri: str, info: dict, shape: RowShape) -> tuple[Optional[InputFile], list[str]]:
    try:
        metadata = storage.retrying(f"read {uri}", lambda: _footer(storage, uri, info["size"]))
        schema = metadata.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as exc:
        return None, [f"{uri}: not a readable Parquet file ({type(exc).__name__}: {exc})"]
    problems = _check_schema(uri, schema, shape)
    if problems:
        return None, problems
    return InputFile(
        uri=uri,
        size=info["size"],
        version=info["version"],
        rows=metadata.num_rows,
        text_column=shape.text_column(schema.names)[0],
        metadata_type=str(plain_type(schema.field("metadata").type)) if "metadata" in schema.names else None,
    ), []


def _check_schema(uri: str, schema: pa.Schema, shape: RowShape) -> list[str]:
    rows, names = shape.rows, schema.names
    problems = [f"{uri}: missing column {name} (columns: {names})" for name in shape.missing(names)]
    if not rows.templated and len(shape.text_column(names)) != 1:
        which = "both" if shape.text_column(names) else "neither"
        problems.append(
            f"{uri}: has {which} of the columns {rows.prompt_column!r} and {rows.messages_column!r}; exactly one is "
            "required (or a template: rows.prompt_template, rows.messages_template)"
        )
    checks = {**COLUMN_CHECKS, "id": (lambda t: _is_string(t) or pa.types.is_integer(t), "string or integer")}
    file_names = {"id": rows.id_column, "prompt": rows.prompt_column, "messages": rows.messages_column}
    if rows.templated:
        file_names.update(prompt=None, messages=None)  # the template makes the text: neither column is read
    for name, (ok, expected) in checks.items():
        column = file_names.get(name, name)
        if column in names and not ok(schema.field(column).type):
            problems.append(f"{uri}: column {column!r} has type {schema.field(column).type}, expected {expected}")
    return problems


def short_name(uri: str) -> str:
    """A file's name without folders and suffix, safe for object keys (work unit ids)."""
    stem = posixpath.basename(uri.rstrip("/")).rsplit(".", 1)[0]
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)[:32] or "input"
