"""The grouped copy of a job's input: its rows in prefix order (pipeline/inputs/prefixes.py),
written once under OUTPUT_URI/_grouped/<token>/ before any engine starts. The job's units are
then row ranges of the copy, in order, so rows that share a prefix reach one engine together.

A shuffle on Ray tasks, through the object store: a split task reads one range of an input
file (READ_ROWS rows at most) and cuts it by destination file; a write task gathers its file's
pieces, orders them and writes one Parquet file of 65,536 rows (whole units), in row groups of a unit.
Each row keeps its `source` file and `row`, so outputs and errors name where it came from. At
10M prompts of 1 KB: 153 split and 153 write tasks, at most 23k pieces, each byte read and
written once; the driver holds the order (8 bytes a row) and the pieces' references.
"""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline.inputs.units import GROUPED
from pipeline.inputs.units import WorkUnit, plan_units, read_unit
from pipeline.inputs.prefixes import KINDS, rows_per_grouped_file
from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage
from schemas import InputFile

READ_ROWS = 65536


def write_grouped_copy(
    storage: Storage,
    output_uri: str,
    files: list[InputFile],
    order: np.ndarray,
    kinds: np.ndarray,
    rows_per_unit: int,
    shape: RowShape,
) -> list[InputFile]:
    """Writes the copy (an earlier, unrecorded copy goes first) and returns its files in order,
    its rows in the unit layout (`shape`: the config's `rows` section, applied once here)."""
    root = storage.join(output_uri, GROUPED)
    storage.delete(root, recursive=True)
    folder = storage.join(root, uuid.uuid4().hex[:12])
    file_of_row, position_of_row, file_kinds = _destinations(order, kinds, rows_per_unit)
    pieces: list[list] = [[] for _ in file_kinds]
    first_row_of = dict(zip((f.uri for f in files), np.cumsum([0] + [f.rows for f in files])))
    for unit in plan_units(files, READ_ROWS):
        rows = slice(first_row_of[unit.source] + unit.first_row, first_row_of[unit.source] + unit.first_row + unit.rows)
        touched = np.unique(file_of_row[rows])
        refs = _split.options(num_returns=len(touched)).remote(
            storage, unit, shape, file_of_row[rows], position_of_row[rows], touched
        )
        for f, ref in zip(touched, refs if len(touched) > 1 else [refs]):
            pieces[f].append(ref)
    uris = [storage.join(folder, f"{i:05d}.{KINDS[kind]}.parquet") for i, kind in enumerate(file_kinds)]
    written = ray.get(
        [_write.remote(storage, uri, rows_per_unit, *file_pieces) for uri, file_pieces in zip(uris, pieces)]
    )
    listed = storage.list_details(folder, ".parquet")
    return [
        InputFile(
            uri=uri,
            size=listed[uri]["size"],
            version=listed[uri]["version"],
            rows=rows,
            text_column=KINDS[kind],
            metadata_type=metadata_type,
        )
        for uri, kind, (rows, metadata_type) in zip(uris, file_kinds, written)
    ]


def _destinations(order: np.ndarray, kinds: np.ndarray, rows_per_unit: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Each input row's file of the copy and its place there. Sorted rows of one kind are
    contiguous (the kind leads the order); a file holds one kind and a whole number of units."""
    per_file = rows_per_grouped_file(rows_per_unit)
    sorted_kinds = kinds[order]
    file_of_sorted = np.empty(len(order), np.int64)
    position_of_sorted = np.empty(len(order), np.int64)
    file_kinds: list[int] = []
    for kind in np.unique(sorted_kinds):
        at = np.flatnonzero(sorted_kinds == kind)
        within = np.arange(len(at))
        file_of_sorted[at] = len(file_kinds) + within // per_file
        position_of_sorted[at] = within % per_file
        file_kinds += [int(kind)] * -(-len(at) // per_file)
    file_of_row, position_of_row = np.empty_like(file_of_sorted), np.empty_like(position_of_sorted)
    file_of_row[order], position_of_row[order] = file_of_sorted, position_of_sorted
    return file_of_row, position_of_row, file_kinds


@ray.remote
def _split(
    storage: Storage, unit: WorkUnit, shape: RowShape, dest: np.ndarray, position: np.ndarray, touched: np.ndarray
):
    table = (
        read_unit(storage, unit, shape)
        .drop_columns(["unit_id", "unit_rows", "text_column"])
        .append_column("position", pa.array(position))
    )
    by_file = np.argsort(dest, kind="stable")
    table, dest = table.take(pa.array(by_file)), dest[by_file]
    bounds = np.searchsorted(dest, touched, side="left"), np.searchsorted(dest, touched, side="right")
    pieces = [table.slice(a, b - a) for a, b in zip(*bounds)]
    return pieces if len(pieces) > 1 else pieces[0]


@ray.remote
def _write(storage: Storage, uri: str, rows_per_unit: int, *pieces: pa.Table) -> tuple[int, str]:
    table = pa.concat_tables(pieces, promote_options="permissive").sort_by("position").drop_columns(["position"])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=rows_per_unit)
    storage.write_bytes(uri, sink.getvalue().to_pybytes())
    return table.num_rows, str(table.schema.field("metadata").type)
