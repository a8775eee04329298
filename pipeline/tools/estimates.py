"""The dry run's estimates (`specbatch run CONFIG --dry-run`, pipeline/tools/plan.py), which
refuse nothing:

- prompt tokens: a seeded random sample of about SAMPLE_ROWS rows, prepared by the preprocess
  stage's own Preprocessor (the model's tokenizer, the chat template, the system prompt, the
  row's sampling overrides), reading at most SAMPLE_ROW_GROUPS row groups. Per input kind
  (`prompt`, `messages`): row groups are drawn with probability proportional to their rows,
  then the same number of rows uniformly within each, so every row is as likely to be sampled
  and the sample mean x the kind's rows estimates its tokens. Rows the stage would refuse count
  0 tokens (they never reach the engine). With fewer rows than the sample, every row is counted.
- output tokens: each row's own max_tokens x n (its overrides, else the job's), an upper bound
  (rows stop earlier): summed over every row when the sample is all of them, else each kind's
  sample mean x its rows, and sampled rows that ask for more than the job's are reported.
- GPU-hours and cost, when the job's calibration exists (OUTPUT_URI/calibration/calibration.json,
  written by `specbatch calibrate`): the output bound of the rows left / its measured generated
  tokens per second per GPU at the job's depth and the highest concurrency measured (the job's
  steady state), priced with pipeline/tools/prices.py (an upper bound, like the tokens).
"""

from __future__ import annotations

import bisect
import json
import random
from collections import Counter, defaultdict
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.inputs.units import UNIT_COLUMNS, WorkUnit
from pipeline.config import JobConfig
from pipeline.inputs import InputReport
from pipeline.inputs.shape import RowShape
from pipeline.speculation.calibrations import JobCalibration
from pipeline.speculation.policy import depth_at
from pipeline.stages.engine import schedule_text
from pipeline.storage import Storage
from schemas.plan import CostEstimate, TokenEstimate

SAMPLE_ROWS = 256
SAMPLE_ROW_GROUPS = 16
MIN_SAMPLE_PER_KIND = 32  # a kind with few rows still gets a sample of its own
SAMPLE_SEED = 0
NO_CALIBRATION = "run `specbatch calibrate CONFIG` or `specbatch pilot CONFIG` for GPU-hours and cost"


# ---------------------------------------------------------------- tokens


