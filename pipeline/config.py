"""Job configuration: a YAML file validated by pydantic on load.

Unknown keys are errors and every message names the field. Credentials are not part of the
configuration: they come from the environment or the cloud identity (see storage.py).
"""

from __future__ import annotations

import difflib
import os
import posixpath
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas import GuardAction
from schemas.drafter import CHECKS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StorageConfig(Section):
    endpoint_url: Optional[str] = Field(None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000.")
    region: Optional[str] = Field(None, description="The S3 region; null: from the environment (AWS_DEFAULT_REGION, the profile).")
    retry_seconds: float = Field(120.0, ge=0, description="How long transient storage errors are retried.")
    shared_mounts: list[str] = Field(
        default_factory=list,
        description=(
            "Local folders every node of the cluster mounts at the same path (NFS, FSx, a hostPath shared by all "
            "pods). On a cluster of more than one node, local input, output and model paths must lie under one."
        ),
    )
    model_cache_dir: Optional[str] = Field(
        None,
        description=(
            "Each node's local folder for models read from object storage (pipeline/model_cache.py). Unset: "
            "$SPECBATCH_MODEL_CACHE, else ~/.cache/specbatch/models; `~` is each node's own home."
        ),
    )

    @model_validator(mode="after")
    def _absolute_mounts(self):
        for mount in self.shared_mounts:
            if not mount.startswith("/"):
                raise ValueError(
                    f"storage.shared_mounts: {mount!r} is not an absolute path; give the folder as every node mounts it, "
                    "e.g. /mnt/shared"
                )
        return self

    @model_validator(mode="after")
    def _no_credentials_in_url(self):
        if self.endpoint_url and "@" in self.endpoint_url.split("//", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "storage.endpoint_url must not carry credentials; remove them from the URL and give them in the environment "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the cloud identity"
            )
        return self


MODEL_URI_HELP = (
    "A local folder (or one on the cluster's shared disk), or a folder in object storage (s3:// or any fsspec URI), "
    "which each node copies once into storage.model_cache_dir. Never a model hub."
)


# fsspec schemes of model hubs: models are read from the user's own storage only.
HUB_SCHEMES = ("hf",)


def _not_a_hub(value: Optional[str], field: str) -> None:
    if value and "://" in value and value.split("://", 1)[0] in HUB_SCHEMES:
        raise ValueError(
            f"{field}: {value!r} is a model hub URI; models come from a local folder or your own storage: copy the model "
            f"there and set {field} to that folder or s3:// URI"
        )


class ModelConfig(Section):
    path: str = Field(description=f"The target model. {MODEL_URI_HELP}")
    tokenizer: Optional[str] = Field(None, description="Defaults to the model path; a local folder or a URI like model.path.")

    @model_validator(mode="after")
    def _own_storage(self):
        _not_a_hub(self.path, "model.path")
        _not_a_hub(self.tokenizer, "model.tokenizer")
        return self


# Mean acceptance length (1 + accepted / drafts) below which a drafter is refused by the probe
# and the guard acts. Measured on the kit at k=3 (docs/speculation.md): the matched EAGLE-3.1
# drafter 3.2, a same-shape drafter of another target 1.03. Speculation pays only well above it.
ACCEPTANCE_FLOOR = 1.3


class GuardConfig(Section):
    """A floor on acceptance over the last `window_units` units that drafted, checked by the
    driver as units commit (pipeline/guard.py). At least one floor. On by default; `guard: null`
    turns it off."""

    min_acceptance_rate: Optional[float] = Field(None, ge=0, le=1, description="Accepted / draft tokens.")
    min_mean_acceptance_length: Optional[float] = Field(ACCEPTANCE_FLOOR, ge=1, description="1 + accepted / drafts.")
    window_units: int = Field(4, ge=1, description="Units that drafted, pooled by their draft tokens.")
    action: GuardAction = Field(
        "disable-speculation",
        description=(
            "disable-speculation: restart the engines without the drafter and go on (speculation at acceptance near "
            "zero only costs); warn: log it; fail: stop the job."
        ),
    )

    @model_validator(mode="after")
    def _a_floor(self):
        if self.min_acceptance_rate is None and self.min_mean_acceptance_length is None:
            raise ValueError(
                "speculative.guard needs a floor: set speculative.guard.min_mean_acceptance_length (e.g. "
                f"{ACCEPTANCE_FLOOR}) or speculative.guard.min_acceptance_rate, or `guard: null` to turn the guard off"
            )
        return self


class ProbeConfig(Section):
    """`rows` of the job's own input go through the job's first engine with the drafter, at the
    job's lengths, before any unit commits (pipeline/probe.py); a drafter below the floor is
    refused."""

    rows: int = Field(64, ge=0, description="Rows probed; 0 turns the probe off.")
    min_mean_acceptance_length: float = Field(ACCEPTANCE_FLOOR, ge=1, description="The floor: 1 + accepted / drafts.")


class SpeculativeConfig(Section):
    enabled: bool = Field(True, description="false runs the target alone, without a drafter.")
    method: Literal["eagle3"] = Field(
        "eagle3", description="EAGLE-3 and EAGLE-3.1 drafters (3.1 is switched on by the drafter's own config)."
    )
    drafter: Optional[str] = Field(
        None, description=f"The EAGLE-3 / EAGLE-3.1 drafter; required when enabled. {MODEL_URI_HELP}"
    )
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Draft depth; with depth_schedule, its largest k.")
    depth_schedule: Optional[list[tuple[int, int, int]]] = Field(
        None,
        description=(
            "Depth by running sequences, vLLM's num_speculative_tokens_per_batch_size: [(lo, hi, k), ...], inclusive "
            "ranges covering 1..engine.max_num_seqs, k in 0..16 (0: no drafting). `specbatch calibrate --apply` writes it."
        ),
    )
    probe: ProbeConfig = Field(
        default_factory=ProbeConfig, description="The drafter probe, on the job's first engine before any unit commits."
    )
    checks_as_warnings: list[str] = Field(
        default_factory=list,
        description="Drafter compatibility checks (pipeline/drafter_check.py) downgraded to warnings; for experts.",
    )
    guard: Optional[GuardConfig] = Field(
        default_factory=GuardConfig, description="Acceptance guard while the job runs; null turns it off."
    )

    @model_validator(mode="after")
    def _known_checks(self):
        try:
            validate_check_names(self.checks_as_warnings)
        except ValueError as exc:
            raise ValueError(f"speculative.checks_as_warnings: {exc}") from None
        return self

    @model_validator(mode="after")
    def _drafter_own_storage(self):
        _not_a_hub(self.drafter, "speculative.drafter")
        return self

    @model_validator(mode="after")
    def _drafter_when_enabled(self):
        if self.enabled and not self.drafter:
            raise ValueError(
                "speculative.drafter is required when speculative.enabled is true: set it to the EAGLE-3 drafter's folder "
                "(a local folder with config.json, or an s3:// URI), or set speculative.enabled: false"
            )
        return self

    @model_validator(mode="after")
    def _schedule_ranges(self):
        schedule = self.depth_schedule
        if schedule is None:
            return self
        if not schedule:
            raise ValueError("speculative.depth_schedule: empty; leave it out for a single depth")
        expected_lo = 1
        for lo, hi, k in schedule:
            where = f"speculative.depth_schedule entry ({lo}, {hi}, {k})"
            if lo != expected_lo:
                raise ValueError(
                    f"{where}: starts at {lo}; make it start at {expected_lo} (ranges start at 1, in order, no gap or overlap)"
                )
            if hi < lo:
                raise ValueError(f"{where}: ends before it starts; swap {lo} and {hi}")
            if not 0 <= k <= 16:
                raise ValueError(f"{where}: k must be 0..16")
            expected_lo = hi + 1
        if max(k for _, _, k in schedule) == 0:
            raise ValueError("speculative.depth_schedule: k is 0 everywhere; set speculative.enabled: false instead")
        self.num_speculative_tokens = max(k for _, _, k in schedule)
        return self


class EngineConfig(Section):
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and activations; auto: the model's own. float32 is fastest on vLLM's CPU build."
    )
    max_model_len: int = Field(
        2048,
        ge=16,
        description=(
            "Prompt plus output tokens of one request; a prompt of this many tokens or more goes to errors/ "
            "(prompt_too_long). At most the model's max_position_embeddings."
        ),
    )
    max_num_seqs: int = Field(256, ge=1, description="Sequences one engine runs at once (vLLM's max_num_seqs).")
    max_num_batched_tokens: Optional[int] = Field(
        None, ge=16, description="Tokens one engine step takes at most (vLLM's max_num_batched_tokens); null: vLLM's default."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "Tensor-parallel workers of one engine. Above 1 on GPUs: one placement group per replica and vLLM's Ray "
            "executor; on the CPU build, vLLM's multiprocessing executor on one node (docs/cluster.md)."
        ),
    )
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages of one engine; see pipeline_placement.")
    pipeline_placement: Literal["PACK", "SPREAD"] = Field(
        "PACK",
        description=(
            "How a pipeline-parallel engine's GPUs are placed (Ray placement group strategy): PACK keeps them on as "
            "few nodes as fit, SPREAD puts its stages on different nodes. Tensor parallelism alone is STRICT_PACK."
        ),
    )
    gpu_memory_utilization: float = Field(
        0.90, gt=0, le=1, description="Share of each GPU's memory vLLM may take (weights, activations, KV cache)."
    )
    enforce_eager: bool = Field(
        False, description="No CUDA graphs or torch.compile; true on CPU: the engine starts in ~20 s instead of ~50 s."
    )
    seed: int = Field(0, description="The engine's random seed.")
    cpu_kv_cache_gib: int = Field(1, ge=1, description="KV cache on vLLM's CPU build (VLLM_CPU_KVCACHE_SPACE).")
    json_whitespace: bool = Field(
        True,
        description=(
            "JSON outputs (response_format json_schema, json_object) may hold any whitespace between tokens, vLLM's "
            "default; false: compact JSON only, which keeps a model that likes whitespace from filling max_tokens with it."
        ),
    )
    cpu_omp_threads_bind: Optional[str] = Field(
        None,
        description=(
            "vLLM's CPU build: cores of each engine worker (VLLM_CPU_OMP_THREADS_BIND), e.g. '0-3|4-7' for two "
            "tensor-parallel workers, or 'nobind'. Unset: vLLM binds one NUMA node per worker."
        ),
    )
    extra_args: dict[str, Any] = Field(default_factory=dict, description="Passed to vLLM's engine args as is.")


