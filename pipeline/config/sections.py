"""The sections of a job config for storage, the model, speculation and the engine."""

from __future__ import annotations

import posixpath
from typing import Any, Iterable, Literal, Optional

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section, closest
from pipeline.config.paths import MODEL_URI_HELP, _not_a_hub
from schemas import GuardAction
from schemas.drafter import CHECKS


class StorageConfig(Section):
    endpoint_url: Optional[str] = Field(None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000.")
    region: Optional[str] = Field(
        None, description="The S3 region; null: from the environment (AWS_DEFAULT_REGION, the profile)."
    )
    outage_seconds: float = Field(
        120.0,
        ge=0,
        description=(
            "How long a store that stops answering is waited for: every storage call retries transient errors "
            "(timeouts, refused connections, throttling) with backoff for this long, then fails the attempt naming "
            "the store, the operation and the key; a rerun resumes. A store back within it costs only the wait. "
            "(Formerly retry_seconds, still accepted.)"
        ),
    )
    request_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description=(
            "The bound on one attempt at a storage request: S3's connect and read timeouts (the read timeout is how "
            "long the store may stay silent while it answers; it starts once an upload's body is sent, so a large part "
            "on a slow link does not trip it) and, 1 s over it, the deadline of the whole call, plus 2 s per MiB the "
            "call sends. 30 s is far above S3's answers (tens of ms; throttling is answered at once) and a quarter of "
            "the default outage window: a call to a store that stopped gives up within outage_seconds plus this."
        ),
    )
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
            "Each node's local folder for models read from object storage (pipeline/storage/model_cache.py). Unset: "
            "$SPECBATCH_MODEL_CACHE, else ~/.cache/specbatch/models; `~` is each node's own home."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "retry_seconds" in data:
            if "outage_seconds" in data:
                raise ValueError(
                    "storage.retry_seconds is the former name of storage.outage_seconds: give only outage_seconds"
                )
            data = {**data, "outage_seconds": data["retry_seconds"]}
            del data["retry_seconds"]
        return data

    @model_validator(mode="after")
    def _absolute_mounts(self):
        for mount in self.shared_mounts:
            if not mount.startswith("/"):
                raise ValueError(
                    f"storage.shared_mounts: {mount!r} is not an absolute path; give the folder as every node mounts "
                    "it, e.g. /mnt/shared"
                )
        return self

    @model_validator(mode="after")
    def _no_credentials_in_url(self):
        if self.endpoint_url and "@" in self.endpoint_url.split("//", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "storage.endpoint_url must not carry credentials; remove them from the URL and give them in the "
                "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the cloud identity"
            )
        return self


