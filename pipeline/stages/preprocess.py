"""Row validation and tokenization: a CPU stage in front of the engine actors, so that the
engine never waits on chat templates or tokenizers.

Every input row comes out exactly once: either ready for the engine (`prompt_token_ids` and
its resolved sampling parameters, pipeline/stages/sampling.py) or marked with an error (`error_kind`, `error_field`,
`error_message`), which the engine actor writes to errors/ in the same commit as its batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from pipeline.config import ChatConfig, JobConfig, SamplingConfig, closest, speculation_conflicts
from pipeline.stages.engine import structured_backend
from pipeline.stages.sampling import COLUMNS as SAMPLING_COLUMNS
from pipeline.stages.sampling import RowError, engine_values, resolve

# A block's columns that go to the output rows as they are (stages/unit_results.tables): the
# user's metadata and the columns rows.copy_columns names.
CARRIED = ("metadata", "copied")
PREPARED_SCHEMA_FIELDS = [
    pa.field("id", pa.string()),
    pa.field("source", pa.string()),
    pa.field("row", pa.int64()),
    pa.field("unit_id", pa.string()),
    pa.field("unit_rows", pa.int64()),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("sampling", pa.string()),  # the resolved parameters, JSON (pipeline/stages/sampling.py)
    pa.field("max_tokens_clipped", pa.bool_()),
    pa.field("lora", pa.string()),
    pa.field("error_kind", pa.string()),
    pa.field("error_field", pa.string()),
    pa.field("error_message", pa.string()),
]


# The class transformers' AutoTokenizer gives a folder whose tokenizer_config.json names one of
# these (Llama 3's, the kit's): a tokenizer.json run by the tokenizers library.
PLAIN_FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(folder: str):
    """The tokenizer of a local model folder, as vLLM's engine loads it. AutoTokenizer imports
    torch and the model classes on the way (seconds of CPU in the driver and each preprocess
    actor while engines start: docs/measurements.md); a folder that names a plain fast tokenizer is loaded
    by that class alone, the same object without those imports."""
    config_file = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") in PLAIN_FAST_TOKENIZERS and "auto_map" not in config:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    # transformers warns once of a prompt over the tokenizer's model_max_length; prompts are
    # measured against the engine's max_model_len here, and a long one is its row's error
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def check_supported_line(row: dict[str, Any], metadata: Any) -> None:
    """An OpenAI batch line that specbatch cannot run (unsupported_requests: errors; its row has
    neither prompt nor messages) is its row's `unsupported_request`, naming the field as the
    refusal would have."""
    if row["prompt"] is not None or row["messages"] is not None:
        return
    from pipeline.inputs.openai_requests import UNSUPPORTED, unsupported_problem

    problem = unsupported_problem(metadata.as_py() if isinstance(metadata, pa.Scalar) else metadata)
    if problem is not None:
        raise RowError(UNSUPPORTED, problem.get("field"), problem.get("message") or "not supported by specbatch")


def check_model(metadata: Any, served_names: tuple[str, ...]) -> None:
    """An OpenAI batch line naming a model the job does not serve is its row's error, as vLLM's
    run-batch answers it (`model_not_found`): generating it with the job's target would answer
    under a name that did not write the text."""
    text = metadata.as_py() if isinstance(metadata, pa.Scalar) else metadata
    model = json.loads(text).get("model") if isinstance(text, str) and '"model"' in text else None
    if model is not None and model not in served_names:
        raise RowError(
            "model_not_found",
            "body.model",
            f"The model `{model}` does not exist: this job serves {served_names[1]!r} ({served_names[0]}); name it in "
            "model.served_names to serve the line with it",
        )


def check_id(row: dict[str, Any]) -> None:
    """A null, empty or blank id is the row's error: the row still lands once, in errors/, by
    its file and row number."""
    if row["id"] is None:
        raise RowError("invalid_id", "id", f"id is null at row {row['row']} of {row['source']}")
    if not row["id"].strip():
        raise RowError("invalid_id", "id", f"id {row['id']!r} is blank at row {row['row']} of {row['source']}")


@dataclass(frozen=True)
class PreprocessSettings:
    """What a row is prepared with. `speculation`: None (off), "gpu" or "cpu" (vLLM's CPU
    build), and `structured_backend`, the engine's: what a row's parameters must run with;
    `lora_adapters`: the names a row's `lora` may give."""

    tokenizer_path: str
    max_model_len: int
    sampling: dict[str, Any] = field(default_factory=dict)
    chat: dict[str, Any] = field(default_factory=dict)
    speculation: str | None = None
    structured_backend: str = "auto"
    lora_adapters: tuple[str, ...] = ()
    served_names: tuple[str, ...] | None = None  # OpenAI batch input: what a line's body.model may name
    duplicates: tuple[
        tuple[str, int, str, int], ...
    ] = ()  # (source, row, first source, first row): the plan's id check

    @classmethod
    def for_job(cls, config: JobConfig, duplicates: Sequence[Any] = ()) -> "PreprocessSettings":
        """The job's, in one place: the preprocess actors, the probe, the dry run and calibrate
        prepare a row alike (its adapter included)."""
        return cls(
            tokenizer_path=config.model.tokenizer or config.model.path,
            max_model_len=config.engine.max_model_len,
            sampling=config.sampling.model_dump(),
            chat=config.chat.model_dump(),
            speculation=config.speculation,
            structured_backend=structured_backend(config),
            lora_adapters=tuple(sorted(config.lora.adapters)) if config.lora else (),
            served_names=config.model.names if config.input_format == "openai_batch" else None,
            duplicates=tuple((d.source, d.row, d.first_source, d.first_row) for d in duplicates),
        )


