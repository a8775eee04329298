"""The calibration's job check: the settings it found best, each run through the job itself on a
few units of its input, so that what the job adds around the engine counts too. It is run once
per setting, so it is shown beside vLLM alone's repeated runs and decides nothing: the
speculation policy recommends from those (pipeline/speculation/policy.py)."""

from __future__ import annotations

import io
import sys
from typing import Optional

import pyarrow.parquet as pq

from pipeline.commit.outputs import OutputLocation
from pipeline.inputs.units import UNIT_COLUMNS, plan_units, read_unit
from pipeline.config import InputRowsConfig, JobConfig
from pipeline.inputs import inspect_inputs
from pipeline.inputs.shape import RowShape
from pipeline.stages.engine import schedule_text
from pipeline.stages.stats import Acceptance
from pipeline.storage import Storage
from schemas.report import JobCheckRow


def job_check(
    config: JobConfig, storage: Storage, work_uri: str, rows: int, settings: dict[str, tuple[int, Optional[list]]]
) -> list[JobCheckRow]:
    """Each setting (label -> (depth, schedule)) run through the job itself on `rows` rows of
    its input: units spread over the input, copied to `work_uri/input/`, each setting's outputs
    in `work_uri/<n>/`. Calibration with vLLM alone leaves out what the job adds around the
    engine; on a CPU machine that decided the winner (docs/speculation.md). Engine start is
    excluded: it is the same for every setting."""
    from pipeline.job.runner import run_job

    shape = RowShape.for_job(config)
    units = plan_units(inspect_inputs(config.input_uri, storage, shape=shape).files, config.resources.rows_per_unit)
    spread = units[:: max(1, len(units) // max(1, -(-rows // config.resources.rows_per_unit)))]
    chosen_units, total = [], 0
    for unit in spread + [u for u in units if u not in spread]:  # spread over the input, then what is needed
        if total >= rows:
            break
        chosen_units.append(unit)
        total += unit.rows
    input_uri = storage.join(work_uri, "input")
    for unit in chosen_units:
        table = read_unit(storage, unit, shape)  # in the row layout: the runs below read it with the default `rows`
        keep = [
            c.name
            for c in UNIT_COLUMNS
            if c.name in ("id", unit.text_column) or table.column(c.name).null_count < table.num_rows
        ]
        if table.column("metadata").null_count < table.num_rows:
            keep.append("metadata")
        buffer = io.BytesIO()
        pq.write_table(table.select(keep), buffer)
        storage.write_bytes(storage.join(input_uri, f"{unit.unit_id}.parquet"), buffer.getvalue())
    results = []
    for n, (label, (depth, schedule)) in enumerate(settings.items()):
        spec = config.speculative.model_copy(
            update={
                "enabled": depth > 0,
                "num_speculative_tokens": depth or config.speculative.num_speculative_tokens,
                "depth_schedule": schedule,
                "guard": None,
                "trial": None,  # each run measures its one setting
                "probe": config.speculative.probe.model_copy(update={"rows": 0}),
            }
        )
        run_config = config.model_copy(
            update={
                "input_uri": input_uri,
                "output_uri": storage.join(work_uri, f"run-{n}"),
                "speculative": spec,
                "rows": InputRowsConfig(),
            }
        )
        print(f"[calibrate] job check: {label} ...", file=sys.stderr, flush=True)
        run_job(run_config, progress=False, restart=True)
        stats = OutputLocation(storage, run_config.output_uri).read_table("stats").to_pylist()
        first = min(r["started_at"] for r in stats)
        last = max(r["started_at"] + r["wall_seconds"] for r in stats)
        generated = sum(r["generated_tokens"] for r in stats)
        acceptance = Acceptance(
            sum(r["num_drafts"] for r in stats),
            sum(r["draft_tokens"] for r in stats),
            sum(r["accepted_tokens"] for r in stats),
        )
        results.append(
            JobCheckRow(
                setting=label,
                depth=depth,
                schedule=schedule_text(schedule) if schedule else None,
                rows=sum(r["rows"] for r in stats),
                generated_tokens=generated,
                seconds=last - first,
                tokens_per_second=generated / (last - first) if last > first else 0.0,
                mean_acceptance_length=acceptance.mean_acceptance_length,
                chosen=False,
            )
        )
        print(
            f"[calibrate] job check: {label}: {results[-1].tokens_per_second:,.0f} tok/s", file=sys.stderr, flush=True
        )
    return results