# The most top-k logprobs a row may ask for (vLLM's max_logprobs default, and OpenAI's cap on
# top_logprobs). Each generated token costs 1 + k (token_id, token, logprob) entries in its row:
# measured about 58 KB per row of 256 tokens at k=20 in zstd Parquet (docs/sampling.md).
MAX_LOGPROBS = 20
MAX_SAMPLES = 128


class JsonSchemaFormat(Section):
    """OpenAI's `response_format.json_schema`."""

    name: str = Field("response", description="OpenAI's field: accepted, not used for generation.")
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON Schema every output must follow.")
    strict: Optional[bool] = Field(None, description="OpenAI's field: accepted; the output always follows the schema.")
    description: Optional[str] = Field(None, description="OpenAI's field: accepted, not used for generation.")

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    @model_validator(mode="after")
    def _valid_schema(self):
        import jsonschema

        try:
            jsonschema.validators.validator_for(self.schema_).check_schema(self.schema_)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"json_schema.schema is not a valid JSON Schema: {exc.message}") from None
        return self


class ResponseFormat(Section):
    """Structured output, in OpenAI's `response_format` shape plus vLLM's own constraints:
    {type: json_schema, json_schema: {name, schema}}, {type: json_object}, {type: regex, regex},
    {type: choice, choice: [...]}, {type: grammar, grammar} (EBNF), or {type: text} (none)."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"] = Field(
        description="The kind of constraint; text: none. Each of json_schema, regex, choice, grammar needs its own field."
    )
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="With type json_schema: the schema, OpenAI's shape.")
    regex: Optional[str] = Field(None, description="With type regex: the regular expression every output matches.")
    choice: Optional[list[str]] = Field(None, description="With type choice: every output is one of these strings.")
    grammar: Optional[str] = Field(None, description="With type grammar: the EBNF grammar every output follows.")

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        needed = self.type if self.type in ("json_schema", "regex", "choice", "grammar") else None
        if needed and given != [needed]:
            raise ValueError(f"response_format of type {self.type!r} needs the field {needed!r} and no other constraint")
        if not needed and given:
            raise ValueError(f"response_format of type {self.type!r} takes no {given[0]!r}")
        if self.choice is not None and not self.choice:
            raise ValueError("response_format.choice is empty; give at least one choice")
        if self.regex is not None:
            import re

            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"response_format.regex does not compile: {exc}") from None
        return self


class SamplingConfig(Section):
    """Default sampling parameters (vLLM's SamplingParams, by the same names). A row overrides
    any of them: max_tokens, temperature, top_p, seed, n, stop and response_format as columns of
    their own, the rest as keys of its `sampling` column (a JSON object)."""

    max_tokens: int = Field(256, ge=1, description="Tokens generated per sample at most; below engine.max_model_len.")
    n: int = Field(1, ge=1, le=MAX_SAMPLES, description="Samples per prompt: one output row per (id, sample_index); n > 1 needs temperature > 0.")
    temperature: float = Field(
        0.0, ge=0, description="0: greedy. Above 0 with speculation is refused on vLLM's CPU build (gpus_per_replica: 0)."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Sample from the smallest set of tokens whose probabilities add up to top_p.")
    top_k: int = Field(0, ge=-1, description="0 or -1: all tokens.")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Drop tokens below min_p x the top token's probability; refused with speculation (vLLM refuses it)."
    )
    seed: Optional[int] = Field(
        None, ge=0, description="With n > 1, sample i uses seed + i (vLLM): a row with a seed gives the same samples on a rerun."
    )
    repetition_penalty: float = Field(1.0, gt=0, description="Above 1 discourages tokens already in the prompt or the output.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="Taken off the logit of every token already generated.")
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="Taken off the logit of a token once per time it was already generated."
    )
    stop: list[str] = Field(default_factory=list, description="Strings that end the output (not included in it).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end the output.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string at the end of the text.")
    min_tokens: int = Field(0, ge=0, description="Tokens generated before EOS or a stop may end the output.")
    bad_words: list[str] = Field(default_factory=list, description="Words never generated.")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="Token id -> bias added to its logit.")
    allowed_token_ids: list[int] = Field(default_factory=list, description="When set, only these tokens are generated.")
    ignore_eos: bool = Field(False, description="Go on after EOS, up to max_tokens.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    spaces_between_special_tokens: bool = Field(True, description="Put spaces between special tokens in the text.")
    logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description=f"Top-k logprobs of each generated token (0: the chosen token's only) in the `logprobs` column; at most {MAX_LOGPROBS}; null: off.",
    )
    prompt_logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Top-k logprobs of each prompt token in the `prompt_logprobs` column; null: off."
    )
    response_format: Optional[ResponseFormat] = Field(
        None, description="Structured output; each output row says whether it parsed (`parsed`, `parse_error`)."
    )
    clip_max_tokens: bool = Field(
        True,
        description=(
            "A row whose max_tokens does not fit beside its prompt in engine.max_model_len: true generates what fits "
            "and marks the row (max_tokens_clipped, and clipped_rows in its unit's stats); false makes it a final error."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) is above max_tokens ({self.max_tokens}); lower min_tokens or raise max_tokens"
            )
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"n is {self.n} at temperature 0; vLLM samples n > 1 only at a temperature above 0: raise temperature, or set n: 1"
            )
        return self


# Job-level only: a row cannot change them.
JOB_ONLY_SAMPLING = ("clip_max_tokens",)


class ChatConfig(Section):
    """How `messages` rows become prompts."""

    system_prompt: Optional[str] = Field(None, description="Put first in every conversation that has no system message.")
    template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the chat template, e.g. {enable_thinking: false}."
    )
    reasoning_parser: Optional[str] = Field(
        None,
        description=(
            "One of vLLM's reasoning parsers (e.g. deepseek_r1, qwen3): the reasoning goes in the `reasoning` column "
            "and `text` keeps the answer."
        ),
    )


class LoraConfig(Section):
    """LoRA adapters a row may ask for by name in its `lora` column; rows without one use the
    base model. vLLM loads up to `max_loras` adapters into one batch."""

    adapters: dict[str, str] = Field(description="Name -> adapter folder in PEFT format (local path or URI).")
    max_rank: int = Field(16, ge=1, description="The largest rank among the adapters (vLLM's max_lora_rank).")
    max_loras: int = Field(4, ge=1, description="Adapters in one engine batch (vLLM's max_loras).")

    @model_validator(mode="after")
    def _named(self):
        if not self.adapters:
            raise ValueError("lora.adapters is empty; leave lora out for the base model only")
        return self


class ReplicaRange(Section):
    """An autoscaling engine pool: Ray Data starts `min` engines and adds engines up to `max`
    while work is queued and the cluster (or its autoscaler) has room for them."""

    min: int = Field(ge=1, description="Engines the pool starts with; the job needs room for these.")
    max: int = Field(ge=1, description="Engines the pool may grow to.")

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise ValueError(f"resources.replicas: min ({self.min}) is larger than max ({self.max}); swap them")
        return self


class ResourcesConfig(Section):
    replicas: int | ReplicaRange = Field(
        1, description="Engine actors, one vLLM engine each: a number, or {min, max} for a pool that grows as nodes join."
    )
    gpus_per_replica: float = Field(
        0, ge=0, description="0 on the CPU build; tensor_parallel_size x pipeline_parallel_size on GPUs."
    )
    cpus_per_replica: float = Field(1, gt=0, description="CPUs each engine actor reserves; on the CPU build one per engine worker at least.")
    resources_per_replica: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each engine needs, to place engines on some nodes only, e.g. {gpu_node: 1}.",
    )
    accelerator: str = Field("cpu", description="What a replica runs on, for cost reports, e.g. nvidia-a100-80gb.")
    rows_per_unit: int = Field(
        4096,
        ge=1,
        description=(
            "Rows per work unit: one commit, one output file and one stats row each, and what a crash can cost. "
            "4,096 rows are a few minutes of one GPU replica (2,442 units at 10M prompts)."
        ),
    )
    units_in_flight: int = Field(2, ge=1, description="Units overlapping inside one engine: it stays full across a unit's tail.")
    preprocess_concurrency: int = Field(1, ge=1, description="CPU actors that validate and tokenize.")

    @model_validator(mode="after")
    def _replicas_at_least_one(self):
        if isinstance(self.replicas, int) and self.replicas < 1:
            raise ValueError("resources.replicas must be at least 1")
        for name, amount in self.resources_per_replica.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ValueError(
                    f"resources.resources_per_replica.{name}: custom resources only, each above 0; give CPUs and "
                    "GPUs as resources.cpus_per_replica and resources.gpus_per_replica"
                )
        return self

    @property
    def min_replicas(self) -> int:
        return self.replicas if isinstance(self.replicas, int) else self.replicas.min

    @property
    def max_replicas(self) -> int:
        return self.replicas if isinstance(self.replicas, int) else self.replicas.max


class RetriesConfig(Section):
    max_actor_restarts: int = Field(
        8, ge=0, description="Engine actor restarts (engine death, crash, preempted node); a poisoned row costs a few."
    )
    max_unit_retries: int = Field(8, ge=0, description="Retries of a unit whose actor died.")
    max_node_losses: int = Field(
        8,
        ge=0,
        description=(
            "Nodes an attempt may lose (spot reclaim, crash): each time the graph is rebuilt over the units not "
            "committed yet, on the nodes that are left. One more fails the attempt."
        ),
    )
    stall_minutes: float = Field(
        30.0,
        gt=0,
        description=(
            "The job stops with SchedulingStalled when no unit commits for this long while engines or tasks wait "
            "for resources the cluster does not have."
        ),
    )
    isolate_after_attempts: int = Field(
        2,
        ge=1,
        description="A unit in flight at this many engine deaths runs its suspects alone in the engine; one that kills it alone goes to errors/.",
    )
    max_error_fraction: float = Field(
        0.05, ge=0, le=1, description="Above this share of error rows a finished job is completed_with_errors, not succeeded."
    )
    breaker_window_units: int = Field(
        8, ge=1, description="The job stops when the error share of this many units in a row is above max_error_fraction."
    )
    breaker_consecutive_units: int = Field(
        3, ge=1, description="The job stops when this many units in a row have retryable (infrastructure) errors."
    )


class LeaseConfig(Section):
    heartbeat_seconds: float = Field(30.0, gt=0, description="How often a run renews its lease on the output location.")
    stale_after_seconds: float = Field(
        180.0, gt=0, description="A lease not renewed for this long belongs to a dead run; --take-over may take it."
    )

    @model_validator(mode="after")
    def _stale_after_beats(self):
        if self.stale_after_seconds < 2 * self.heartbeat_seconds:
            raise ValueError(
                f"lease.stale_after_seconds ({self.stale_after_seconds:g}) must be at least twice lease.heartbeat_seconds "
                f"({self.heartbeat_seconds:g}): raise it to {2 * self.heartbeat_seconds:g} or more, or lower the heartbeat"
            )
        return self


class JobConfig(Section):
    job_name: str = Field(
        "specbatch", pattern=r"^[A-Za-z0-9_.-]+$", description="Prefix of generated job ids: letters, digits, _ . -."
    )
    input_uri: str = Field(description="A Parquet file, a folder or a glob; s3:// or any fsspec scheme.")
    input_format: Literal["parquet", "openai_batch"] = Field(
        "parquet",
        description=(
            "openai_batch: input_uri names JSONL files of OpenAI batch requests (a file, a folder of .jsonl files or a "
            "glob), converted once into Parquet prompt rows under output_uri/_inputs/ (pipeline/openai_batch.py)."
        ),
    )
    unsupported_requests: Literal["refuse", "errors"] = Field(
        "refuse",
        description=(
            "openai_batch input: refuse refuses the whole job over any request line specbatch cannot run, as OpenAI's "
            "batch validation does; errors makes each such line with a custom_id its row in errors/ (unsupported_request, "
            "naming the field), an error line of the export, and runs the rest. Lines that are not JSON, lack a "
            "custom_id or repeat one are refused either way."
        ),
    )
    output_uri: str = Field(
        description=(
            "Where outputs/, errors/, stats/ and _job.json go: a local folder or a URI (any fsspec scheme). A rerun on it "
            "resumes. Never inside input_uri: a rerun would read the outputs as input."
        )
    )
    model: ModelConfig = Field(description="The target model: model.path, a local folder with config.json or an s3:// URI.")
    speculative: SpeculativeConfig = Field(
        default_factory=lambda: SpeculativeConfig(enabled=False),
        description=(
            "Speculative decoding with an EAGLE-3 / EAGLE-3.1 drafter. Left out (or null): no speculation, plain "
            "decoding, since there is no drafter to draft with. Given: on unless `enabled: false`, and then "
            "speculative.drafter is required."
        ),
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings; one engine per replica.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling defaults; rows override them.")
    chat: ChatConfig = Field(default_factory=ChatConfig, description="How `messages` rows become prompts.")
    lora: Optional[LoraConfig] = Field(
        None,
        description=(
            "LoRA adapters rows may ask for by name; null: the base model only. On vLLM's CPU build with speculation "
            "only at speculative.num_speculative_tokens: 1 (docs/sampling.md)."
        ),
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Engines, their resources, and work units.")
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="How storage is reached; credentials come from the environment, never from here."
    )
    retries: RetriesConfig = Field(default_factory=RetriesConfig, description="Retries and the circuit breaker.")
    lease: LeaseConfig = Field(default_factory=LeaseConfig, description="One run at a time on an output location.")

    @field_validator("speculative", mode="before")
    @classmethod
    def _no_section_no_speculation(cls, value):
        return {"enabled": False} if value is None else value

    @model_validator(mode="after")
    def _output_outside_input(self):
        inside = output_inside_input(self.input_uri, self.output_uri)
        if inside:
            raise ValueError(
                f"output_uri ({self.output_uri}) {inside} the folder input_uri ({self.input_uri}) reads from: the job would "
                "work once, then a rerun would read its own outputs as input. Set output_uri to a folder outside input_uri "
                "(e.g. a sibling folder), or move the input into a folder of its own"
            )
        return self

    @model_validator(mode="after")
    def _unsupported_requests_of_batch_files(self):
        if self.unsupported_requests != "refuse" and self.input_format != "openai_batch":
            raise ValueError(
                f"unsupported_requests: {self.unsupported_requests} applies to OpenAI batch files only: set "
                "input_format: openai_batch, or remove unsupported_requests (a bad Parquet row is always its row's error)"
            )
        return self

    @model_validator(mode="after")
    def _schedule_covers_max_num_seqs(self):
        schedule = self.speculative.depth_schedule
        if schedule and schedule[-1][1] < self.engine.max_num_seqs:
            raise ValueError(
                f"speculative.depth_schedule ends at {schedule[-1][1]}; it must cover 1..engine.max_num_seqs "
                f"({self.engine.max_num_seqs}): end its last range at {self.engine.max_num_seqs}"
            )
        return self

    @model_validator(mode="after")
    def _gpus_match_parallelism(self):
        gpus, engine = self.resources.gpus_per_replica, self.engine
        workers = engine.tensor_parallel_size * engine.pipeline_parallel_size
        if gpus and gpus != workers and workers > 1:
            raise ValueError(
                f"resources.gpus_per_replica ({gpus:g}) must be engine.tensor_parallel_size x "
                f"engine.pipeline_parallel_size ({workers}): one GPU per engine worker; set resources.gpus_per_replica: "
                f"{workers}, or change the parallel sizes"
            )
        if gpus and gpus < workers:
            raise ValueError(
                f"resources.gpus_per_replica ({gpus:g}) is smaller than the engine's {workers} workers; set it to {workers}"
            )
        return self

    @model_validator(mode="after")
    def _cpu_cores_per_worker(self):
        workers = self.engine_workers
        if workers > 1 and not self.resources.gpus_per_replica and self.resources.cpus_per_replica < workers:
            raise ValueError(
                f"resources.cpus_per_replica ({self.resources.cpus_per_replica:g}) is below the engine's {workers} "
                f"workers: on vLLM's CPU build each tensor/pipeline-parallel worker needs a core of its own; set "
                f"resources.cpus_per_replica: {workers} or more"
            )
        return self

    @model_validator(mode="after")
    def _sampling_runs_with_speculation(self):
        if not self.speculative.enabled:
            return self
        conflicts = speculation_conflicts(self.sampling, cpu_engine=not self.resources.gpus_per_replica)
        if conflicts:
            name, why = conflicts[0]
            fix = "" if "speculative.enabled: false" in why else f"; leave sampling.{name} out, or set speculative.enabled: false"
            raise ValueError(f"sampling.{name} with speculative.enabled: {why}{fix}")
        return self

    @model_validator(mode="after")
    def _lora_runs_with_speculation(self):
        if self.lora and self.speculation == "cpu" and self.speculative.num_speculative_tokens > 1:
            raise ValueError(
                "lora with speculative decoding on vLLM's CPU build: vLLM 0.32 crashes the engine at "
                "num_speculative_tokens > 1 when the drafter shares the target's embedding, as EAGLE-3 drafters do "
                "(measured, docs/sampling.md); use speculative.num_speculative_tokens: 1, speculative.enabled: false, "
                "or GPU engines"
            )
        return self

    @property
    def speculation(self) -> Optional[str]:
        """None without speculation; "gpu", or "cpu" for engines on vLLM's CPU build (no GPUs)."""
        if not self.speculative.enabled:
            return None
        return "gpu" if self.resources.gpus_per_replica else "cpu"

    @property
    def engine_workers(self) -> int:
        """Processes of one engine that each hold a device: tensor x pipeline parallel."""
        return self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size

    def redacted(self) -> dict[str, Any]:
        """The config as recorded in manifests: no credentials can be in it (validated above),
        and query strings of URIs, where signed tokens hide, are dropped."""
        data = self.model_dump(mode="json")
        for key in ("input_uri", "output_uri"):
            data[key] = data[key].split("?", 1)[0]
        return data


class ConfigError(ValueError):
    pass


# ---------------------------------------------------------------- where outputs may go


GLOB_CHARS = "*?["


def _comparable(uri: str) -> tuple[str, bool]:
    """(the path or URI normalized for prefix comparison, whether it reaches into subfolders).
    The query string and file:// are dropped, the scheme lowercased, `.`, `..`, doubled and
    trailing slashes resolved. A glob is cut to the folder above its first wildcard: every file
    it can match lies there, and in its subfolders only when the rest of the pattern has a `/`
    or `**`. A folder is read recursively."""
    uri = uri.split("?", 1)[0]
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    deep = True
    cut = min((uri.index(c) for c in GLOB_CHARS if c in uri), default=None)
    if cut is not None:
        folder = uri[:cut].rsplit("/", 1)[0] if "/" in uri[:cut] else ""
        rest = uri[len(folder):].lstrip("/")
        deep = "/" in rest or "**" in rest
        uri = folder
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        rest = posixpath.normpath(rest) if rest.strip("/") else ""
        return f"{scheme.lower()}://{rest.strip('/')}", deep
    return os.path.normpath(os.path.abspath(uri or ".")), deep


def output_inside_input(input_uri: str, output_uri: str) -> Optional[str]:
    """"is" or "is inside" when the job's outputs would land where its input is read from
    (local paths and URIs alike), else None. A job writes files in output_uri itself
    (_job.json) and Parquet files in its subfolders (outputs/, stats/, ...)."""
    (inp, deep), (out, _) = _comparable(input_uri), _comparable(output_uri)
    if ("://" in inp) != ("://" in out):
        return None
    if out == inp:
        return "is"
    return "is inside" if deep and out.startswith(inp.rstrip("/") + "/") else None


# ---------------------------------------------------------------- messages that say what to do


def closest(word: str, choices: Iterable[str], cutoff: float = 0.6) -> Optional[str]:
    """The choice a mistyped `word` most likely meant (case aside), or None: the one
    did-you-mean of config keys, row overrides, LoRA names and drafter check names."""
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(str(choice).lower(), str(choice))
    match = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[match[0]] if match else None


def speculation_conflicts(sampling: SamplingConfig, cpu_engine: bool) -> list[tuple[str, str]]:
    """(parameter, why) pairs that cannot run with speculative decoding: vLLM refuses min_p and
    logit_bias there, and its CPU build samples wrongly at temperature > 0 (outputs that do not
    follow the distribution, seeds that do not repeat; measured in docs/sampling.md)."""
    conflicts = []
    if sampling.min_p > 0:
        conflicts.append(("min_p", "vLLM refuses min_p with speculative decoding"))
    if sampling.logit_bias:
        conflicts.append(("logit_bias", "vLLM refuses logit_bias with speculative decoding"))
    if cpu_engine and sampling.temperature > 0:
        conflicts.append((
            "temperature",
            "vLLM's CPU build samples wrongly with speculative decoding at temperature > 0 (outputs off the "
            "distribution, seeds not repeatable): use temperature 0, or speculative.enabled: false",
        ))
    return conflicts


def validate_check_names(names: Iterable[str]) -> list[str]:
    """Drafter check names (schemas.drafter.CHECKS), or a ValueError naming the unknown ones and the valid checks."""
    names = list(names)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        hints = [f"{n!r} (did you mean {closest(n, CHECKS)!r}?)" if closest(n, CHECKS) else repr(n) for n in unknown]
        raise ValueError(f"unknown drafter check(s) {', '.join(hints)}; valid checks: {', '.join(CHECKS)}")
    return names


def _keys(model: type[BaseModel]) -> list[str]:
    """The keys a section takes, as written in YAML (aliases where a field has one)."""
    return [field.alias or name for name, field in model.model_fields.items()]


def _field(model: type[BaseModel], key: str):
    return next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)


