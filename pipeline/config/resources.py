"""The sections of a job config for the engine pool, retries and the output's lease."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import Section


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
        1,
        description="Engine actors, one vLLM engine each: a number, or {min, max} for a pool that grows as nodes join.",
    )
    gpus_per_replica: float = Field(
        0, ge=0, description="0 on the CPU build; tensor_parallel_size x pipeline_parallel_size on GPUs."
    )
    cpus_per_replica: float = Field(
        1, gt=0, description="CPUs each engine actor reserves; on the CPU build one per engine worker at least."
    )
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
    group_prefixes: Literal["auto"] | bool = Field(
        "auto",
        description=(
            "Rows whose prompts share a prefix run together on one engine, so the prefix is computed once per engine: "
            "the input is copied once, sorted by prompt prefix, under OUTPUT_URI/_grouped/, and the units are planned "
            "over the copy. auto: when sorting shares at least 5% more of the prompt text than the input's own order."
        ),
    )
    units_in_flight: int = Field(
        2, ge=1, description="Units overlapping inside one engine: it stays full across a unit's tail."
    )
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
    def cpu_build(self) -> bool:
        """The engines run on vLLM's CPU build: replicas without GPUs (the embedded default, CI).
        Any GPU means vLLM's CUDA build. Decided here, once; everything else asks."""
        return not self.gpus_per_replica

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
            "The attempt stops, named, when no unit commits for this long while no engine is generating: with "
            "SchedulingStalled when engines or tasks wait for resources the cluster does not have, with JobStalled "
            "otherwise (a read that never returns, an engine actor Ray does not report, a stuck driver)."
        ),
    )
    engine_stall_seconds: float = Field(
        300.0,
        gt=0,
        description=(
            "An engine with requests in it that yields no output (vLLM reports every engine step) for this long, or "
            "for 20 times its slowest step so far if that is longer, is hung: its processes are killed, with their "
            "stacks recorded, and it is replaced as after a death. 300 s is above any single step of a large model "
            "(a prefill is chunked by max_num_batched_tokens) and below NCCL's own 10-minute timeout."
        ),
    )
    max_engine_failures: int = Field(
        8,
        ge=1,
        description=(
            "Engine deaths and hangs in a row, with no unit committed between them, that fail the attempt with "
            "EnginesKeepFailing (a rerun resumes); each one before that is survived by replacing the engine."
        ),
    )
    isolate_after_attempts: int = Field(
        2,
        ge=1,
        description=(
            "A unit in flight at this many engine deaths runs its suspects alone in the engine; one that kills it "
            "alone goes to errors/."
        ),
    )
    max_error_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Above this share of error rows a finished job is completed_with_errors, not succeeded.",
    )
    breaker_window_units: int = Field(
        8,
        ge=1,
        description="The job stops when the error share of this many units in a row is above max_error_fraction.",
    )
    breaker_consecutive_units: int = Field(
        3, ge=1, description="The job stops when this many units in a row have retryable (infrastructure) errors."
    )


class LeaseConfig(Section):
    heartbeat_seconds: float = Field(30.0, gt=0, description="How often a run renews its lease on the output location.")
    stale_after_seconds: float = Field(
        180.0,
        gt=0,
        description="A lease not renewed for this long belongs to a dead run, and the next run takes it over.",
    )
    wait_seconds: float = Field(
        300.0,
        ge=0,
        description=(
            "How long a run waits for a silent lease of a run on another host to go stale before it gives up (0: "
            "refuse at once). A lease whose owner ran on this host and whose process is gone is taken at once; one "
            "whose heartbeat is renewed while the run waits is refused."
        ),
    )

    @model_validator(mode="after")
    def _stale_after_beats(self):
        if self.stale_after_seconds < 2 * self.heartbeat_seconds:
            raise ValueError(
                f"lease.stale_after_seconds ({self.stale_after_seconds:g}) must be at least twice "
                f"lease.heartbeat_seconds ({self.heartbeat_seconds:g}): raise it to {2 * self.heartbeat_seconds:g} or "
                "more, or lower the heartbeat"
            )
        return self
