"""The data contracts of specbatch: every table and document the pipeline reads or writes.

Each contract is defined once, as a pydantic model. The Arrow schema of a table is derived
from its model (`arrow_schema`), and the JSON Schema exported for other languages lives in
`schemas/json/` (`python -m schemas.export` rewrites it; a test checks it matches).
"""

from __future__ import annotations

import datetime as dt
import types
import typing
from typing import Any, Literal, Optional

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

if typing.TYPE_CHECKING:
    from schemas.drafter import ProbeResult


def utc_timestamp() -> str:
    """Now, as every timestamp of the contracts is written: ISO 8601 in UTC, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Contract(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- input: prompts/*.parquet


class Message(Contract):
    role: str
    content: str


class PromptRow(Contract):
    """One input row. Exactly one of `prompt` / `messages`; `messages` is rendered with the
    target tokenizer's chat template. Sampling overrides replace the job's defaults (`sampling`
    in the job config): the common ones as columns, any other as a key of `sampling`."""

    id: str = Field(description="Unique within a job.")
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    n: Optional[int] = Field(None, description="Samples of this prompt.")
    stop: Optional[list[str]] = None
    response_format: Optional[str] = Field(
        None,
        description=(
            'Structured output, JSON text: {"type": "json_schema", "json_schema": {"schema": {...}}}, or regex, '
            "choice, grammar, json_object."
        ),
    )
    sampling: Optional[str] = Field(
        None, description='Any other sampling parameter, JSON text of an object: {"top_k": 20, "logprobs": 5}.'
    )
    lora: Optional[str] = Field(
        None, description="A LoRA adapter by its name in the job's lora.adapters; null: the base model."
    )
    metadata: Any = Field(default=None, description="Passed through to outputs untouched.")


PROMPT_TEXT_COLUMNS = ("prompt", "messages")
SAMPLING_OVERRIDE_COLUMNS = ("max_tokens", "temperature", "top_p", "seed", "n", "stop", "response_format", "sampling")


class TopLogprob(Contract):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(Contract):
    """A token of the output (or prompt), its logprob, and the top-k tokens at its position."""

    token_id: int
    token: str
    logprob: Optional[float] = Field(description="Null for the prompt's first token, which nothing predicts.")
    top_logprobs: list[TopLogprob] = Field(description="The k most likely tokens, most likely first.")


# ---------------------------------------------------------------- outputs/, errors/, stats/


class OutputRow(Contract):
    """One row per sample of a successfully generated input row: `sampling.n` rows per id, all
    committed together."""

    id: str
    sample_index: int = Field(0, description="0..n-1; with a seed, sample i is drawn with seed + i.")
    text: str = Field(description="The output; with a reasoning parser, the answer without its reasoning.")
    finish_reason: str = Field(description="stop (EOS, a stop string or token), length (max_tokens) or abort.")
    stop_reason: Optional[str] = Field(
        None, description="The stop string or stop token id that ended it; null for EOS or length."
    )
    parsed: Optional[bool] = Field(
        None,
        description=(
            "With a response_format: the text parses and follows it (false, e.g., when cut off by max_tokens); null: "
            "none asked."
        ),
    )
    parse_error: Optional[str] = Field(None, description="Why it does not parse.")
    reasoning: Optional[str] = Field(None, description="The reasoning, split off the text by chat.reasoning_parser.")
    logprobs: Optional[list[TokenLogprob]] = Field(None, description="Per generated token, with sampling.logprobs.")
    prompt_logprobs: Optional[list[TokenLogprob]] = Field(
        None,
        description="Per prompt token, with sampling.prompt_logprobs; on sample 0 only (the samples share the prompt).",
    )
    prompt_tokens: int
    generated_tokens: int
    draft_tokens: int = Field(description="Draft tokens proposed for this request.")
    accepted_tokens: int = Field(description="Draft tokens the target accepted.")
    num_drafts: int = Field(description="Verify steps that carried drafts.")
    mean_acceptance_length: float = Field(description="1 + accepted / drafts (1.0 without speculation).")
    max_tokens_clipped: bool = Field(
        False, description="max_tokens did not fit beside the prompt in max_model_len: it generated what fit."
    )
    model: str
    drafter: Optional[str] = None
    lora: Optional[str] = Field(None, description="The LoRA adapter that generated it; null: the base model.")
    source: str = Field(description="The input file the row came from.")
    row: int = Field(description="The row's position in its input file (0-based).")
    unit_id: str = Field(description="The work unit that generated it (outputs/<unit_id>.<token>.parquet).")
    metadata: Any = None


ErrorStage = Literal["input", "validate", "generate"]


class ErrorRow(Contract):
    """One row per input row that produced no output, with the reason."""

    id: str = Field(description="The row's id ('' when the id itself is blank).")
    source: str = Field(description="The input file the row came from.")
    row: int = Field(description="The row's position in its input file (0-based).")
    stage: ErrorStage
    error_kind: str
    field: Optional[str] = Field(default=None, description="The input column at fault, if any.")
    message: str
    retryable: bool = Field(
        False, description="Not the row's own fault (the engine or storage failed it): a rerun generates it again."
    )
    unit_id: str


class UnitStats(Contract):
    """One row per committed work unit, exact even when units overlap inside one engine:
    summed from vLLM's per-request speculative-decoding metrics of this unit's requests only."""

    unit_id: str
    source: str = Field(description="The input file of the unit.")
    first_row: int = Field(description="The unit covers rows [first_row, first_row + rows) of its file.")
    actor_id: str
    node_id: str
    rows: int
    output_rows: int = Field(description="Input rows generated (each with all its samples).")
    error_rows: int
    samples: int = Field(0, description="Rows written to outputs/: one per sample of each generated input row.")
    retryable_error_rows: int = Field(0, description="Error rows a rerun generates again (ErrorRow.retryable).")
    clipped_rows: int = Field(0, description="Output rows whose max_tokens was clipped to fit max_model_len.")
    first_error: Optional[str] = Field(None, description="'<error_kind>: <id>' of the unit's first error row.")
    prompt_tokens: int
    cached_prompt_tokens: int = Field(
        0,
        description=(
            "Of prompt_tokens, those vLLM served from its prefix cache (counted once per request, as prompt_tokens)."
        ),
    )
    generated_tokens: int
    started_at: float = Field(description="Unix time the unit entered the engine.")
    wall_seconds: float = Field(description="From the unit entering the actor to its commit.")
    engine_seconds: float = Field(description="From the first request submitted to the last finished.")
    tokens_per_second: float = Field(description="generated_tokens / engine_seconds.")
    speculative: bool
    num_speculative_tokens: int = Field(description="The draft depth; with a depth schedule, its largest k.")
    depth_schedule: Optional[str] = Field(
        None, description="The depth schedule in force, '<lo>-<hi>:<k>,...' by running sequences; null: a fixed depth."
    )
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: Optional[float] = Field(description="accepted / draft tokens; null without drafts.")
    mean_acceptance_length: Optional[float] = Field(description="1 + accepted / drafts; null without drafts.")
    accepted_per_position: list[int] = Field(description="Drafts whose position i (0-based) was accepted.")
    tokens_per_target_pass: Optional[float] = Field(
        None,
        description=(
            "Generated tokens per target decode pass (passes: generated - accepted - completions, at least the "
            "drafting steps): what speculation saved, grammar cuts included; 1.0 without drafts; null without a decode "
            "pass."
        ),
    )
    speculation_disabled_by_guard: bool = Field(
        False,
        description="The job config asked for speculation and the acceptance guard turned it off before this unit.",
    )
    trial_arm: Optional[str] = Field(
        None,
        description=(
            "'on' or 'off': the unit measured that setting in the speculation trial (JobManifest.trial); null: not in "
            "it."
        ),
    )
    commit_token: str = Field("", description="Names the commit's files; the unit's marker names the visible one.")
    lease_owner: str = Field(
        "",
        description=(
            "The run (`_lease.json`'s owner) that held the lease when the unit was committed; empty: no lease check."
        ),
    )


class CommitMarker(Contract):
    """_commits/<unit_id>.json, written after the unit's files: the unit is done, and these
    files (and no others) hold its rows. A file no marker names is invisible."""

    unit_id: str
    token: str = Field(description="Unique per commit; part of each file name.")
    files: dict[str, str] = Field(description="Table (outputs, errors) -> path relative to the output location.")
    rows: dict[str, int] = Field(description="Table -> rows in its file.")
    stats: UnitStats


# ---------------------------------------------------------------- _job.json


class Versions(Contract):
    specbatch: str
    vllm: Optional[str]
    ray: str
    torch: Optional[str]
    python: str


class ModelFingerprint(Contract):
    path: str = Field(
        description="The model as configured: a local folder, or a folder URI in object storage (s3://...)."
    )
    config_sha256: str
    architectures: list[str]
    files: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Weight, index and tokenizer files -> 'size:mtime_ns' for a local folder, 'size:ETag' for a folder in "
            "object storage (names relative to it, from its listing): a model changed in place is refused on resume."
        ),
    )


class InputFile(Contract):
    """One input file as the job's check found it; the file's identity is (uri, size, version)."""

    uri: str
    size: int
    version: str = Field(description="ETag on object stores, mtime on local disks.")
    rows: int
    text_column: Literal["prompt", "messages"]
    metadata_type: Optional[str] = None


class DuplicateId(Contract):
    """A row whose id an earlier row of the job has (files in order, rows in order): it is that
    row's `duplicate_id` error, and the earlier row is generated (pipeline/inputs/ids.py)."""

    source: str
    row: int
    first_source: str
    first_row: int


