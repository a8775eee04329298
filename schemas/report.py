"""Contracts of what `specbatch report` and `specbatch calibrate` write.

    OUTPUT_URI/report/           (or --out)
      report.json    CostReport            report.csv   one JobFigures row per job
      report.md      report.html (self-contained, inline SVG plots)
    OUTPUT_URI/calibration/      (or --out)
      calibration.json  CalibrationReport  calibration.csv  one CalibrationRow per depth
      calibration.md    speculative.yaml (the config snippet)

"GPU" figures count billed accelerator units: GPUs on GPU replicas, one node per replica for
CPU-only runs (`gpus_per_replica: 0`). Costs are in the price file's currency.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from schemas.contracts import Contract, StartPhase


class JobFigures(Contract):
    """One job's cost, throughput and acceptance, from its _job.json and committed stats/ only."""

    job_id: str
    output_uri: str
    status: str
    started_at: str
    model: str = Field(description="Target model path.")
    model_sha256: str = Field(description="sha256 of the target's config.json: jobs on the same model share it.")
    inputs_sha256: str = Field(
        "", description="sha256 of the input files' names, sizes and rows: jobs on the same prompts share it."
    )
    sampling_sha256: str = Field(
        "", description="sha256 of the job's sampling section: jobs that sampled alike share it."
    )
    drafter: Optional[str] = None
    accelerator: str
    replicas: int
    gpus_per_replica: float = Field(description="Billed units per replica: GPUs, or 1 node for CPU-only replicas.")
    cpu_only: bool = Field(False, description="The replicas had no GPU (the job's resources.gpus_per_replica 0).")
    speculative: bool = Field(description="The job's config asked for speculation.")
    num_speculative_tokens: int = Field(description="Draft depth; 0 with speculation off.")
    ran: Optional[str] = Field(
        None,
        description=(
            "What ran, unit by unit: 'k=3', 'off', or 'k=3 for 600 rows, off for 1,800' when the trial, the policy or "
            "the guard turned speculation off part way."
        ),
    )
    units: int
    speculative_units: int = Field(
        description="Units that ran with the drafter; fewer than `units` when the acceptance guard turned it off."
    )
    input_rows: int
    output_rows: int
    failed_rows: int
    prompt_tokens: int
    cached_prompt_tokens: int = Field(0, description="Of prompt_tokens, those vLLM served from its prefix cache.")
    computed_prompt_tokens: int = Field(
        0, description="prompt_tokens - cached_prompt_tokens: the prefill the engines computed."
    )
    prefix_cache_hit_rate: Optional[float] = Field(
        None, description="cached_prompt_tokens / prompt_tokens; null without prompt tokens."
    )
    generated_tokens: int
    wall_seconds: float = Field(description="The job's wall time (_job.json totals.wall_seconds).")
    busy_seconds: float = Field(
        description="Engine-busy time summed over actors (union of each actor's unit intervals)."
    )
    gpu_hours: float = Field(description="replicas x gpus_per_replica x wall time, in hours: what is billed.")
    busy_gpu_hours: float = Field(description="gpus_per_replica x busy time, in hours.")
    utilization: Optional[float] = Field(description="busy_gpu_hours / gpu_hours.")
    price_per_gpu_hour: Optional[float] = Field(
        description="Null when the price file has no price for the accelerator."
    )
    price_source: Optional[str] = Field(
        None, description="Where the price came from: a --prices file or specbatch's defaults."
    )
    cost: Optional[float] = Field(description="gpu_hours x price_per_gpu_hour.")
    cost_per_million_generated_tokens: Optional[float]
    cost_per_million_total_tokens: Optional[float] = Field(description="Prompt plus generated tokens.")
    tokens_per_second_per_gpu: Optional[float] = Field(description="Generated tokens / (gpu_hours in seconds).")
    busy_tokens_per_second_per_gpu: Optional[float] = Field(
        description="Generated tokens / (busy_gpu_hours in seconds)."
    )
    engine_tokens_per_second: Optional[float] = Field(
        None, description="Generated tokens / busy_seconds: an engine's speed while it generates."
    )
    wall_tokens_per_second: Optional[float] = Field(
        None, description="Generated tokens / wall_seconds, engine start included."
    )
    to_first_commit_seconds: Optional[float] = Field(
        None, description="The last attempt: from its start to its first committed unit (_job.json attempts[-1].start)."
    )
    engine_starts: int = Field(0, description="Engines the last attempt started (a restarted engine counts again).")
    start_phases: list[StartPhase] = Field(default_factory=list, description="Where the last attempt's start went.")
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: Optional[float] = Field(description="accepted / draft tokens; null without drafts.")
    mean_acceptance_length: Optional[float] = Field(description="1 + accepted / drafts; null without drafts.")
    accepted_per_position: list[float] = Field(description="Share of drafts whose position i (0-based) was accepted.")
    tokens_per_target_pass: Optional[float] = Field(
        None,
        description=(
            "Generated tokens per target decode pass of the units that speculated: what speculation saved, grammar "
            "cuts included."
        ),
    )
    speculation_flags: list[str] = Field(
        default_factory=list,
        description="Acceptance below the floor, guard actions, or speculation slower than off: one sentence each.",
    )
    speculation_verdict: Optional[str] = Field(
        None, description="Whether speculation paid and what says so, as the console and `specbatch status` say it."
    )
    trial: Optional[str] = Field(
        None, description="The job's speculation trial, as its console line said (_job.json trial)."
    )
    trial_outcome: Optional[str] = Field(None, description="kept, turned-off or skipped; null: no trial.")
    trial_concurrency: Optional[int] = Field(None, description="Sequences at once in the trial's arms.")
    trial_tokens_per_second_on: Optional[float] = Field(
        None, description="The trial engine's tok/s with the configured speculation."
    )
    trial_tokens_per_second_off: Optional[float] = Field(
        None, description="The trial engine's tok/s without the drafter."
    )
    trial_cost_per_million_on: Optional[float] = Field(
        None,
        description=(
            "Price per replica-hour / (trial tok/s on x 3600) x 1M: a generated million's cost with speculation."
        ),
    )
    trial_cost_per_million_off: Optional[float] = Field(None, description="The same without the drafter.")