def estimate_tokens(config: JobConfig, storage: Storage, inputs: InputReport, todo: list[WorkUnit]) -> TokenEstimate:
    """Prompt tokens estimated from a sample prepared as the preprocess stage prepares rows,
    per input kind; output tokens bounded by max_tokens x n (module docstring)."""
    from pipeline.stages.preprocess import Preprocessor, check_id, check_model, check_supported_line
    from pipeline.stages.sampling import RowError

    preprocessor = Preprocessor.for_job(config, storage)
    rng = random.Random(SAMPLE_SEED)
    by_kind: dict[str, list] = defaultdict(list)
    for f in inputs.files:
        by_kind[f.text_column].append(f)
    total = inputs.rows
    bound = config.sampling.max_tokens * config.sampling.n
    tokens_by_kind, mean_by_kind, bound_by_kind = {}, {}, {}
    sampled = groups_read = errors = above = 0
    error_kinds: Counter = Counter()
    exact = True
    for kind, files in sorted(by_kind.items()):
        rows = sum(f.rows for f in files)
        if not rows:
            continue
        want = min(rows, max(MIN_SAMPLE_PER_KIND, round(SAMPLE_ROWS * rows / total)))
        draws = min(want, max(1, int(SAMPLE_ROW_GROUPS * rows / total)))
        exact &= want == rows
        counts: list[int] = []
        bounds: list[int] = []  # each row's own max_tokens x n; 0 for a row the stage refuses
        batch_lines = config.input_format == "openai_batch"  # their rows' metadata may hold an unsupported line
        for row in _sample_kind(storage, files, rows, want, draws, rng, RowShape.for_job(config), batch_lines):
            groups_read += row is None
            if row is None:
                continue
            try:
                check_id(row)
                check_supported_line(row, row.get("metadata"))
                if preprocessor.served_names is not None:
                    check_model(row.get("metadata"), preprocessor.served_names)
                prepared = preprocessor.prepare(row, kind)
            except RowError as err:
                errors += 1
                error_kinds[err.kind] += 1
                counts.append(0)
                bounds.append(0)
                continue
            values = json.loads(prepared["sampling"])
            above += values["max_tokens"] * values["n"] > bound
            counts.append(len(prepared["prompt_token_ids"]))
            bounds.append(values["max_tokens"] * values["n"])
        sampled += len(counts)
        mean_by_kind[kind] = sum(counts) / len(counts) if counts else 0.0
        bound_by_kind[kind] = sum(bounds) / len(bounds) if bounds else float(bound)
        tokens_by_kind[kind] = round(mean_by_kind[kind] * rows)
    left_by_kind = Counter()
    for u in todo:
        left_by_kind[u.text_column] += u.rows
    return TokenEstimate(
        sample_rows=sampled,
        sample_row_groups=groups_read,
        sample_seed=SAMPLE_SEED,
        sample_error_rows=errors,
        sample_error_kinds=dict(error_kinds),
        exact=exact,
        prompt_tokens=sum(tokens_by_kind.values()),
        prompt_tokens_by_kind=tokens_by_kind,
        prompt_tokens_left=round(sum(mean_by_kind.get(k, 0.0) * n for k, n in left_by_kind.items())),
        output_tokens_upper_bound=round(
            sum(bound_by_kind[k] * sum(f.rows for f in fs) for k, fs in by_kind.items() if k in bound_by_kind)
        ),
        output_tokens_upper_bound_left=round(sum(bound_by_kind.get(k, bound) * n for k, n in left_by_kind.items())),
        sample_rows_above_bound=above,
    )


