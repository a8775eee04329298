"""Row validation and tokenization: a CPU stage in front of the engine actors, so that the
engine never waits on chat templates or tokenizers.

Every input row comes out exactly once: either ready for the engine (`prompt_token_ids` and
resolved sampling parameters) or marked with an error (`error_kind`, `error_field`,
`error_message`), which the engine actor writes to errors/ in the same commit as its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from pipeline.config import SamplingConfig

PREPARED_SCHEMA_FIELDS = [
    pa.field("id", pa.string()),
    pa.field("source", pa.string()),
    pa.field("row", pa.int64()),
    pa.field("unit_id", pa.string()),
    pa.field("unit_rows", pa.int64()),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("max_tokens", pa.int64()),
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("seed", pa.int64()),
    pa.field("max_tokens_clipped", pa.bool_()),
    pa.field("error_kind", pa.string()),
    pa.field("error_field", pa.string()),
    pa.field("error_message", pa.string()),
]


@dataclass
class RowError(Exception):
    kind: str
    field: Optional[str]
    message: str


def resolve_sampling(row: dict[str, Any], defaults: SamplingConfig) -> dict[str, Any]:
    """The row's sampling parameters: its overrides on top of the job's defaults, checked."""
    resolved = {
        "max_tokens": defaults.max_tokens,
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "seed": defaults.seed,
    }
    for name in resolved:
        value = row.get(name)
        if value is None:
            continue
        if isinstance(value, float) and math.isnan(value):
            raise RowError("invalid_sampling", name, f"{name} is NaN")
        resolved[name] = value
    if resolved["max_tokens"] < 1:
        raise RowError("invalid_sampling", "max_tokens", f"max_tokens must be >= 1, got {resolved['max_tokens']}")
    if resolved["temperature"] < 0:
        raise RowError("invalid_sampling", "temperature", f"temperature must be >= 0, got {resolved['temperature']}")
    if not 0 < resolved["top_p"] <= 1:
        raise RowError("invalid_sampling", "top_p", f"top_p must be in (0, 1], got {resolved['top_p']}")
    if resolved["seed"] is not None and resolved["seed"] < 0:
        raise RowError("invalid_sampling", "seed", f"seed must be >= 0, got {resolved['seed']}")
    return resolved


class Preprocessor:
    """Ray Data stage: validates each row of a work unit, renders chat messages and tokenizes.
    A block is one whole unit (pipeline/units.py), and comes out as one block."""

    def __init__(self, tokenizer_path: str, max_model_len: int, sampling: dict[str, Any], storage=None):
        from transformers import AutoTokenizer

        from pipeline.model_cache import localize  # a tokenizer in object storage: this node's cached copy
        self.tokenizer = AutoTokenizer.from_pretrained(localize(tokenizer_path, storage, weights=False))
        self.max_model_len = max_model_len
        self.sampling = SamplingConfig.model_validate(sampling)

    def render(self, row: dict[str, Any], text_column: str) -> list[int]:
        if text_column == "messages":
            messages = row["messages"]
            if not messages:
                raise RowError("malformed_messages", "messages", "messages is null or empty")
            for i, message in enumerate(messages):
                if not message or not message.get("role") or message.get("content") is None:
                    raise RowError("malformed_messages", "messages", f"message {i} lacks a role or content")
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # the template itself rejects the conversation
                raise RowError("malformed_messages", "messages", f"chat template failed: {exc}") from None
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = row.get("prompt")
        if prompt is None or not prompt.strip():
            raise RowError("empty_prompt", "prompt", "prompt is null or empty")
        return self.tokenizer.encode(prompt)

    def prepare(self, row: dict[str, Any], text_column: str) -> dict[str, Any]:
        sampling = resolve_sampling(row, self.sampling)
        token_ids = self.render(row, text_column)
        # The engine needs room for at least one generated token.
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise RowError(
                "prompt_too_long",
                text_column,
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}",
            )
        clipped = sampling["max_tokens"] > room
        if clipped and not self.sampling.clip_max_tokens:
            raise RowError(
                "max_tokens_too_long",
                "max_tokens",
                f"max_tokens {sampling['max_tokens']} does not fit beside the prompt's {len(token_ids)} tokens in "
                f"max_model_len {self.max_model_len} (sampling.clip_max_tokens is false)",
            )
        sampling["max_tokens"] = min(sampling["max_tokens"], room)
        return {"prompt_token_ids": token_ids, **sampling, "max_tokens_clipped": clipped}

    def __call__(self, batch: pa.Table) -> pa.Table:
        columns = {f.name: [] for f in PREPARED_SCHEMA_FIELDS}
        first_row_of: dict[str, int] = {}  # ids are checked unique within a unit
        for row in batch.drop_columns(["metadata"]).to_pylist():
            out = {name: row[name] for name in ("id", "source", "row", "unit_id", "unit_rows")}
            try:
                if row["id"] is None or not row["id"].strip():
                    raise RowError("invalid_id", "id", f"id is blank at row {row['row']}")
                if row["id"] in first_row_of:
                    raise RowError("duplicate_id", "id", f"id {row['id']!r} is also at row {first_row_of[row['id']]}")
                first_row_of[row["id"]] = row["row"]
                out.update(self.prepare(row, row["text_column"]))
            except RowError as err:
                out.update(id=out["id"] or "", error_kind=err.kind, error_field=err.field, error_message=err.message)
            for name in columns:
                columns[name].append(out.get(name))
        prepared = pa.table(columns, schema=pa.schema(PREPARED_SCHEMA_FIELDS))
        return prepared.append_column("metadata", batch.column("metadata"))
