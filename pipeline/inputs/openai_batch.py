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
from pipeline.inputs.openai_requests import LineProblem, convert_request, row_schema, unsupported_row
from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage
from schemas import InputFile

CONVERTED = "_inputs"
ROWS_PER_BATCH = 8192  # lines parsed before a row group is written
LISTED_PROBLEMS = 20
PARALLEL_FILES = 8
MARKERS_PER_READ = 256  # commit markers the export holds at once


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
    content = (
        identity_hash(uri, size, version) if unsupported == "refuse" else identity_hash(uri, size, version, unsupported)
    )
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


def _convert_file(
    storage: Storage, uri: str, info: dict, folder: str, unsupported: str
) -> tuple[list[str], list[str], int]:
    """Convert one JSONL file -> (converted URIs, problems (the first LISTED_PROBLEMS), count of
    problems). Nothing is kept unless every line converts (or, with unsupported_requests:
    errors, becomes its error row)."""
    base = converted_base(uri, info["size"], info["version"], unsupported)
    # read again from its first line when the store fails it for a while (storage.outage_seconds)
    conversion = storage.retrying(f"read {uri}", lambda: _converted(storage, uri, folder, base, unsupported))
    if conversion.count:
        return [], conversion.problems, conversion.count
    sinks = conversion.sinks
    marker = {
        "source": uri,
        "size": info["size"],
        "version": info["version"],
        "lines": conversion.lines,
        "files": {k: posixpath.basename(s.uri) for k, s in sinks.items()},
        "rows": {k: s.rows for k, s in sinks.items()},
        "unsupported_lines": conversion.unsupported,
    }
    storage.write_json(storage.join(folder, f"{base}.json"), marker)
    return sorted(s.uri for s in sinks.values()), [], 0


def _converted(storage: Storage, uri: str, folder: str, base: str, unsupported: str) -> _FileConversion:
    """One pass over the file; its converted files kept only when every line converted."""
    conversion = _FileConversion(storage, uri, folder, base, unsupported)
    fs, path = storage.fs(uri)
    try:
        with fs.open(path, "rb") as f:
            for line, raw in enumerate(f, 1):
                conversion.take(line, raw)
        conversion.check_duplicates()
    except BaseException:
        conversion.close(keep=False)
        raise
    conversion.close(keep=conversion.count == 0)
    return conversion


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
        results = list(
            pool.map(lambda item: _convert_file(storage, item[0], item[1], scratch or folder, unsupported), todo)
        )
    problems, count = [], 0
    for (uri, _), (files, file_problems, file_count) in zip(todo, results):
        converted[uri] = files
        problems += file_problems
        count += file_count
    if count:
        shown = problems[:LISTED_PROBLEMS]
        head = f"{count} problem{'s' if count > 1 else ''}" + (
            f", the first {len(shown)}" if count > len(shown) else ""
        )
        raise InputError(
            f"OpenAI batch input {input_uri!r} refused ({head}):\n  "
            + "\n  ".join(shown)
            + "\nFix these lines (each a request of OpenAI's batch format with a custom_id unique in its file) and "
            "run again"
            + (
                ", or set unsupported_requests: errors to run the rest and get each such line back as an error line."
                if unsupported == "refuse"
                else "."
            )
        )
    return [u for uri in sources for u in converted[uri]]


def inspect_job_inputs(
    config, storage: Storage, known: Optional[list[InputFile]] = None, scratch: Optional[str] = None
) -> InputReport:
    """The job's input check (`pipeline.inputs.inspect_inputs`), after converting OpenAI batch
    files when `config.input_format` is openai_batch (`scratch`: see `convert_batch_files`)."""
    if config.input_format == "parquet":
        return inspect_inputs(config.input_uri, storage, known, RowShape.for_job(config))
    converted = convert_batch_files(
        config.input_uri, storage, storage.join(config.output_uri, CONVERTED), scratch, config.unsupported_requests
    )
    if not converted:
        raise InputError(
            f"input_uri {config.input_uri!r}: its JSONL files hold no request; point input_uri at files with request "
            "lines"
        )
    now, names = {_source_key(u) for u in converted}, {posixpath.basename(u) for u in converted}
    replaced = sorted(
        f.uri for f in known or [] if _source_key(f.uri) in now and posixpath.basename(f.uri) not in names
    )
    if replaced:
        raise InputError(
            f"OpenAI batch files (or unsupported_requests) changed since this job started at {config.output_uri} "
            "(their earlier conversions: "
            + ", ".join(replaced)
            + "). Use a new output_uri, or rerun with --restart to start over."
        )
    with ThreadPoolExecutor(PARALLEL_FILES) as pool:
        reports = list(pool.map(lambda uri: inspect_inputs(uri, storage, known), converted))
    files = [f for r in reports for f in r.files]
    return InputReport(files, sum(f.rows for f in files), footers_read=sum(r.footers_read for r in reports))


# ---------------------------------------------------------------- export