class InputJob(Contract):
    """The finished job whose committed output rows a chained job reads as its input."""

    job_id: str
    output_uri: str
    status: str = Field(description="How that job ended, when this job read it.")
    results_fingerprint: str = Field(description="That job's results fingerprint: the settings that made its rows.")


class IdCheck(Contract):
    """The job's ids checked unique across all its input files, before any engine started."""

    rows: int = Field(description="Rows whose ids were read.")
    duplicates: list[DuplicateId] = Field(
        default_factory=list, description="Each repeated id's later rows, in input order."
    )


class PrefixSharing(Contract):
    """What the prompts share, measured over the job's input before any engine starts
    (pipeline/inputs/prefixes.py). Characters of the text that reaches the tokenizer (the
    prompt, or the messages in order), counted at prefix lengths of 64, 128, ... 8,192."""

    rows: int
    prompt_chars: int
    shared_chars_in_input_order: int = Field(
        description="Characters each row shares with the row before it, as the input comes."
    )
    shared_chars_grouped: int = Field(description="The same, with the rows sorted so that shared prefixes meet.")
    job_common_chars: int = Field(0, description="A prefix every row shares (a system prompt): cached in any order.")
    prefix_groups: int = Field(
        description="Runs of grouped rows sharing at least 256 characters beyond the job's common prefix."
    )
    rows_in_groups: int