def _sample_kind(
    storage: Storage,
    files: list,
    rows: int,
    want: int,
    draws: int,
    rng: random.Random,
    shape: RowShape,
    with_metadata: bool = False,
):
    """Yields None for each row group read, then its sampled rows in the unit layout
    (pipeline/inputs/units.UNIT_COLUMNS; `metadata` only `with_metadata`) with its `source` and
    `row`. Every row, when `want` is all of them; otherwise `draws` row groups drawn proportional to
    their rows (with replacement: a group drawn twice gives twice the rows), and want/draws rows
    uniformly within each."""
    starts, offset = [], 0
    for f in files:
        starts.append(offset)
        offset += f.rows
    if want >= rows:
        picks = {f.uri: None for f in files}  # every row group of every file
    else:
        picks: dict[str, Counter] = defaultdict(Counter)  # file -> row in the file -> draws landing there
        for position in sorted(rng.randrange(rows) for _ in range(draws)):
            i = bisect.bisect_right(starts, position) - 1
            picks[files[i].uri][position - starts[i]] += 1
    per_draw = [want // draws + (1 if i < want % draws else 0) for i in range(draws)]
    draw = 0
    for f in files:
        if f.uri not in picks:
            continue
        with storage.open_ranged(f.uri, size=f.size) as handle:
            parquet = pq.ParquetFile(handle)
            names = parquet.schema_arrow.names
            columns = shape.source_columns(
                names, [c.name for c in UNIT_COLUMNS] + (["metadata"] if with_metadata else [])
            )
            first = 0
            for group in range(parquet.metadata.num_row_groups):
                size = parquet.metadata.row_group(group).num_rows
                landed = (
                    1 if picks[f.uri] is None else sum(n for r, n in picks[f.uri].items() if first <= r < first + size)
                )
                if landed and size:
                    read = shape.apply(
                        parquet.read_row_group(group, columns=columns, use_threads=False)
                    )  # as read_unit
                    table = _unit_layout(read)
                    if "metadata" in read.column_names:
                        table = table.append_column("metadata", read.column("metadata"))
                    yield None
                    if picks[f.uri] is None:
                        chosen = range(size)
                    else:
                        take = sum(per_draw[draw : draw + landed])
                        draw += landed
                        chosen = sorted(rng.sample(range(size), min(size, take)))
                    for r in chosen:  # where it came from, as read_unit's rows say it (the row errors name it)
                        yield {**table.slice(r, 1).to_pylist()[0], "source": f.uri, "row": first + r}
                first += size


def _unit_layout(table: pa.Table) -> pa.Table:
    """The columns a unit's block carries to the preprocess stage (as pipeline/inputs/units.read_unit)."""
    n, names = table.num_rows, table.column_names
    columns = {
        field.name: table.column(field.name).cast(field.type) if field.name in names else pa.nulls(n, field.type)
        for field in UNIT_COLUMNS
    }
    columns.update((c, table.column(c)) for c in ("template_error", "template_field") if c in names)
    return pa.table(columns)


# ---------------------------------------------------------------- GPU-hours and cost


def estimate_cost(
    config: JobConfig, found: JobCalibration, output_tokens: int, warnings: list[str]
) -> tuple[Optional[CostEstimate], Optional[str]]:
    """(the estimate, None), or (None, why there is none). `found`: the calibration the run
    would use (pipeline/speculation/calibrations.job_calibration)."""
    from pipeline.tools.prices import load_prices

    calibration, uri = found.report, found.uri
    if calibration is None:
        return None, f"{found.where}: {NO_CALIBRATION}"
    top = max(calibration.concurrencies)
    spec = config.speculative
    schedule = schedule_text(spec.depth_schedule) if spec.enabled and spec.depth_schedule else None
    depth = depth_at(config, top) if spec.enabled else 0
    row = next((r for r in calibration.rows if r.concurrency == top and schedule and r.schedule == schedule), None)
    if row is None:
        schedule = None
        row = next(
            (r for r in calibration.rows if r.concurrency == top and r.depth == depth and r.schedule is None), None
        )
    if row is None:
        measured = sorted({r.depth for r in calibration.rows if r.concurrency == top})
        return None, (
            f"the calibration at {uri} measured no depth {depth} at {top} sequences at once (depths measured: "
            f"{', '.join(map(str, measured))}): run `specbatch calibrate CONFIG` with depth {depth}"
        )
    if calibration.accelerator != config.resources.accelerator:
        warnings.append(
            f"the calibration was measured on {calibration.accelerator}; this job runs on "
            f"{config.resources.accelerator}: its GPU-hours are those of {calibration.accelerator}"
        )
    prices = load_prices()
    units, price = prices.billing(config.resources.accelerator, config.resources.gpus_per_replica)
    source, currency = ("prices" if price is not None else None), prices.currency
    if (
        price is None
        and calibration.price_per_gpu_hour is not None
        and calibration.accelerator == config.resources.accelerator
    ):
        price, source, currency = calibration.price_per_gpu_hour, "calibration", calibration.currency
    if price is None:
        warnings.append(prices.missing_price_message(config.resources.accelerator, config.resources.gpus_per_replica))
    gpu_hours = output_tokens / row.tokens_per_second_per_gpu / 3600 if row.tokens_per_second_per_gpu else float("inf")
    return CostEstimate(
        calibration_uri=uri,
        measured_at=calibration.measured_at,
        depth=row.depth,
        schedule=schedule,
        concurrency=top,
        tokens_per_second_per_gpu=row.tokens_per_second_per_gpu,
        output_tokens=output_tokens,
        gpu_hours=gpu_hours,
        wall_hours=gpu_hours / (config.resources.min_replicas * units),
        currency=currency,
        price_per_gpu_hour=price,
        price_source=source,
        cost=gpu_hours * price if price is not None else None,
    ), None
