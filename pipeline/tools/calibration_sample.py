"""The calibration's sample of the job's own prompts: random input rows, prepared exactly as the
job prepares them."""

from __future__ import annotations

import random
from typing import Any

import pyarrow.parquet as pq

from pipeline.inputs.units import LAYOUT
from pipeline.config import JobConfig
from pipeline.inputs import inspect_inputs
from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage


def sample_prompts(config: JobConfig, storage: Storage, n: int, seed: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Up to `n` random input rows prepared exactly as the job prepares them (prompt token ids
    and resolved sampling parameters); rows the job would refuse are skipped. Reads only the
    row groups holding sampled rows. Returns (prepared rows, rows skipped)."""
    from pipeline.stages.preprocess import Preprocessor, RowError

    shape = RowShape.for_job(config)
    inputs = inspect_inputs(config.input_uri, storage, shape=shape)
    rng = random.Random(seed)
    candidates = rng.sample(range(inputs.rows), min(inputs.rows, 2 * n + 16))  # spare rows for the refused ones
    wanted: dict[str, dict[int, int]] = {}  # file -> local row -> sample order
    offset = 0
    order = {g: i for i, g in enumerate(candidates)}
    for file in inputs.files:
        uri, rows = file.uri, file.rows
        for g in candidates:
            if offset <= g < offset + rows:
                wanted.setdefault(uri, {})[g - offset] = order[g]
        offset += rows

    preprocessor = Preprocessor.for_job(config, storage)
    found: list[tuple[int, dict[str, Any]]] = []
    skipped = 0
    for uri, local_rows in wanted.items():
        text_column = inputs.text_columns[uri]
        fs, path = storage.fs(uri)
        with fs.open(path, "rb") as f:
            parquet = pq.ParquetFile(f)
            columns = shape.source_columns(parquet.schema_arrow.names, LAYOUT)  # what a unit carries
            start = 0
            for group in range(parquet.metadata.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                inside = [r for r in local_rows if start <= r < start + size]
                if inside:
                    table = shape.apply(
                        parquet.read_row_group(group, columns=columns, use_threads=False)
                    )  # as read_unit
                    for r in inside:
                        row = table.slice(r - start, 1).to_pylist()[0]
                        try:
                            found.append((local_rows[r], {"id": row["id"], **preprocessor.prepare(row, text_column)}))
                        except RowError:
                            skipped += 1
                start += size
    found.sort(key=lambda item: item[0])
    return [row for _, row in found[:n]], skipped
