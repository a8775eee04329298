"""The job config: its sections and the rules that tie them together."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section
from pipeline.config.input_rows import InputRowsConfig
from pipeline.config.paths import output_inside_input
from pipeline.config.resources import LeaseConfig, ResourcesConfig, RetriesConfig
from pipeline.config.rows import ChatConfig, LoraConfig, SamplingConfig, speculation_conflicts
from pipeline.config.sections import EngineConfig, ModelConfig, SpeculativeConfig, StorageConfig


class JobConfig(Section):
    job_name: str = Field(
        "specbatch", pattern=r"^[A-Za-z0-9_.-]+$", description="Prefix of generated job ids: letters, digits, _ . -."
    )
    input_uri: str = Field(description="A Parquet file, a folder or a glob; s3:// or any fsspec scheme.")
    input_format: Literal["parquet", "openai_batch"] = Field(
        "parquet",
        description=(
            "openai_batch: input_uri names JSONL files of OpenAI batch requests (a file, a folder of .jsonl files or a "
            "glob), converted once into Parquet prompt rows under output_uri/_inputs/ "
            "(pipeline/inputs/openai_batch.py)."
        ),
    )
    unsupported_requests: Literal["refuse", "errors"] = Field(
        "refuse",
        description=(
            "openai_batch input: refuse refuses the whole job over any request line specbatch cannot run, as OpenAI's "
            "batch validation does; errors makes each such line with a custom_id its row in errors/ "
            "(unsupported_request, naming the field), an error line of the export, and runs the rest. Lines that are "
            "not JSON, lack a custom_id or repeat one are refused either way."
        ),
    )
    output_uri: str = Field(
        description=(
            "Where outputs/, errors/, stats/ and _job.json go: a local folder or a URI (any fsspec scheme). A rerun on "
            "it resumes. Never inside input_uri: a rerun would read the outputs as input."
        )
    )
    rows: InputRowsConfig = Field(
        default_factory=InputRowsConfig,
        description=(
            "How the input's rows become requests: the id, prompt or messages columns by name, prompts or messages "
            "rendered from templates over the row's columns, and columns copied to the output rows."
        ),
    )
    model: ModelConfig = Field(
        description="The target model: model.path, a local folder with config.json or an s3:// URI."
    )
    speculative: SpeculativeConfig = Field(
        default_factory=lambda: SpeculativeConfig(enabled=False),
        description=(
            "Speculative decoding with an EAGLE-3 / EAGLE-3.1 drafter. Left out (or null): no speculation, plain "
            "decoding, since there is no drafter to draft with. Given: on unless `enabled: false`, and then "
            "speculative.drafter is required."
        ),
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="vLLM engine settings; one engine per replica."
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Sampling defaults; rows override them."
    )
    chat: ChatConfig = Field(default_factory=ChatConfig, description="How `messages` rows become prompts.")
    lora: Optional[LoraConfig] = Field(
        None,
        description=(
            "LoRA adapters rows may ask for by name; null: the base model only. On vLLM's CPU build with speculation "
            "only at speculative.num_speculative_tokens: 1 (docs/sampling.md)."
        ),
    )
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig, description="Engines, their resources, and work units."
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig,
        description="How storage is reached; credentials come from the environment, never from here.",
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
                f"output_uri ({self.output_uri}) {inside} the folder input_uri ({self.input_uri}) reads from: the job "
                "would work once, then a rerun would read its own outputs as input. Set output_uri to a folder outside "
                "input_uri (e.g. a sibling folder), or move the input into a folder of its own"
            )
        return self

    @model_validator(mode="after")
    def _rows_of_parquet_files(self):
        if not self.rows.is_default and self.input_format == "openai_batch":
            raise ValueError(
                "rows applies to Parquet input only: an OpenAI batch line names its custom_id and body itself; remove "
                "the rows section, or set input_format: parquet"
            )
        return self

    @model_validator(mode="after")
    def _unsupported_requests_of_batch_files(self):
        if self.unsupported_requests != "refuse" and self.input_format != "openai_batch":
            raise ValueError(
                f"unsupported_requests: {self.unsupported_requests} applies to OpenAI batch files only: set "
                "input_format: openai_batch, or remove unsupported_requests (a bad Parquet row is always its row's "
                "error)"
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
                f"engine.pipeline_parallel_size ({workers}): one GPU per engine worker; set "
                f"resources.gpus_per_replica: {workers}, or change the parallel sizes"
            )
        if gpus and gpus < workers:
            raise ValueError(
                f"resources.gpus_per_replica ({gpus:g}) is smaller than the engine's {workers} workers; set it to "
                f"{workers}"
            )
        return self

    @model_validator(mode="after")
    def _cpu_cores_per_worker(self):
        workers = self.engine_workers
        if workers > 1 and self.resources.cpu_build and self.resources.cpus_per_replica < workers:
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
        conflicts = speculation_conflicts(self.sampling, cpu_engine=self.resources.cpu_build)
        if conflicts:
            name, why = conflicts[0]
            fix = (
                ""
                if "speculative.enabled: false" in why
                else f"; leave sampling.{name} out, or set speculative.enabled: false"
            )
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
        return "cpu" if self.resources.cpu_build else "gpu"

    @property
    def engine_workers(self) -> int:
        """Processes of one engine that each hold a device: tensor x pipeline parallel."""
        return self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size

    def without_speculation(self) -> JobConfig:
        """The same job with the target alone (the guard or the speculation trial turned it off)."""
        return self.model_copy(update={"speculative": self.speculative.model_copy(update={"enabled": False})})

    def redacted(self) -> dict[str, Any]:
        """The config as recorded in manifests: no credentials can be in it (validated above),
        and query strings of URIs, where signed tokens hide, are dropped."""
        data = self.model_dump(mode="json")
        for key in ("input_uri", "output_uri"):
            data[key] = data[key].split("?", 1)[0]
        return data