class HeadUnits(Contract):
    """The job's first rows, planned in units of the job's sequences at once, so that its
    speculation trial measures whatever resources.rows_per_unit is (pipeline/inputs/units.py).
    Decided when the job begins and kept by every resume: the units of a job never change."""

    rows: int = Field(description="How many of the job's first rows (its unit files in order) the head units hold.")
    rows_per_unit: int = Field(description="Rows of each head unit.")


class PrefixGrouping(Contract):
    """The job's decision on grouping rows by shared prefix, and the grouped copy of its input
    (`_grouped/`) its units are planned over when `grouped`; recorded once, reused on resume."""

    setting: str = Field(description="resources.group_prefixes when decided: true, false or auto.")
    grouped: bool
    reason: str
    sharing: Optional[PrefixSharing] = None
    files: list[InputFile] = Field(
        default_factory=list, description="The grouped copy's files, in order; units are their row ranges."
    )
    sources: Optional[list[str]] = Field(
        None,
        description=(
            "The input files the copy holds (null: a copy written before they were recorded, of every input file)."
        ),
    )

    def unit_files(self, input_files: list[InputFile]) -> list[InputFile]:
        """The files the units are row ranges of: the grouped copy's once written, else the
        input's; input files the copy does not hold (added since: a later run on the same
        location) are planned as they are, after it."""
        if not (self.grouped and self.files):
            return input_files
        held = set(self.sources) if self.sources is not None else {f.uri for f in input_files}
        return self.files + [f for f in input_files if f.uri not in held]


class Lease(Contract):
    """_lease.json: the run that owns the output location, renewed every heartbeat."""

    owner: str = Field(description="host, process id and a token of the run")
    job_id: str
    attempt: int
    acquired_at: str
    heartbeat_at: float = Field(description="Unix time of the last renewal.")
    stale_after_seconds: float
    generation: int = Field(
        0,
        description="Grows by one at every acquisition (a take-over included); an engine commits only under its run's.",
    )
    host: Optional[str] = Field(None, description="Host name of the run's driver.")
    pid: Optional[int] = Field(None, description="Process id of the run's driver on `host`.")
    pid_started_at: Optional[float] = Field(
        None, description="Unix time the driver's process started: a pid reused by another process is not the owner."
    )


