"""Job-level input checks, before any engine starts.

Reads only Parquet footers and the `id` column (streamed, one row group at a time): an input
that matches nothing, a corrupt file, a missing `id`, both or neither of `prompt`/`messages`,
wrong column types and duplicate ids are refused with the file, the column and example ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage import Storage
from schemas import PROMPT_TEXT_COLUMNS

MESSAGES_TYPE = "list<struct<role: string, content: string>>"


class InputError(ValueError):
    """The input cannot be run as a job; the message lists every problem found."""


@dataclass
class InputReport:
    files: list[str]
    rows: int
    rows_per_file: dict[str, int]
    text_columns: dict[str, str] = field(default_factory=dict)  # file -> "prompt" | "messages"
    metadata_type: pa.DataType | None = None
    id_digests: np.ndarray = field(default_factory=lambda: np.array([], dtype="S16"))  # sorted


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
}


def _examples(ids: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def inspect_inputs(input_uri: str, storage: Storage) -> InputReport:
    files = storage.expand_input(input_uri)
    if not files:
        raise InputError(f"input_uri {input_uri!r} matches no Parquet file")
    problems: list[str] = []
    rows_per_file: dict[str, int] = {}
    text_columns: dict[str, str] = {}
    metadata_types: dict[str, pa.DataType] = {}
    id_hashes: list[np.ndarray] = []

    for uri in files:
        fs, path = storage.fs(uri)
        try:
            with fs.open(path, "rb") as f:
                parquet = pq.ParquetFile(f)
                schema = parquet.schema_arrow
                rows_per_file[uri] = parquet.metadata.num_rows
                file_problems = _check_schema(uri, schema)
                problems += file_problems
                text_columns[uri] = next((c for c in PROMPT_TEXT_COLUMNS if c in schema.names), "")
                if "metadata" in schema.names:
                    metadata_types[uri] = schema.field("metadata").type
                if file_problems or "id" not in schema.names:
                    continue
                row = 0
                for batch in parquet.iter_batches(columns=["id"], batch_size=65536):
                    ids = batch.column(0).to_pylist()
                    bad = [row + i for i, v in enumerate(ids) if v is None or not v.strip()]
                    if bad:
                        problems.append(f"{uri}: column 'id' is null or empty at rows {bad[:5]}")
                    id_hashes.append(id_digests([v for v in ids if v is not None]))
                    row += len(ids)
        except (OSError, pa.ArrowException) as exc:
            problems.append(f"{uri}: not a readable Parquet file ({type(exc).__name__}: {exc})")

    hashes = np.sort(np.concatenate(id_hashes)) if id_hashes else np.array([], dtype="S16")
    repeated = set(hashes[1:][hashes[1:] == hashes[:-1]].tolist())
    if repeated:
        problems.append("column 'id' has duplicate ids: " + _name_duplicates(files, storage, repeated))
    distinct_metadata = {str(t) for t in metadata_types.values() if not pa.types.is_null(t)}
    if len(distinct_metadata) > 1:
        by_file = "; ".join(f"{f}: {t}" for f, t in metadata_types.items())
        problems.append(f"column 'metadata' has different types across files ({by_file})")
    if problems:
        raise InputError(f"input {input_uri!r} refused:\n  " + "\n  ".join(problems))
    metadata_type = next((t for t in metadata_types.values() if not pa.types.is_null(t)), None)
    return InputReport(files, sum(rows_per_file.values()), rows_per_file, text_columns, metadata_type, hashes)


def id_digests(ids) -> np.ndarray:
    """16-byte digests of ids: how sets of millions of ids are held (16 bytes each) and
    compared (sorted arrays, np.isin) across input checks, resume and the preprocess filter."""
    return np.array([hashlib.blake2b(v.encode(), digest_size=16).digest() for v in ids], dtype="S16")


def _name_duplicates(files: list[str], storage: Storage, repeated: set[bytes]) -> str:
    """Second pass, only when there are duplicates: which ids, in which files."""
    where: dict[str, list[str]] = {}
    for uri in files:
        fs, path = storage.fs(uri)
        with fs.open(path, "rb") as f:
            for batch in pq.ParquetFile(f).iter_batches(columns=["id"], batch_size=65536):
                ids = [v for v in batch.column(0).to_pylist() if v is not None]
                for value, h in zip(ids, id_digests(ids).tolist()):
                    if h in repeated:
                        where.setdefault(value, []).append(uri)
    listed = [f"{v!r} in {', '.join(files_[:3])}" for v, files_ in where.items() if len(files_) > 1]
    return f"{len(listed)} ids, e.g. " + "; ".join(listed[:5])


def _check_schema(uri: str, schema: pa.Schema) -> list[str]:
    problems = []
    if "id" not in schema.names:
        problems.append(f"{uri}: missing column 'id' (columns: {schema.names})")
    text_columns = [c for c in PROMPT_TEXT_COLUMNS if c in schema.names]
    if len(text_columns) != 1:
        which = "both" if text_columns else "neither"
        problems.append(f"{uri}: has {which} of the columns 'prompt' and 'messages'; exactly one is required")
    for name, (ok, expected) in COLUMN_CHECKS.items():
        if name in schema.names and not ok(schema.field(name).type):
            problems.append(f"{uri}: column {name!r} has type {schema.field(name).type}, expected {expected}")
    return problems