class ModelConfig(Section):
    path: str = Field(description=f"The target model. {MODEL_URI_HELP}")
    tokenizer: Optional[str] = Field(
        None, description="Defaults to the model path; a local folder or a URI like model.path."
    )
    served_names: list[str] = Field(
        default_factory=list,
        description=(
            "OpenAI batch input: the names a line's body.model may give for the target, beside model.path and its "
            "folder name (as vLLM's --served-model-name). A line naming another model is that row's error "
            "(model_not_found), as vLLM's run-batch answers it."
        ),
    )

    @property
    def names(self) -> tuple[str, ...]:
        """What a request may call the target: its path, its folder's name, and served_names."""
        return (self.path, posixpath.basename(self.path.rstrip("/")), *self.served_names)

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
    driver as units commit (pipeline/speculation/guard.py). At least one floor. On by default; `guard: null`
    turns it off."""

    min_acceptance_rate: Optional[float] = Field(None, ge=0, le=1, description="Accepted / draft tokens.")
    min_mean_acceptance_length: Optional[float] = Field(ACCEPTANCE_FLOOR, ge=1, description="1 + accepted / drafts.")
    min_tokens_per_target_pass: Optional[float] = Field(
        ACCEPTANCE_FLOOR,
        ge=1,
        description=(
            "Generated tokens per target decode pass: what speculation saved, counting the drafts a grammar cut "
            "(vLLM's acceptance counters leave them out: a `choice` constraint reads acceptance 1.000 while saving "
            "nothing)."
        ),
    )
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
        if (
            self.min_acceptance_rate is None
            and self.min_mean_acceptance_length is None
            and self.min_tokens_per_target_pass is None
        ):
            raise ValueError(
                "speculative.guard needs a floor: set speculative.guard.min_mean_acceptance_length (e.g. "
                f"{ACCEPTANCE_FLOOR}), speculative.guard.min_tokens_per_target_pass or "
                "speculative.guard.min_acceptance_rate, or `guard: null` to turn the guard off"
            )
        return self


class ProbeConfig(Section):
    """`rows` of the job's own input go through the job's first engine with the drafter, at the
    job's lengths, before any unit commits (pipeline/speculation/probe.py); a drafter below the floor is
    refused."""

    rows: int = Field(64, ge=0, description="Rows probed; 0 turns the probe off.")
    min_mean_acceptance_length: float = Field(ACCEPTANCE_FLOOR, ge=1, description="The floor: 1 + accepted / drafts.")
    min_tokens_per_target_pass: float = Field(
        ACCEPTANCE_FLOOR,
        ge=1,
        description=(
            "The floor on generated tokens per target decode pass, which counts the drafts a grammar cut "
            "(vLLM's acceptance counters do not)."
        ),
    )


class TrialConfig(Section):
    """Speculation against off on the job's own traffic (pipeline/speculation/policy.py): with a
    calibration, predicted from its step costs and the probe's acceptance; without, the trial
    times `units` units (and `min_seconds`) each way on the first engine, keeping speculation only
    when it paid over the units' spread. Too few units (under 4 x `units`) or too short a rest
    (`payback_starts`) skip the trial, saying why."""

    units: int = Field(
        4, ge=1, description="Units measured with each setting (one engine's; at least engine units in flight)."
    )
    min_seconds: float = Field(
        20.0,
        ge=0,
        description=(
            "Engine seconds each setting is measured for, at least (after `units` units, more units until then, "
            "up to a quarter of the job's rows): a few short units measure the host's noise more than the setting."
        ),
    )
    margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description=(
            "How much faster than off speculation's median must measure, beyond paying over its whole spread, "
            "before the trial turns it back on (0.05: 5%)."
        ),
    )
    payback_starts: float = Field(
        5.0,
        ge=0,
        description=(
            "The trial measures off only when the rest of the job is at least this many engine starts of generation "
            "per engine, and turns speculation back on only when that saves more than a start; 0 measures and follows "
            "the faster whatever the job's size (benchmarks, tests)."
        ),
    )


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
            "ranges covering 1..engine.max_num_seqs, k in 0..16 (0: no drafting). `specbatch calibrate --apply` writes "
            "it."
        ),
    )
    depth_from: Literal["config", "calibration"] = Field(
        "config",
        description=(
            "calibration: the depth (or schedule, or off) that the matching calibration in the store recommends, "
            "read when the job plans; without one the job runs num_speculative_tokens and says so."
        ),
    )
    calibrations: Optional[str] = Field(
        None,
        description=(
            "The calibration store (a folder or URI) that `specbatch calibrate` writes to and jobs read from, keyed by "
            "target, drafter, accelerator and engine settings. Default: $SPECBATCH_CALIBRATIONS, else "
            "~/.cache/specbatch/calibrations on the machine that drives the job (a cluster's head node)."
        ),
    )
    probe: ProbeConfig = Field(
        default_factory=ProbeConfig, description="The drafter probe, on the job's first engine before any unit commits."
    )
    checks_as_warnings: list[str] = Field(
        default_factory=list,
        description=(
            "Drafter compatibility checks (pipeline/speculation/drafter_check.py) downgraded to warnings; for experts."
        ),
    )
    guard: Optional[GuardConfig] = Field(
        default_factory=GuardConfig, description="Acceptance guard while the job runs; null turns it off."
    )
    trial: Optional[TrialConfig] = Field(
        default_factory=TrialConfig,
        description=(
            "Speculation against off on the job's own traffic: predicted from a calibration and the probe, else "
            "timed on its first units; null or off keeps the configured setting."
        ),
    )

    @field_validator("trial", mode="before")
    @classmethod
    def _trial_off(cls, value):
        return None if value is False else value  # YAML's `off`

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
                "speculative.drafter is required when speculative.enabled is true: set it to the EAGLE-3 drafter's "
                "folder (a local folder with config.json, or an s3:// URI), or set speculative.enabled: false"
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
                    f"{where}: starts at {lo}; make it start at {expected_lo} (ranges start at 1, in order, no gap or "
                    "overlap)"
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
        None,
        ge=16,
        description="Tokens one engine step takes at most (vLLM's max_num_batched_tokens); null: vLLM's default.",
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
    cpu_kv_cache_gib: float = Field(
        1.0,
        gt=0,
        description=(
            "KV cache on vLLM's CPU build, GiB (vLLM's kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE, when set in the "
            "environment, wins). vLLM fills it at every engine start: 1 GiB costs a few seconds there."
        ),
    )
    json_whitespace: bool = Field(
        True,
        description=(
            "JSON outputs (response_format json_schema, json_object) may hold any whitespace between tokens, vLLM's "
            "default; false: compact JSON only, which keeps a model that likes whitespace from filling max_tokens with "
            "it."
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


def validate_check_names(names: Iterable[str]) -> list[str]:
    """Drafter check names (schemas.drafter.CHECKS), or a ValueError naming the unknown ones and the valid checks."""
    names = list(names)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        hints = [f"{n!r} (did you mean {closest(n, CHECKS)!r}?)" if closest(n, CHECKS) else repr(n) for n in unknown]
        raise ValueError(f"unknown drafter check(s) {', '.join(hints)}; valid checks: {', '.join(CHECKS)}")
    return names