class Fence(Contract):
    """What an engine checks before each unit's marker: the location is still leased to its run."""

    owner: str
    generation: int


class JobTotals(Contract):
    input_rows: int = 0
    output_rows: int = Field(0, description="Input rows generated.")
    error_rows: int = 0
    samples: int = Field(0, description="Rows in outputs/: one per sample.")
    retryable_error_rows: int = Field(0, description="Error rows a rerun generates again.")
    clipped_rows: int = Field(0, description="Output rows whose max_tokens was clipped to fit max_model_len.")
    units: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = Field(0, description="Of prompt_tokens, those served from vLLM's prefix cache.")
    prefix_cache_hit_rate: Optional[float] = Field(
        None,
        description="cached_prompt_tokens / prompt_tokens; null without prompt tokens. Prefill computed: the rest.",
    )
    generated_tokens: int = 0
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = Field(
        default_factory=list,
        description="Over the units that speculated: drafts whose i-th token was accepted (the traffic's acceptance).",
    )
    acceptance_rate: Optional[float] = None
    mean_acceptance_length: Optional[float] = None
    tokens_per_target_pass: Optional[float] = Field(
        None,
        description=(
            "Over the units that speculated (not the trial's off arm, nor units after the trial or the guard turned "
            "speculation off): generated tokens per target decode pass (passes: generated - accepted - completions, at "
            "least the drafting steps): what speculation saved, grammar cuts included; null without a decode pass."
        ),
    )
    wall_seconds: float = Field(
        0.0, description="The attempts' wall time, summed: what is billed, engine start included."
    )
    tokens_per_second: float = Field(0.0, description="Generated tokens / wall_seconds: wall-time speed.")
    engine_busy_seconds: float = Field(
        0.0, description="Time the engines generated, summed over engines (each the union of its units' engine time)."
    )
    engine_tokens_per_second: float = Field(
        0.0, description="Generated tokens / engine_busy_seconds: an engine's speed while it generates."
    )
    engine_busy_share: Optional[float] = Field(
        None,
        description=(
            "engine_busy_seconds / (replicas x wall_seconds): the share of billed engine time spent generating."
        ),
    )


class EngineDeath(Contract):
    """An engine actor found its vLLM engine dead, or hung (requests in it and no token for
    retries.engine_stall_seconds); it ended the engine's processes, committed nothing and
    exited, and Ray restarted it and retried its units."""

    time: str = Field(description="UTC, ISO 8601.")
    actor_id: str
    node_id: str
    error: str
    units: list[str] = Field(description="Units in flight, retried.")
    kind: Literal["died", "hung"] = Field(
        "died", description="died: EngineCore gone; hung: alive and yielding no token."
    )
    seconds_without_progress: Optional[float] = Field(None, description="hung: seconds since the engine's last output.")
    stall_limit_seconds: Optional[float] = Field(
        None, description="hung: the limit it passed (engine_stall_seconds, or more)."
    )
    rows_in_flight: dict[str, list[int]] = Field(
        default_factory=dict, description="Unit -> its rows in the engine, unfinished."
    )
    stacks: Optional[str] = Field(None, description="hung: the Python stacks of the engine's processes (py-spy dump).")


class ReplicaProgress(Contract):
    """One engine replica's progress as it last reported it to the job board."""

    actor_id: str
    node_id: str
    requests_in_flight: int
    last_output_at: Optional[float] = Field(None, description="Unix time of the engine's last output; null: none yet.")
    reported_at: float = Field(description="Unix time of this report.")


class JobProgress(Contract):
    """`_progress.json`: what a running attempt's driver last saw, rewritten every few seconds
    while the attempt generates; what `specbatch status` reads of engines it cannot ask."""

    attempt: int
    written_at: float = Field(description="Unix time.")
    generating_since: float = Field(description="Unix time the attempt's generation began.")
    last_commit_at: Optional[float] = Field(None, description="Unix time of the last unit the driver heard committed.")
    replicas: list[ReplicaProgress] = Field(default_factory=list)


