"""The sections of a job config for what each row is generated with: sampling, response formats, chat, LoRA."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, model_validator

from pipeline.config.base import Section

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
        description=(
            "The kind of constraint; text: none. Each of json_schema, regex, choice, grammar needs its own field."
        )
    )
    json_schema: Optional[JsonSchemaFormat] = Field(
        None, description="With type json_schema: the schema, OpenAI's shape."
    )
    regex: Optional[str] = Field(None, description="With type regex: the regular expression every output matches.")
    choice: Optional[list[str]] = Field(None, description="With type choice: every output is one of these strings.")
    grammar: Optional[str] = Field(None, description="With type grammar: the EBNF grammar every output follows.")

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        needed = self.type if self.type in ("json_schema", "regex", "choice", "grammar") else None
        if needed and given != [needed]:
            raise ValueError(
                f"response_format of type {self.type!r} needs the field {needed!r} and no other constraint"
            )
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
    n: int = Field(
        1,
        ge=1,
        le=MAX_SAMPLES,
        description="Samples per prompt: one output row per (id, sample_index); n > 1 needs temperature > 0.",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        description="0: greedy. Above 0 with speculation is refused on vLLM's CPU build (gpus_per_replica: 0).",
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Sample from the smallest set of tokens whose probabilities add up to top_p."
    )
    top_k: int = Field(0, ge=-1, description="0 or -1: all tokens.")
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Drop tokens below min_p x the top token's probability; refused with speculation (vLLM refuses it)."
        ),
    )
    seed: Optional[int] = Field(
        None,
        ge=0,
        description="With n > 1, sample i uses seed + i (vLLM): a row with a seed gives the same samples on a rerun.",
    )
    repetition_penalty: float = Field(
        1.0, gt=0, description="Above 1 discourages tokens already in the prompt or the output."
    )
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="Taken off the logit of every token already generated."
    )
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
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=(
            "Top-k logprobs of each generated token (0: the chosen token's only) in the `logprobs` column; at most "
            f"{MAX_LOGPROBS}; null: off."
        ),
    )
    prompt_logprobs: Optional[int] = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Top-k logprobs of each prompt token in the `prompt_logprobs` column; null: off.",
    )
    response_format: Optional[ResponseFormat] = Field(
        None, description="Structured output; each output row says whether it parsed (`parsed`, `parse_error`)."
    )
    clip_max_tokens: bool = Field(
        True,
        description=(
            "A row whose max_tokens does not fit beside its prompt in engine.max_model_len: true generates what fits "
            "and marks the row (max_tokens_clipped, and clipped_rows in its unit's stats); false makes it a final "
            "error."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) is above max_tokens ({self.max_tokens}); lower min_tokens or raise "
                "max_tokens"
            )
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"n is {self.n} at temperature 0; vLLM samples n > 1 only at a temperature above 0: raise temperature, "
                "or set n: 1"
            )
        return self


# Job-level only: a row cannot change them.
JOB_ONLY_SAMPLING = ("clip_max_tokens",)


class ChatConfig(Section):
    """How `messages` rows become prompts."""

    system_prompt: Optional[str] = Field(
        None, description="Put first in every conversation that has no system message."
    )
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
        conflicts.append(
            (
                "temperature",
                "vLLM's CPU build samples wrongly with speculative decoding at temperature > 0 (outputs off the "
                "distribution, seeds not repeatable): use temperature 0, or speculative.enabled: false",
            )
        )
    return conflicts