class ReportTotals(Contract):
    """All jobs of the report together."""

    jobs: int
    input_rows: int
    output_rows: int
    failed_rows: int
    prompt_tokens: int
    generated_tokens: int
    gpu_hours: float
    busy_gpu_hours: float
    cost: Optional[float] = Field(description="Null if any job has no price.")
    cost_per_million_generated_tokens: Optional[float]
    cost_per_million_total_tokens: Optional[float]
    tokens_per_second_per_gpu: Optional[float]
    num_drafts: int = Field(0, description="Summed over the jobs, as are draft_tokens and accepted_tokens.")
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: Optional[float] = Field(
        None, description="accepted / draft tokens of all jobs; null without drafts."
    )
    mean_acceptance_length: Optional[float] = Field(
        None, description="1 + accepted / drafts of all jobs; null without drafts."
    )


class SpeculationComparison(Contract):
    """Jobs on the same target model and accelerator kind, one depth against speculation off:
    cost per million generated tokens pooled over the jobs of each side. Jobs whose units ran
    partly with and partly without the drafter (acceptance guard) are left out."""

    model: str
    model_sha256: str
    accelerator: str
    num_speculative_tokens: int
    jobs_on: list[str]
    jobs_off: list[str]
    cost_per_million_generated_tokens_on: float
    cost_per_million_generated_tokens_off: float
    saving_per_million_generated_tokens: float = Field(description="off - on; negative: speculation cost money.")
    saving_fraction: float = Field(description="(off - on) / off; negative: speculation cost money.")
    tokens_per_second_per_gpu_on: float
    tokens_per_second_per_gpu_off: float


class CostReport(Contract):
    generated_at: str
    currency: str
    prices: dict[str, Any] = Field(description="The price table used (defaults merged with --prices).")
    output_uris: list[str]
    jobs: list[JobFigures]
    overall: ReportTotals
    speculation: list[SpeculationComparison]
    warnings: list[str] = Field(default_factory=list)


class CalibrationRow(Contract):
    """One speculation depth at one concurrency, measured on a sample of the job's own prompts."""

    depth: int = Field(description="num_speculative_tokens; 0 = speculation off; with a schedule, its largest k.")
    schedule: Optional[str] = Field(
        None, description="The depth schedule measured ('<lo>-<hi>:<k>,...'); null: the fixed depth `depth`."
    )
    concurrency: int = Field(description="Sequences kept running in the engine at once (a new one starts as one ends).")
    prompts: int
    prompt_tokens: int
    generated_tokens: int
    completions: Optional[int] = Field(
        None, description="Completions generated (prompts x n); null: as many as prompts."
    )
    seconds: float = Field(description="Wall time of generating the sample (engine warm): the median of the runs.")
    seconds_runs: list[float] = Field(
        default_factory=list, description="Each run's wall time (--repeats): the spread every speedup carries."
    )
    tokens_per_second: float = Field(description="Generated tokens per second of one replica.")
    tokens_per_second_per_gpu: float
    speedup_vs_off: Optional[float] = Field(
        description="tokens_per_second / that of depth 0 at the same concurrency, when 0 was measured."
    )
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: Optional[float]
    mean_acceptance_length: Optional[float]
    accepted_per_position: list[float] = Field(description="Share of drafts whose position i (0-based) was accepted.")
    cost_per_million_generated_tokens: Optional[float]
    cost_per_million_total_tokens: Optional[float]
    speedup_low: Optional[float] = Field(
        None, description="The lowest speedup over off the runs allow: this row's slowest run against off's fastest."
    )
    speedup_high: Optional[float] = Field(
        None, description="The highest: this row's fastest run against off's slowest."
    )
    recommended: bool = Field(
        description=(
            "The depth the speculation policy chooses at this concurrency: the fastest whose speedup's whole spread is "
            "above 1.0 (ties: the shallower), else off."
        )
    )


