"""Ids unique across the whole job, found before any engine starts.

One pass over the id columns only (the `rows` section's id column, as units read it), several
files at a time, a batch of rows at a time. Each id becomes two 64-bit hashes (pandas'
hash_array under two keys: 128 bits, so two different ids of a 10M-row job collide with a
probability near 1e-25); sorting the hashes puts equal ids side by side. The first row of an
id (in input order: files in order, rows in order) is generated; each later one is its row's
`duplicate_id` error, naming both places. At 10M rows the driver holds about 60 bytes a row while it
sorts (measured: benchmarks/rows_cost.py). A resume on the same input files reuses the pass recorded in `_job.json`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage
from schemas import DuplicateId, InputFile

PARALLEL_FILES = 8
BATCH_ROWS = 65536
HASH_KEYS = ("specbatch-ids-01", "specbatch-ids-02")  # pandas wants 16 characters
MAX_DUPLICATES = 10_000  # more than this many repeated ids: the input is not what the user thinks it is


class TooManyDuplicateIds(ValueError):
    """The input repeats more ids than a job records one by one."""


def find_duplicate_ids(storage: Storage, files: list[InputFile], shape: RowShape) -> list[DuplicateId]:
    """Every row whose id an earlier row of the job has, with that earlier row."""
    with ThreadPoolExecutor(PARALLEL_FILES) as pool:
        parts = list(pool.map(lambda f: _file_hashes(storage, f, shape), files))
    if not parts:
        return []
    low, high = (np.concatenate([h[:, k] for h, _ in parts]) for k in (0, 1))
    valid = np.concatenate([v for _, v in parts])
    starts = np.cumsum([0] + [len(h) for h, _ in parts])  # each file's first row in the job's order
    del parts  # the per-file arrays: concatenated above

    def where(position: int) -> tuple[str, int]:
        i = int(np.searchsorted(starts, position, side="right")) - 1
        return files[i].uri, int(position - starts[i])

    positions = np.flatnonzero(valid)
    del valid
    order = positions[np.lexsort((positions, high[positions], low[positions]))]  # equal ids together, in input order
    low, high = low[order], high[order]
    same = (low[1:] == low[:-1]) & (high[1:] == high[:-1])
    if not same.any():
        return []
    repeats = np.flatnonzero(same) + 1  # places in `order` of rows whose id the row before has
    first_of_run = np.maximum.accumulate(np.where(np.concatenate([[True], ~same]), np.arange(len(order)), 0))
    if len(repeats) > MAX_DUPLICATES:
        (source, row), (first_source, first_row) = where(order[repeats[0]]), where(order[first_of_run[repeats[0]]])
        raise TooManyDuplicateIds(
            f"the input repeats {len(repeats):,} ids (more than {MAX_DUPLICATES:,} are refused): e.g. row {row} of "
            f"{source} has the id of row {first_row} of {first_source}. Check rows.id_column, or give the rows ids of "
            "their own"
        )
    duplicates = []
    for place in repeats:
        (source, row), (first_source, first_row) = where(order[place]), where(order[first_of_run[place]])
        duplicates.append(DuplicateId(source=source, row=row, first_source=first_source, first_row=first_row))
    return sorted(duplicates, key=lambda d: (d.source, d.row))


def _file_hashes(storage: Storage, file: InputFile, shape: RowShape) -> tuple[np.ndarray, np.ndarray]:
    """The file's ids as (rows x 2) hashes, and which rows have an id at all (null or blank: the row's own error)."""
    import pandas as pd  # Ray Data's own dependency

    def read() -> list[pa.Table]:
        with storage.open_ranged(file.uri, size=file.size) as f:
            parquet = pq.ParquetFile(f, pre_buffer=False)
            columns = shape.source_columns(parquet.schema_arrow.names, ["id"])
            return [
                shape.apply(pa.Table.from_batches([b])).select(["id"])
                for b in parquet.iter_batches(BATCH_ROWS, columns=columns, use_threads=False)
            ]

    tables = storage.retrying(f"read {file.uri}", read)
    ids = pa.concat_tables(tables).column("id").combine_chunks() if tables else pa.array([], pa.string())
    valid = pc.fill_null(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(ids)), 0), False).to_numpy(
        zero_copy_only=False
    )
    values = pc.fill_null(ids, "").to_numpy(zero_copy_only=False)
    hashes = np.stack([pd.util.hash_array(values, hash_key=key, categorize=False) for key in HASH_KEYS], axis=1)
    return hashes.astype(np.uint64), valid