def _members(annotation: Any) -> list[Any]:
    """The types of a union (None left out), or [annotation]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _section(annotation: Any) -> Optional[type[BaseModel]]:
    members = _members(annotation)
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None


def _item(annotation: Any) -> Any:
    """What a list index or a dict key of `annotation` holds."""
    args = typing.get_args(_members(annotation)[0]) if len(_members(annotation)) == 1 else ()
    return args[-1] if args else None


def _locate(loc: tuple) -> tuple[list[str], Optional[type[BaseModel]], bool]:
    """(the path as the user wrote it, the section its last key belongs to, whether it went
    through a union member other than a section). pydantic puts a union member's tag in the
    location (`resources.replicas.function-after[_ordered(), ReplicaRange].max`); it is left out."""
    parts: list[str] = []
    current: Any = JobConfig
    owner: Optional[type[BaseModel]] = None
    scalar_member = False
    for seg in loc:
        section = _section(current)
        if section is not None and isinstance(seg, str):
            owner, field = section, _field(section, seg)
            parts.append(seg)
            current = field.annotation if field else None
            continue
        members = _members(current) if current is not None else []
        if len(members) > 1 and isinstance(seg, str):
            named = [m for m in members if re.search(rf"\b{re.escape(getattr(m, '__name__', str(m)))}\b", seg)]
            current = named[0] if named else None
            scalar_member = scalar_member or _section(current) is None
            continue
        parts.append(str(seg))
        owner, current = None, _item(current) if current is not None else None
    return parts, owner, scalar_member


def _sections(model: Optional[type[BaseModel]] = None, prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every section of the job config by its dotted path ("" for the top level)."""
    model = model or JobConfig
    found = {prefix: model}
    for name, field in model.model_fields.items():
        for member in _members(field.annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                found.update(_sections(member, f"{prefix}{field.alias or name}."))
    return found


def unknown_key_message(key: str, where: str, owner: type[BaseModel]) -> str:
    """`unknown key; did you mean 'max_num_seqs'?` for a typo of a key of this section, else the
    key's own section when it sits in another one (`max_tokens` under engine), else a looser
    match, else the keys this section takes."""
    typo = closest(key, _keys(owner), cutoff=0.8)
    if typo:
        return f"unknown key; did you mean {typo!r}?"
    elsewhere = [path + key for path, section in _sections().items() if key in _keys(section) and section is not owner]
    if elsewhere:
        return f"unknown key here; did you mean {elsewhere[0]!r}?"
    close = closest(key, _keys(owner))
    if close:
        return f"unknown key; did you mean {close!r}?"
    return f"unknown key; {where or 'the top level'} takes: {', '.join(_keys(owner))}"


def _error_line(err: dict) -> Optional[str]:
    parts, owner, _ = _locate(tuple(err["loc"]))
    path = ".".join(parts)
    if err["type"] == "extra_forbidden" and owner is not None:
        return f"{path}: {unknown_key_message(parts[-1], '.'.join(parts[:-1]), owner)}"
    if err["type"] == "missing":
        field = _field(owner, parts[-1]) if owner is not None else None
        about = f": {field.description}" if field is not None and field.description else ""
        return f"{path}: required, and not set{about}"
    message = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if not path or message.startswith(parts[0]):  # a rule across fields names them itself
        return message
    return f"{path}: {message}"


def config_error_lines(exc: ValidationError) -> list[str]:
    """One line per problem, each naming the field and what to do. A union's member that does not
    match what was given (an int where a mapping was written) is not reported beside the member
    that does."""
    errors = exc.errors()
    located = [(_locate(tuple(e["loc"])), e) for e in errors]
    section_paths = {tuple(parts[:-1]) for (parts, owner, scalar), _ in located if not scalar and owner is not None}
    lines: list[str] = []
    for (parts, owner, scalar), err in located:
        if scalar and isinstance(err.get("input"), dict) and tuple(parts) in section_paths:
            continue
        line = _error_line(err)
        if line and line not in lines:
            lines.append(line)
    return lines


def parse_config(data: dict[str, Any], source: str = "<config>") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: invalid job config"] + [f"  {line}" for line in config_error_lines(exc)]
        raise ConfigError("\n".join(lines)) from None


def load_config(uri: str, overrides: Optional[dict[str, Any]] = None) -> JobConfig:
    """Load a YAML job config from a local path or any fsspec URI; `overrides` are applied
    on top at the top level (e.g. {"output_uri": ...} for a dated output prefix)."""
    import fsspec

    if Path(uri).exists():
        text = Path(uri).read_text()
    elif "://" not in uri:
        raise ConfigError(f"{uri}: no such config file; give the path of a job YAML (jobs/configs/local.yaml is an example)")
    else:
        try:
            with fsspec.open(uri, "r") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"{uri}: no such config file; give the URI of a job YAML") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{uri}, line {mark.line + 1}, column {mark.column + 1}" if mark else uri
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc}); fix it there") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{uri}: a job config is a YAML mapping (`input_uri: ...`, `output_uri: ...`, `model: {{path: ...}}`), "
            f"got {type(data).__name__}"
        )
    _resolve_relative_paths(data, Path(uri).resolve().parent if Path(uri).exists() else None, uri)
    data.update(overrides or {})
    return parse_config(data, source=uri)