class JobCheckRow(Contract):
    """One setting run through the job itself (its actors, units and engine wrapper) on a
    sample of the job's input: what the job will see, contention included."""

    setting: str = Field(description="'off', 'depth <k>' or 'schedule <lo>-<hi>:<k>,...'.")
    depth: int = Field(description="0 = off; with a schedule, its largest k.")
    schedule: Optional[str] = None
    rows: int
    generated_tokens: int
    seconds: float = Field(
        description="From the first unit entering an engine to the last commit (engine start excluded)."
    )
    tokens_per_second: float
    mean_acceptance_length: Optional[float]
    chosen: bool


class CalibrationReport(Contract):
    config_uri: str
    measured_at: str
    accelerator: str
    gpus_per_replica: float
    currency: str
    price_per_gpu_hour: Optional[float]
    max_num_seqs: int
    sample_requested: int
    sample_measured: int
    concurrencies: list[int] = Field(description="The concurrencies measured, ascending.")
    rows: list[CalibrationRow]
    recommended_depth: int = Field(
        description="The best single depth: the fastest at the highest concurrency measured, or off when the job check "
        "measured off faster."
    )
    schedule_candidate: Optional[list[tuple[int, int, int]]] = Field(
        None,
        description=(
            "The fastest depth per concurrency as speculative.depth_schedule [(lo, hi, k), ...] over 1..max_num_seqs, "
            "measured in its own engine; null when one concurrency was measured or one depth wins everywhere."
        ),
    )
    recommended_schedule: Optional[list[tuple[int, int, int]]] = Field(
        None,
        description=(
            "The candidate, when measured at least as fast as the best single depth at the highest concurrency (the "
            "job's steady state); in vLLM a range with k=0 still runs the drafter's forward pass, so it is not free."
        ),
    )
    job_check: list[JobCheckRow] = Field(
        default_factory=list,
        description=(
            "Off, the best single depth and the schedule run through the job on a sample; the fastest is recommended."
        ),
    )
    config_snippet: str
    recommendation: Optional[str] = Field(
        None,
        description="Why the recommended setting: the speculation policy's words (pipeline/speculation/policy.py).",
    )
    warnings: list[str] = Field(default_factory=list)


class SpeculationCosts(Contract):
    """What the hardware and engine settings cost, read from a calibration: the time of one
    sequence's decode step without speculation and with it at one depth (drafting k tokens and
    verifying k + 1), at one concurrency, one figure per run. The traffic's acceptance is not in
    it: a job combines these with its own (pipeline/speculation/policy.py)."""

    calibration_uri: Optional[str] = None
    measured_at: str
    depth: int
    concurrency: int = Field(
        description="Sequences at once it was measured at: the calibration's nearest to the job's."
    )
    off_step_seconds: list[float] = Field(
        description="Seconds per decode step of a sequence, speculation off, per run."
    )
    spec_step_seconds: list[float] = Field(description="The same with speculation at `depth` (draft and verify).")
    calibration_acceptance: list[float] = Field(
        description="The calibration sample's share of drafts accepted at each position: its traffic, not the job's."
    )
    calibration_tokens_per_step: Optional[float] = Field(
        None, description="The calibration sample's generated tokens per decode step at `depth`, as generated."
    )


class CalibrationKey(Contract):
    """What a calibration is valid for (pipeline/speculation/calibrations.py): a job whose key is
    equal uses it; one that differs in a field is told which."""

    target: str = Field(
        description="sha256 of the target's config and its weight and tokenizer files' sizes and versions."
    )
    drafter: str = Field(description="The same for the drafter.")
    accelerator: str = Field(description="resources.accelerator.")
    dtype: str = Field(description="engine.dtype.")
    max_num_seqs: int = Field(description="engine.max_num_seqs.")
    tensor_parallel_size: int = Field(description="engine.tensor_parallel_size.")
    max_model_len: int = Field(description="engine.max_model_len.")
    specbatch: str = Field(description="The specbatch version that measured it.")


class StoredCalibration(Contract):
    """One entry of the calibration store: `specbatch calibrate`'s report and what it is valid for."""

    key: CalibrationKey
    stored_at: str
    config_uri: str = Field(description="The config the calibration ran (its models, prompts and engine settings).")
    report: CalibrationReport