class NodeLoss(Contract):
    """A Ray node left the cluster while the attempt ran (spot reclaim, crash, scale-down). Units
    in flight on it were never committed: they ran again on the nodes left."""

    time: str = Field(description="UTC, ISO 8601: when the driver saw it gone.")
    node_id: str
    address: str
    recovery: Literal["ray-data-retried", "graph-rebuilt"] = Field(
        description="ray-data-retried: Ray Data resubmitted the lost units itself; graph-rebuilt: the dataset failed "
        "and the driver rebuilt the graph over the units not committed yet."
    )
    units_not_committed: int = Field(description="Units of the attempt not committed when the loss was seen.")
    error: Optional[str] = Field(None, description="What the dataset raised, for graph-rebuilt.")


# succeeded: every input row is in outputs/, or has a final error row, within
# retries.max_error_fraction; completed_with_errors: every row is done, over that fraction;
# failed: the attempt stopped; interrupted: stopped by Ctrl-C (SIGINT); killed: the attempt
# ended without a word (closed by the next).
JobStatus = Literal["running", "succeeded", "completed_with_errors", "failed", "interrupted", "killed", "fenced"]


class EngineStart(Contract):
    """One engine actor's start, Unix times on its node (a restarted engine starts again)."""

    actor_id: str
    node_id: str
    process_started_at: float = Field(description="Its worker process started (Ray may start one ahead of the actor).")
    init_started_at: float = Field(description="The actor's constructor began: its own modules imported.")
    vllm_imported_at: float
    engine_core_started_at: Optional[float] = Field(
        None, description="vLLM's EngineCore process started; null: not seen."
    )
    engine_ready_at: float = Field(description="The engine answered: workers up, model loaded, KV cache allocated.")


class StartPhase(Contract):
    name: str
    started_s: float = Field(description="Seconds after the driver's process started.")
    seconds: float


class StartCost(Contract):
    """Where the time to the attempt's first committed unit went. Phases may overlap: Ray
    starts while the driver checks the input, and engines load while units are read."""

    to_first_commit_seconds: Optional[float] = Field(
        None, description="From the driver's process start to the first unit committed; null: none committed."
    )
    generation_started_s: Optional[float] = Field(
        None,
        description=(
            "From the driver's process start to the start of generation, where the attempt's wall_seconds begin."
        ),
    )
    phases: list[StartPhase] = Field(default_factory=list, description="In the order they began.")
    engine_starts: list[EngineStart] = Field(default_factory=list, description="Every engine this attempt started.")


class AttemptAdded(Contract):
    """What one attempt added to its output location: the units it committed, and the input
    files that were not there at the attempt before (a scheduled run on one location per data
    set generates only those)."""

    units: int = 0
    rows: int = Field(0, description="Input rows of the units it committed: output rows and error rows.")
    output_rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    new_input_files: int = Field(0, description="Input files the attempt before did not have (the first attempt: all).")


class Attempt(Contract):
    """One run of the job over its output location (a rerun resumes: it adds an attempt)."""

    number: int
    started_at: str
    ended_at: Optional[str] = None
    status: JobStatus
    skipped_rows: int = Field(description="Input rows in units committed by earlier attempts.")
    units_planned: int = Field(0, description="Work units of the input.")
    units_skipped: int = Field(0, description="Units committed before this attempt started.")
    footers_read: int = Field(0, description="Input footers this attempt read (the others were recorded earlier).")
    processed_rows: int = 0
    wall_seconds: float = 0.0
    error: Optional[str] = None
    engine_deaths: list[EngineDeath] = Field(default_factory=list, description="Engines that died and were restarted.")
    node_losses: list[NodeLoss] = Field(default_factory=list, description="Ray nodes lost while the attempt ran.")
    ray_cluster: Optional[str] = Field(
        None,
        description="The Ray cluster the attempt ran on: joined ADDRESS, or its own local Ray; null: no engine ran.",
    )
    start: Optional[StartCost] = Field(
        None, description="Where the time to the first committed unit went; null: no engine ran."
    )
    added: Optional[AttemptAdded] = Field(
        None, description="What this attempt generated: a rerun over new input files adds only theirs."
    )


GuardAction = Literal["warn", "fail", "disable-speculation"]


class GuardEvent(Contract):
    """The acceptance guard (speculative.guard) found acceptance over its window below a floor."""

    time: str = Field(description="UTC, ISO 8601.")
    attempt: int = Field(description="The attempt it happened in.")
    action: GuardAction
    metric: Literal["acceptance_rate", "mean_acceptance_length", "tokens_per_target_pass"]
    value: float = Field(description="The metric over the window, pooled over its units' draft tokens.")
    floor: float
    unit_ids: list[str] = Field(description="The window: the last units that drafted, oldest first.")
    message: str


