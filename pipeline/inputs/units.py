"""Work units: fixed row ranges of the input files, planned from footers alone.

A unit is (file, first row, row count), at most `resources.rows_per_unit` rows, and its id is
derived from the file's identity (URI, size, version) and the range: the same input always
gives the same units, whatever the run, its block boundaries or its replicas. A unit is what
one engine actor generates and commits at once, and what a resume skips.

`read_unit` reads one unit from the row groups that hold its range; `pipeline/graph/datasource.py`
makes each unit a Ray Data read task (this module stays free of Ray: planning a resume needs
no Ray import).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.inputs.check import short_name
from pipeline.inputs.shape import MESSAGES_TYPE, SAMPLING_FIELDS, SHAPE_COLUMNS, RowShape
from pipeline.storage import Storage
from schemas import HeadUnits, InputFile

GROUPED = "_grouped"  # prefix-grouped units' rows, in the output location (pipeline/graph/regroup.py)
# The columns every unit's block has, whatever its file's columns; missing ones are nulls.
UNIT_COLUMNS = [
    pa.field("id", pa.string()),
    pa.field("prompt", pa.string()),
    pa.field("messages", MESSAGES_TYPE),
    *SAMPLING_FIELDS,
    pa.field("lora", pa.string()),
]
# Where a row came from; a grouped copy of the input (pipeline/graph/regroup.py) carries them.
ORIGIN_COLUMNS = ("source", "row")


@dataclass(frozen=True)
class WorkUnit:
    unit_id: str
    source: str
    size: int  # of the file: ranged reads need no HEAD request
    first_row: int
    rows: int
    text_column: str


def unit_id_for(file: InputFile, first_row: int, rows: int) -> str:
    identity = f"{file.uri}\0{file.size}\0{file.version}\0{first_row}\0{rows}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return f"{short_name(file.uri)}-r{first_row:010d}-{digest}"


def plan_units(files: Iterable[InputFile], rows_per_unit: int, head: Optional[HeadUnits] = None) -> list[WorkUnit]:
    """Units of `rows_per_unit` rows, file by file; the first `head.rows` rows of the job in
    units of `head.rows_per_unit` (schemas.HeadUnits)."""
    units, before = [], 0  # rows of the earlier files
    for f in files:
        start = 0
        while start < f.rows:
            left_in_head = head.rows - (before + start) if head else 0
            size = min(head.rows_per_unit, left_in_head) if left_in_head > 0 else rows_per_unit
            size = min(size, f.rows - start)
            units.append(WorkUnit(unit_id_for(f, start, size), f.uri, f.size, start, size, f.text_column))
            start += size
        before += f.rows
    return units


def read_unit(storage: Storage, unit: WorkUnit, shape: RowShape | None = None) -> pa.Table:
    """The unit's rows, read from the row groups that hold them, in the common unit layout:
    UNIT_COLUMNS, metadata (if the file has it), where each row came from, and what `shape`
    (the config's `rows` section) adds: a template's errors, the copied columns. A read that
    fails on a store gone silent is read again, for up to storage.outage_seconds."""
    return storage.retrying(f"read {unit.source}", lambda: _read_rows(storage, unit, shape or RowShape()))


LAYOUT = [*(f.name for f in UNIT_COLUMNS), "metadata", "copied"]  # what a unit's block carries, by the layout's names


def _read_rows(storage: Storage, unit: WorkUnit, shape: RowShape) -> pa.Table:
    with storage.open_ranged(unit.source, size=unit.size) as f:
        parquet = pq.ParquetFile(f)
        groups, group_start, offset = [], 0, None
        for i in range(parquet.metadata.num_row_groups):
            n = parquet.metadata.row_group(i).num_rows
            if group_start + n > unit.first_row and group_start < unit.first_row + unit.rows:
                groups.append(i)
                offset = group_start if offset is None else offset
            group_start += n
        names = parquet.schema_arrow.names
        # written in the layout already (pipeline/graph/regroup.py); a job's outputs, read by a chained job, are not
        grouped_copy = f"/{GROUPED}/" in unit.source and all(c in names for c in ORIGIN_COLUMNS)
        if grouped_copy:
            wanted = [c for c in (*LAYOUT, *SHAPE_COLUMNS, *ORIGIN_COLUMNS) if c in names]
        else:
            wanted = shape.source_columns(names, LAYOUT)
        table = parquet.read_row_groups(groups, columns=wanted).slice(unit.first_row - (offset or 0), unit.rows)
    if table.num_rows != unit.rows:
        raise IOError(
            f"{unit.source}: unit {unit.unit_id} expected {unit.rows} rows from row {unit.first_row}, read "
            f"{table.num_rows}"
        )
    if not grouped_copy:
        table = shape.apply(table)
    names = table.column_names
    columns = {}
    for field in UNIT_COLUMNS:
        columns[field.name] = (
            table.column(field.name).cast(field.type) if field.name in names else pa.nulls(unit.rows, field.type)
        )
    columns["metadata"] = table.column("metadata") if "metadata" in names else pa.nulls(unit.rows)
    columns.update((c, table.column(c)) for c in SHAPE_COLUMNS if c in names)
    n = unit.rows
    if grouped_copy:  # a grouped copy's rows name the input file and row they came from
        columns.update((c, table.column(c)) for c in ORIGIN_COLUMNS)
    else:
        columns.update(
            source=pa.array([unit.source] * n, pa.string()),
            row=pa.array(range(unit.first_row, unit.first_row + n), pa.int64()),
        )
    columns.update(
        text_column=pa.array([unit.text_column] * n, pa.string()),
        unit_id=pa.array([unit.unit_id] * n, pa.string()),
        unit_rows=pa.array([n] * n, pa.int64()),
    )
    return pa.table(columns)


def unit_of(batch: pa.Table) -> tuple[str, str, int]:
    """(unit id, source, first row) of a block that must hold exactly one whole unit; a block
    that holds part of a unit, or two, is refused (committing it would lose or mix rows)."""
    units = batch.column("unit_id").unique().to_pylist()
    expected = batch.column("unit_rows")[0].as_py() if batch.num_rows else 0
    if len(units) != 1 or batch.num_rows != expected:
        raise RuntimeError(
            f"a block holds {batch.num_rows} rows of units {units[:3]}, expected one whole unit of {expected}"
        )
    return units[0], batch.column("source")[0].as_py(), min(batch.column("row").to_pylist())
