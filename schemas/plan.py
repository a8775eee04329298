"""The contract of `specbatch run CONFIG --dry-run --json`: what the job would do, decided
without an engine and without writing to the output location (pipeline/tools/plan.py)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from schemas.contracts import Contract, HeadUnits, PrefixGrouping


class PlanFile(Contract):
    """One input file as the job would read it."""

    uri: str = Field(description="For openai_batch input, where the converted Parquet file is or would be.")
    rows: int
    text_column: Literal["prompt", "messages"]
    units: int
    first_prompt: Optional[str] = Field(
        None,
        description=(
            "With a template (rows.prompt_template, rows.messages_template): the file's first row as the engine would "
            "get it (messages through the chat template); null when its values cannot render."
        ),
    )


class PlanInputs(Contract):
    input_format: Literal["parquet", "openai_batch"]
    files: int
    footers_read: int = Field(description="Footers the input check read; the rest were recorded in _job.json.")
    rows: int
    prompt_rows: int = Field(description="Rows of files with a `prompt` column.")
    chat_rows: int = Field(description="Rows of files with a `messages` column (rendered with the chat template).")
    duplicate_ids: int = Field(
        0, description="Rows whose id an earlier row of the input has: each would be its row's duplicate_id error."
    )
    converted_files: Optional[int] = Field(
        None, description="openai_batch: JSONL files already converted under OUTPUT_URI/_inputs (not read again)."
    )
    conversions_checked: Optional[int] = Field(
        None,
        description=(
            "openai_batch: JSONL files not converted yet, which the dry run converted into a temporary local folder "
            "(deleted) to check every line as the job will; the job converts them into OUTPUT_URI/_inputs."
        ),
    )
    file_list: list[PlanFile]


class PlanUnits(Contract):
    rows_per_unit: int
    units: int
    committed: int = Field(description="Units already committed at the output location (its _commits/ listing).")
    again: int = Field(description="Committed units that would run again for their error rows.")
    left: int = Field(description="Units the run would generate: not committed, or again.")
    rows_left: int
    rerun_of: Optional[str] = Field(None, description="The job id of the output location's _job.json, on a rerun.")
    head: Optional[HeadUnits] = Field(
        None, description="The job's first rows in smaller units, for its speculation trial."
    )


class TokenEstimate(Contract):
    sample_rows: int = Field(description="Rows prepared exactly as the preprocess stage does (seeded random sample).")
    sample_row_groups: int = Field(description="Row groups read for the sample.")
    sample_seed: int
    sample_error_rows: int = Field(
        description="Sampled rows the preprocess stage would send to errors/ (0 prompt tokens)."
    )
    sample_error_kinds: dict[str, int] = Field(default_factory=dict)
    exact: bool = Field(description="The sample was every input row: the prompt tokens are counted, not estimated.")
    prompt_tokens: int = Field(description="Estimated over all input rows: each kind's sample mean x its rows.")
    prompt_tokens_by_kind: dict[str, int] = Field(
        description="'prompt' and 'messages' rows, each estimated from its own sample."
    )
    prompt_tokens_left: int = Field(description="The same estimate for the rows left to run.")
    output_tokens_upper_bound: int = Field(
        description=(
            "An upper bound (rows may stop earlier): each row's own max_tokens x n, its overrides else the job's; "
            "summed over every row when the sample is all of them (exact), else each kind's sample mean x its rows."
        )
    )
    output_tokens_upper_bound_left: int = Field(description="The same bound for the rows left to run.")
    sample_rows_above_bound: int = Field(
        0, description="Sampled rows whose own max_tokens x n (row overrides) is above the job's: counted by their own."
    )


class PlanCheck(Contract):
    name: str = Field(description="lease, preflight, drafter, drafter_probe, cluster.")
    status: Literal["pass", "warn", "fail", "skipped"]
    message: str


class CostEstimate(Contract):
    """From the job's calibration (OUTPUT_URI/calibration/calibration.json) and the price file."""

    calibration_uri: str
    measured_at: str
    depth: int = Field(
        description="The depth whose measurement is used: the job's at `concurrency` (0: speculation off)."
    )
    schedule: Optional[str] = Field(None, description="The job's depth schedule, when its measurement is used.")
    concurrency: int = Field(
        description="Sequences at once of the measurement: the highest measured (the job's steady state)."
    )
    tokens_per_second_per_gpu: float = Field(
        description="Generated tokens per second per billed GPU (per node for CPU replicas)."
    )
    output_tokens: int = Field(description="The rows left x sampling.max_tokens x sampling.n: an upper bound.")
    gpu_hours: float = Field(description="output_tokens / tokens_per_second_per_gpu / 3600: an upper bound with it.")
    wall_hours: float = Field(description="gpu_hours over the pool's minimum replicas x GPUs per replica.")
    currency: str
    price_per_gpu_hour: Optional[float] = Field(
        description="Null when the price file has no price for the accelerator."
    )
    price_source: Optional[str] = Field(
        description="'prices' (pipeline/tools/prices.yaml) or 'calibration' (its recorded price)."
    )
    cost: Optional[float] = Field(description="gpu_hours x price_per_gpu_hour.")


class PlanGrouping(Contract):
    decision: PrefixGrouping
    units: int = Field(description="Units over the grouped copy (the input's units when not grouped).")
    copy_written: bool = Field(
        description="The grouped copy exists already (a resume); false: the run writes it first."
    )
    prefill_tokens_saved: Optional[int] = Field(
        None,
        description=(
            "Prompt tokens grouping shares beyond the input's order: the prefill saved when the KV cache holds a "
            "fraction of the job."
        ),
    )


class DryRunPlan(Contract):
    accepted: bool = Field(description="The real run would start (exit 0); false: it would be refused (exit 2).")
    refused: Optional[str] = Field(None, description="The refusal, word for word the real run's.")
    config_uri: str
    output_uri: Optional[str] = None
    inputs: Optional[PlanInputs] = Field(None, description="Null when the run is refused before the input check.")
    units: Optional[PlanUnits] = None
    tokens: Optional[TokenEstimate] = None
    grouping: Optional[PlanGrouping] = Field(
        None, description="Rows grouped by shared prompt prefix, and what it found."
    )
    checks: list[PlanCheck] = Field(default_factory=list)
    speculation: Optional[str] = Field(
        None,
        description=(
            "The speculation decision the run would make, in the speculation policy's words "
            "(pipeline/speculation/policy.py); a finished job's recorded verdict."
        ),
    )
    cost: Optional[CostEstimate] = None
    cost_note: Optional[str] = Field(None, description="Why there is no cost estimate, or what it does not count.")
    warnings: list[str] = Field(default_factory=list)