class Preprocessor:
    """Ray Data stage: validates each row of a work unit, renders chat messages and tokenizes.
    A block is one whole unit (pipeline/inputs/units.py), and comes out as one block."""

    @classmethod
    def for_job(cls, config: JobConfig, storage=None) -> "Preprocessor":
        return cls(PreprocessSettings.for_job(config), storage)

    def __init__(self, settings: PreprocessSettings, storage=None):
        """`storage` reaches a tokenizer in object storage."""
        from pipeline.storage.model_cache import localize  # a tokenizer in object storage: this node's cached copy

        self.tokenizer = load_tokenizer(localize(settings.tokenizer_path, storage, weights=False))
        self.max_model_len = settings.max_model_len
        self.sampling = SamplingConfig.model_validate(settings.sampling)
        self.sampling_values = self.sampling.model_dump()
        self.chat = ChatConfig.model_validate(settings.chat)
        self.formats_checked: dict[str, str | None] = {}  # response_format JSON -> why vLLM refuses it
        self.speculation, self.structured_backend = settings.speculation, settings.structured_backend
        self.lora_adapters = set(settings.lora_adapters)
        self.served_names = settings.served_names
        self.earlier_row = {(source, row): (first, first_row) for source, row, first, first_row in settings.duplicates}

    def render(self, row: dict[str, Any], text_column: str) -> list[int]:
        if text_column == "messages":
            messages = row["messages"]
            if not messages:
                raise RowError("malformed_messages", "messages", "messages is null or empty")
            for i, message in enumerate(messages):
                if not message or not message.get("role") or message.get("content") is None:
                    raise RowError("malformed_messages", "messages", f"message {i} lacks a role or content")
            if self.chat.system_prompt is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.chat.system_prompt}, *messages]
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **self.chat.template_kwargs
                )
            except Exception as exc:  # the template itself rejects the conversation
                raise RowError("malformed_messages", "messages", f"chat template failed: {exc}") from None
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = row.get("prompt")
        if prompt is None or not prompt.strip():
            raise RowError("empty_prompt", "prompt", "prompt is null or empty")
        return self.tokenizer.encode(prompt)

    def check_format(self, sampling: SamplingConfig) -> None:
        """A row's own response_format must compile in vLLM (the job's was checked before the job)."""
        if sampling.response_format is None or sampling is self.sampling:
            return
        key = sampling.response_format.model_dump_json()
        if key not in self.formats_checked:
            from pipeline.stages.structured import check_supported

            try:
                check_supported(sampling.response_format, self.tokenizer, self.structured_backend)
                self.formats_checked[key] = None
            except ValueError as exc:
                self.formats_checked[key] = str(exc)
        if self.formats_checked[key] is not None:
            raise RowError(
                "invalid_response_format", "response_format", f"vLLM cannot compile it: {self.formats_checked[key]}"
            )

    def prepare(self, row: dict[str, Any], text_column: str) -> dict[str, Any]:
        if row.get(
            "template_error"
        ):  # rows.prompt_template or messages_template could not render it (pipeline/inputs/shape.py)
            raise RowError("template_error", row["template_field"], row["template_error"])
        lora = row.get("lora")
        if lora is not None and lora not in self.lora_adapters:
            close = closest(lora, self.lora_adapters)
            known = (
                f"did you mean {close!r}?"
                if close
                else f"the job's lora.adapters: {sorted(self.lora_adapters) or 'none'}"
            )
            raise RowError("invalid_lora", "lora", f"no LoRA adapter {lora!r} ({known})")
        sampling = resolve(row, self.sampling, self.sampling_values)
        if self.speculation and sampling is not self.sampling:
            for name, why in speculation_conflicts(sampling, cpu_engine=self.speculation == "cpu")[:1]:
                field = name if name in SAMPLING_COLUMNS else f"sampling.{name}"
                raise RowError("invalid_sampling", field, f"{name} with speculative decoding: {why}")
        self.check_format(sampling)
        token_ids = self.render(row, text_column)
        # The engine needs room for at least one generated token.
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise RowError(
                "prompt_too_long",
                text_column,
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}",
            )
        values = engine_values(sampling)
        clipped = values["max_tokens"] > room
        if clipped and not self.sampling.clip_max_tokens:
            raise RowError(
                "max_tokens_too_long",
                "max_tokens",
                f"max_tokens {values['max_tokens']} does not fit beside the prompt's {len(token_ids)} tokens in "
                f"max_model_len {self.max_model_len} (sampling.clip_max_tokens is false)",
            )
        values["max_tokens"] = min(values["max_tokens"], room)
        values["min_tokens"] = min(values["min_tokens"], values["max_tokens"])
        return {
            "prompt_token_ids": token_ids,
            "sampling": json.dumps(values),
            "max_tokens_clipped": clipped,
            "lora": lora,
        }

    def check_unique(self, row: dict[str, Any]) -> None:
        """A row whose id an earlier row of the job has (the plan's id check, pipeline/inputs/ids.py)."""
        earlier = self.earlier_row.get((row["source"], row["row"]))
        if earlier is None:
            return
        source, first = earlier
        where = (
            f"in {source} (rows {first} and {row['row']})"
            if source == row["source"]
            else f"in {source} (row {first}) and {row['source']} (row {row['row']})"
        )
        raise RowError(
            "duplicate_id",
            "id",
            f"id {row['id']!r} appears twice {where}; row {first} of {source} is generated, this one is not: "
            "give it an id of its own",
        )

    def __call__(self, batch: pa.Table) -> pa.Table:
        columns = {f.name: [] for f in PREPARED_SCHEMA_FIELDS}
        metadata = batch.column("metadata")
        carried = batch.select([c for c in CARRIED if c in batch.column_names])
        for i, row in enumerate(batch.drop_columns(carried.column_names).to_pylist()):
            out = {name: row[name] for name in ("id", "source", "row", "unit_id", "unit_rows")}
            try:
                check_id(row)
                check_supported_line(row, metadata[i])  # converted only for a row with no prompt
                if self.served_names is not None:
                    check_model(metadata[i], self.served_names)
                self.check_unique(row)
                out.update(self.prepare(row, row["text_column"]))
            except RowError as err:
                out.update(id=out["id"] or "", error_kind=err.kind, error_field=err.field, error_message=err.message)
            for name in columns:
                columns[name].append(out.get(name))
        prepared = pa.table(columns, schema=pa.schema(PREPARED_SCHEMA_FIELDS))
        for name in carried.column_names:
            prepared = prepared.append_column(name, carried.column(name))
        return prepared
