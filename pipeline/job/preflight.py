"""Configuration problems refused before any engine starts, with the fix named: they must
never become a dataset of row errors.

One rendering pass: the tokenizer loads; the first row of the first file of each input kind
(`prompt`, `messages`) renders and tokenizes as the job will (chat input needs a chat
template); `max_tokens` leaves room in `max_model_len`; `max_model_len` is within what the
model allows; the response_format compiles and the reasoning parser fits the tokenizer. Models
in object storage: the driver copies their config and tokenizer files only
(pipeline/storage/model_cache.py), never the target's weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError, JobConfig
from pipeline.inputs import InputReport
from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage
from pipeline.storage.model_cache import localize
from schemas import InputFile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_before_engines(config: JobConfig, inputs: InputReport, storage: Storage) -> None:
    _check_lengths(config, storage)
    tokenizer_path = config.model.tokenizer or config.model.path
    try:
        from pipeline.stages.preprocess import load_tokenizer

        tokenizer = load_tokenizer(localize(tokenizer_path, storage, weights=False))
    except Exception as exc:
        field = "model.tokenizer" if config.model.tokenizer else "model.path"
        raise ConfigError(
            f"{field}: the tokenizer at {tokenizer_path} cannot be loaded ({type(exc).__name__}: {exc}); set "
            "model.tokenizer to a folder with the tokenizer's files (tokenizer.json, tokenizer_config.json)"
        ) from None
    _check_structured_and_reasoning(config, tokenizer)
    first_of_kind = {}
    for file in inputs.files:
        first_of_kind.setdefault(file.text_column, file)
    for kind, file in first_of_kind.items():
        if kind == "messages" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"{file.uri} has chat `messages`, and the tokenizer at {tokenizer_path} has no chat template. Use a "
                "tokenizer with one (model.tokenizer), add a chat_template to its tokenizer_config.json, or give "
                "rendered `prompt` text instead."
            )
        _render_first_row(
            tokenizer, tokenizer_path, file, storage, config.chat.template_kwargs, RowShape.for_job(config)
        )


def _check_structured_and_reasoning(config: JobConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """The job's response_format must compile in vLLM's structured-output backends, and its
    reasoning parser must find its markers in the tokenizer."""
    from pipeline.stages.completions import reasoning_parser
    from pipeline.stages.engine import structured_backend
    from pipeline.stages.structured import check_supported

    try:
        check_supported(config.sampling.response_format, tokenizer, structured_backend(config))
    except ValueError as exc:
        raise ConfigError(f"sampling.response_format: vLLM cannot compile it ({exc}); fix or remove it") from None
    try:
        reasoning_parser(config.chat.reasoning_parser, tokenizer)
    except Exception as exc:
        raise ConfigError(
            f"chat.reasoning_parser: {exc.args[0] if isinstance(exc, KeyError) else exc} (the model's tokenizer must "
            "have the parser's reasoning markers; leave chat.reasoning_parser out for a model that does not reason)"
        ) from None


def _check_lengths(config: JobConfig, storage: Storage) -> None:
    limit = config.engine.max_model_len
    if config.sampling.max_tokens >= limit:
        raise ConfigError(
            f"sampling.max_tokens ({config.sampling.max_tokens}) leaves no room for a prompt in engine.max_model_len "
            f"({limit}): lower it, or raise engine.max_model_len"
        )
    config_file = Path(localize(config.model.path, storage, weights=False)) / "config.json"
    if config_file.is_file():
        model = json.loads(config_file.read_text())
        allowed = model.get("max_position_embeddings") or model.get("text_config", {}).get("max_position_embeddings")
        if allowed and limit > allowed:
            raise ConfigError(
                f"engine.max_model_len ({limit}) is above what {config.model.path} allows (max_position_embeddings "
                f"{allowed}): set engine.max_model_len to {allowed} or less"
            )


def first_row_text(storage: Storage, file: InputFile, shape: RowShape) -> Any:
    """The first row's prompt or messages, as the job reads it (a template rendered); None
    when the file has no row, or the template cannot render it."""

    def first_row():
        with storage.open_ranged(file.uri, size=file.size) as f:
            parquet = pq.ParquetFile(f)
            columns = shape.source_columns(parquet.schema_arrow.names, [file.text_column])
            return next(
                parquet.iter_batches(batch_size=1, columns=columns, use_threads=False), None
            )  # as Storage.read_parquet

    batch = storage.retrying(f"read {file.uri}", first_row)
    if batch is None or not batch.num_rows:
        return None
    return shape.apply(pa.Table.from_batches([batch])).column(file.text_column)[0].as_py()


def _render_first_row(
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_path: str,
    file: InputFile,
    storage: Storage,
    template_kwargs: dict,
    shape: RowShape,
) -> None:
    uri, kind = file.uri, file.text_column
    value = first_row_text(storage, file, shape)
    if value in (None, "", []):
        return  # an empty first row is the row's own problem (errors/), not the configuration's
    try:
        if kind == "messages":
            text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True, **template_kwargs)
            tokenizer.encode(text, add_special_tokens=False)
        else:
            tokenizer.encode(value)
    except Exception as exc:
        raise ConfigError(
            f"the first row of {uri} does not render with the tokenizer at {tokenizer_path} "
            f"({type(exc).__name__}: {exc}); every {kind} row would fail the same way. Fix the rows, or the chat "
            "template (chat.template_kwargs, or model.tokenizer for another tokenizer)"
        ) from None
