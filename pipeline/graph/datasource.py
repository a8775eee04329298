"""Work units as a Ray Data datasource: one read task per unit, so Ray Data's streaming and
backpressure are kept, each unit reaches the engine actors as one block, and a committed unit
is never read from the input again."""

from __future__ import annotations

from typing import Optional

from ray.data import DataContext, Datasource
from ray.data.block import BlockMetadata
from ray.data.datasource import ReadTask

from pipeline.inputs.units import WorkUnit, read_unit
from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage


class UnitDatasource(Datasource):
    """One read task per unit, in plan order."""

    def __init__(self, units: list[WorkUnit], storage: Storage, shape: RowShape):
        self.units, self.storage, self.shape = units, storage, shape

    def estimate_inmemory_data_size(self) -> Optional[int]:
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: Optional[int] = None, data_context: Optional[DataContext] = None
    ) -> list[ReadTask]:
        storage, shape = self.storage, self.shape
        return [
            ReadTask(
                lambda unit=unit: [read_unit(storage, unit, shape)],
                BlockMetadata(num_rows=unit.rows, size_bytes=None, input_files=[unit.source], exec_stats=None),
            )
            for unit in self.units
        ]

    def get_name(self) -> str:
        return "WorkUnits"