class SpeculationVerdict(Contract):
    """Did speculation pay in this job? Written with the totals at the end of every attempt;
    `specbatch report` and the console summary show its flags."""

    floor: float = Field(description="The mean acceptance length floor (speculative.guard, else speculative.probe).")
    mean_acceptance_length: Optional[float] = Field(description="Over the committed units that speculated.")
    tokens_per_target_floor: Optional[float] = Field(
        None, description="The tokens per target pass floor (speculative.guard, else speculative.probe)."
    )
    tokens_per_target_pass: Optional[float] = Field(
        None,
        description=(
            "Over the committed units that speculated (JobTotals.tokens_per_target_pass): what speculation saved."
        ),
    )
    below_floor: bool
    cost_more_than_saved: Optional[bool] = Field(
        description=(
            "true: the job's speculation trial (else a calibration at the job's concurrency) measured it slower than "
            "off, or, measured by neither, acceptance is below the floor (each step yields about one token for k "
            "drafter passes and a k+1-token verify); false: measured faster; null: not measured (cost_unknown_because "
            "says why). A flag names the reason."
        )
    )
    cost_unknown_because: Optional[str] = Field(None, description="Why cost_more_than_saved could not be told.")
    flags: list[str] = Field(description="What a reader of the job must know, one sentence each; empty when it paid.")
    source: Optional[Literal["trial", "prediction", "calibration", "none"]] = Field(
        None,
        description=(
            "What the verdict rests on: this job's trial (both settings on its own engine); a prediction (a "
            "calibration's step costs of the same models, accelerator and engine settings, with this job's own "
            "acceptance); calibration (a job written before predictions, which reused a calibration's speedup); none "
            "(the acceptance floors alone). Null in jobs written before it was recorded."
        ),
    )
    source_detail: Optional[str] = Field(
        None,
        description=(
            "The trial's reason, the calibration's date and place, or why there is none and the command that gives one."
        ),
    )
    calibration_uri: Optional[str] = Field(
        None, description="The calibration the verdict rests on (source calibration or prediction)."
    )
    verdict: Optional[Literal["paid", "cost_more", "no_difference"]] = Field(
        None,
        description=(
            "paid: the speedup's whole spread lies above 1.0; cost_more: below it; no_difference: the spread straddles "
            "1.0. Null: nothing measured or predicted the speedup (the floors alone), or a job written before it was "
            "recorded."
        ),
    )
    speedup: Optional[float] = Field(
        None, description="Speculation's speed over off's: the median (pipeline/speculation/policy.py)."
    )
    speedup_low: Optional[float] = Field(None, description="The lowest the measurements allow.")
    speedup_high: Optional[float] = Field(None, description="The highest the measurements allow.")
    acceptance_from: Optional[str] = Field(
        None, description="Whose acceptance a prediction used: this job's units that speculated, or its probe's rows."
    )
    text: Optional[str] = Field(
        None,
        description="The verdict in one sentence: what the console, status, report and data card print, word for word.",
    )


class TrialArm(Contract):
    """One setting's units in the speculation trial, on one engine, back to back."""

    setting: str = Field(description="'k=3', a depth schedule '1-8:3,9-64:0', or 'off'.")
    units: int
    rows: int
    generated_tokens: int
    seconds: float = Field(description="Engine time: the union of the arm's units' intervals in the engine.")
    tokens_per_second: float = Field(description="generated_tokens / seconds.")
    unit_tokens_per_second: list[float] = Field(
        description="Each unit's own rate (it overlapped the others): the spread."
    )