# Local paths of a config; a relative one is relative to the config file's folder. A URI
# (anything with "://": s3://, gs://, file://) is left as it is.
PATH_FIELDS = (("input_uri",), ("output_uri",), ("model", "path"), ("model", "tokenizer"), ("speculative", "drafter"))


def _resolve_relative_paths(data: dict[str, Any], folder: Optional[Path], source: str) -> None:
    """Relative local paths resolve against the config file's folder, never against the
    process's working directory (under `ray job submit` an uploaded package in Ray's temp
    folder). A config that is not a local file cannot have them."""
    for keys in PATH_FIELDS:
        parent = data
        for key in keys[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        value = parent.get(keys[-1]) if isinstance(parent, dict) else None
        if not isinstance(value, str) or "://" in value or Path(value).is_absolute():
            continue
        if folder is None:
            raise ConfigError(
                f"{source}: {'.'.join(keys)} = {value!r} is a relative path, and the config is not a local file it "
                "could be relative to; use an absolute path or a URI"
            )
        parent[keys[-1]] = os.path.normpath(folder / value)
    adapters = (data.get("lora") or {}).get("adapters") if isinstance(data.get("lora"), dict) else None
    for name, value in (adapters or {}).items() if isinstance(adapters, dict) else ():
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            if folder is None:
                raise ConfigError(
                    f"{source}: lora.adapters.{name} = {value!r} is a relative path, and the config is not a local file it "
                    "could be relative to; use an absolute path or a URI"
                )
            adapters[name] = os.path.normpath(folder / value)