class TrialVerdict(Contract):
    """Did speculation pay on this job's own first units? Measured once per job (a resume keeps
    it); `specbatch report`, `status` and the console show it."""

    outcome: Literal["kept", "turned-off", "skipped"] = Field(
        description=(
            "kept: speculation stays on; turned-off: the rest of the job runs without the drafter; skipped: not "
            "measured."
        )
    )
    reason: str = Field(description="One sentence, as the console printed it.")
    setting: str = Field(description="The speculation the job is configured with ('k=3' or a schedule).")
    concurrency: int = Field(
        0, description="Sequences at once the trial ran at: min(units in flight x rows per unit, max_num_seqs)."
    )
    speculation: Optional[TrialArm] = None
    off: Optional[TrialArm] = None
    speedup_vs_off: Optional[float] = Field(
        None, description="speculation tok/s / off tok/s (or predicted); below 1 it cost more than it saved."
    )
    speedup_low: Optional[float] = Field(
        None, description="The lowest speedup the arms' units (or the prediction) allow."
    )
    speedup_high: Optional[float] = Field(None, description="The highest.")
    method: Literal["trial", "prediction"] = Field(
        "trial",
        description=(
            "trial: both settings measured on the job's own engine; prediction: a calibration's step costs with the "
            "probe's acceptance on the job's first rows, before any unit (pipeline/speculation/policy.py)."
        ),
    )
    margin: float = Field(0.0, description="speculative.trial.margin when it was decided.")
    engine_start_seconds: Optional[float] = Field(
        None, description="The trial engine's own start, which a switch costs again."
    )
    engine_restarts: int = Field(0, description="Engine starts the trial cost its engine beyond the first.")
    actor_id: str = ""
    decided_at: Optional[str] = None


# The process exit code of each job status (and of a refusal before the job starts): a RayJob or
# a scheduler reads them.
EXIT_CODES = {"succeeded": 0, "failed": 1, "refused": 2, "completed_with_errors": 3, "fenced": 4, "interrupted": 130}

LAYOUT_VERSION = 2  # 1: per-batch files named by id hashes; 2: work units by input position


class JobManifest(Contract):
    layout_version: int = Field(1, description="Output layout; a location of another layout is refused, never mixed.")
    job_id: str
    status: JobStatus
    started_at: str
    ended_at: Optional[str] = None
    error: Optional[str] = None
    config: dict[str, Any] = Field(description="The job config, secrets redacted.")
    results_fingerprint: str = Field("", description="sha256 of what determines the results; a resume must match it.")
    versions: Versions
    model: ModelFingerprint
    drafter: Optional[ModelFingerprint] = None
    accelerator: str = Field(description="What the replicas ran on, e.g. 'cpu' or 'nvidia-a100'.")
    input_files: list[InputFile]
    grouping: Optional[PrefixGrouping] = Field(
        None, description="Rows grouped by shared prefix (null: decided before grouping existed, or not run)."
    )
    head_units: Optional[HeadUnits] = Field(
        None, description="The job's first rows in smaller units for its trial (null: none)."
    )
    ids: Optional[IdCheck] = Field(
        None, description="The ids checked unique across the input (null: a job begun before the check)."
    )
    input_job: Optional[InputJob] = Field(None, description="A chained job: the job whose output rows are its input.")
    totals: JobTotals = Field(description="Over everything committed at the output location, all attempts.")
    attempts: list[Attempt] = Field(default_factory=list)
    guard_events: list[GuardEvent] = Field(default_factory=list, description="What the acceptance guard saw and did.")
    probe: Optional[ProbeResult] = Field(None, description="The drafter probe before the first run (null: not run).")
    speculation: Optional[SpeculationVerdict] = Field(
        None, description="Did speculation pay? Null without speculation."
    )
    trial: Optional[TrialVerdict] = Field(
        None, description="Speculation against off on the job's first units (null: no trial)."
    )

    @property
    def unit_files(self) -> list[InputFile]:
        """The files the units are row ranges of: the grouped copy when the rows were grouped."""
        return self.grouping.unit_files(self.input_files) if self.grouping else self.input_files


# ---------------------------------------------------------------- Arrow schemas from the models


def _arrow_type(annotation: Any) -> pa.DataType | None:
    """The Arrow type of a field annotation; None for `Any` (the column keeps its input type)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _arrow_type(inner)
    if origin is Literal:
        return pa.string()
    if origin is list:
        return pa.list_(_arrow_type(typing.get_args(annotation)[0]))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return pa.struct([pa.field(n, _arrow_type(f.annotation)) for n, f in annotation.model_fields.items()])
    return {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}[annotation]


def arrow_schema(model: type[BaseModel], **any_columns: pa.DataType) -> pa.Schema:
    """Arrow schema of a table contract. Fields typed `Any` (metadata) take their type from
    `any_columns`, or are left out when not given."""
    fields = []
    for name, info in model.model_fields.items():
        arrow_type = _arrow_type(info.annotation)
        if arrow_type is None:
            if name not in any_columns:
                continue
            arrow_type = any_columns[name]
        nullable = not info.is_required() or type(None) in typing.get_args(info.annotation)
        fields.append(pa.field(name, arrow_type, nullable=nullable))
    return pa.schema(fields)
