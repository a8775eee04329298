"""What the job's prompts share, and the order that makes shared prefixes meet.

vLLM reuses a prefix's KV cache only while its blocks are cached. Rows that share a long prefix
but lie far apart in the input (a passage with several questions, a judge prompt over several
responses) each compute it again once the cache holds a fraction of the job. Sorted by prefix,
they reach one engine together and the prefix is computed once.

The key of a row is the text that reaches the tokenizer, behind its LoRA adapter (vLLM shares a
prefix only within an adapter): the prompt, or the messages' roles and contents in order (a chat
template renders them in order, so a shared run of messages is a shared rendered prefix). Each
row keeps a 32-bit hash of its key's first 64, 128, ... 8,192 bytes; sorting rows by these
hashes, level after level, puts rows that share a prefix next to each other, longest shares
closest. Read once per job, from the prompt columns only, several files at a time; at 10M prompts
the driver holds 36 bytes a row (360 MB) while it sorts.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.inputs.shape import RowShape
from pipeline.storage import Storage
from schemas import InputFile, PrefixSharing

LEVELS = np.array([64, 128, 256, 512, 1024, 2048, 4096, 8192])
KINDS = ("prompt", "messages")
PARALLEL_FILES = 8
BATCH_ROWS = 8192
GROUP_CHARS = 256  # a share worth grouping: 64 tokens or so, four GPU KV blocks
PAYS = 0.05  # auto groups when sorting shares this much more of the prompt text than the input order
FILE_ROWS = 65536  # rows of one file of the grouped copy, rounded down to whole units


@dataclasses.dataclass
class PrefixKeys:
    """Per row, in input order (files in order, rows in order): its text kind, its key's length
    in bytes and its prefix hashes (rows x LEVELS)."""

    kinds: np.ndarray
    lengths: np.ndarray
    hashes: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def read_keys(storage: Storage, files: list[InputFile], shape: RowShape | None = None) -> PrefixKeys:
    """`shape`: the config's `rows` section; a template is rendered, so the key is the prompt the engine gets."""
    shape = shape or RowShape()
    with ThreadPoolExecutor(PARALLEL_FILES) as pool:
        parts = list(pool.map(lambda f: _file_keys(storage, f, shape), files))
    if not parts:
        return PrefixKeys(np.zeros(0, np.uint8), np.zeros(0, np.uint32), np.zeros((0, len(LEVELS)), np.uint32))
    return PrefixKeys(*(np.concatenate(arrays) for arrays in zip(*parts)))


def _file_keys(storage: Storage, file: InputFile, shape: RowShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A file's keys, a batch of rows at a time: memory holds one batch's text, not the file's."""

    def read() -> list[tuple[np.ndarray, np.ndarray]]:
        with storage.open_ranged(file.uri, size=file.size) as f:
            parquet = pq.ParquetFile(f, pre_buffer=False)
            columns = shape.source_columns(parquet.schema_arrow.names, [file.text_column, "lora"])
            return [
                _batch_keys(shape.apply(pa.Table.from_batches([batch])), file.text_column)
                for batch in parquet.iter_batches(BATCH_ROWS, columns=columns, use_threads=False)
            ]

    parts = storage.retrying(f"read {file.uri}", read)
    lengths = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint32)
    hashes = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, len(LEVELS)), np.uint32)
    return np.full(len(lengths), KINDS.index(file.text_column), np.uint8), lengths, hashes


def _batch_keys(table: pa.Table, text_column: str) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd  # Ray Data's own dependency; its hash is seeded alike in every process

    text = _key_text(table, text_column)
    lengths = pc.binary_length(text).to_numpy(zero_copy_only=False).astype(np.uint32)
    hashes = np.zeros((len(text), len(LEVELS)), np.uint32)
    for level, size in enumerate(LEVELS):
        values = pc.binary_slice(text, 0, int(size)).to_numpy(zero_copy_only=False)
        hashes[:, level] = pd.util.hash_array(values, categorize=False).astype(np.uint32)
        if lengths.size == 0 or size >= lengths.max():
            hashes[:, level + 1 :] = hashes[:, level : level + 1]  # longer prefixes are the whole key
            break
    return lengths, hashes


def _key_text(table: pa.Table, text_column: str) -> pa.Array:
    if text_column == "messages":
        texts = [
            "".join(f"{m.get('role')}\x1f{m.get('content')}\x1e" for m in messages if m) if messages else ""
            for messages in table.column("messages").to_pylist()
        ]
        text = pa.array(texts, pa.large_binary())
    else:
        text = pc.fill_null(table.column("prompt").combine_chunks().cast(pa.large_string()), "").cast(pa.large_binary())
    if "lora" in table.column_names:
        lora = pc.fill_null(table.column("lora").combine_chunks().cast(pa.large_string()), "").cast(pa.large_binary())
        text = pc.binary_join_element_wise(lora, text, pa.scalar(b"\x1d", pa.large_binary()))
    return text


def group_order(keys: PrefixKeys) -> np.ndarray:
    """The rows' order with shared prefixes next to each other: by kind, then prefix hash level
    by level, then input position (a stable, deterministic order)."""
    columns = [np.arange(len(keys))] + [keys.hashes[:, level] for level in reversed(range(len(LEVELS)))] + [keys.kinds]
    return np.lexsort(columns)


def _shared_with_recent(keys: PrefixKeys, order: np.ndarray, window: int) -> np.ndarray:
    """Bytes each row (at its place in `order`) shares with one of the `window` rows before it,
    at the levels' granularity: what an engine running that many rows at once can find cached."""
    shared = np.zeros(len(order), np.int64)
    lengths = keys.lengths[order].astype(np.int64)
    kinds = keys.kinds[order].astype(np.uint64) << np.uint64(32)
    for level, size in enumerate(LEVELS):
        key = keys.hashes[order, level].astype(np.uint64) | kinds
        by_key = np.argsort(key, kind="stable")  # places of equal keys together, in order
        near = np.zeros(len(order), bool)
        near[by_key[1:]] = (key[by_key[1:]] == key[by_key[:-1]]) & (by_key[1:] - by_key[:-1] <= window)
        shared[near] = np.minimum(size, lengths[near])
    return shared


def measure_sharing(keys: PrefixKeys, order: np.ndarray, window: int) -> PrefixSharing:
    """`window`: rows an engine runs at once (engine.max_num_seqs)."""
    grouped = _shared_with_recent(keys, order, window)
    as_input = _shared_with_recent(keys, np.arange(len(keys)), window)
    common = int(grouped[1:].min()) if len(grouped) > 1 else 0
    beyond = grouped - common >= GROUP_CHARS
    starts = beyond & ~np.concatenate([[False], beyond[:-1]])  # a run of sharing rows begins
    return PrefixSharing(
        rows=len(keys),
        prompt_chars=int(keys.lengths.sum()),
        shared_chars_in_input_order=int(as_input.sum()),
        shared_chars_grouped=int(grouped.sum()),
        job_common_chars=common,
        prefix_groups=int(starts.sum()),
        rows_in_groups=int(beyond.sum() + starts.sum()),
    )


def grouping_pays(sharing: PrefixSharing) -> tuple[bool, str]:
    gain = sharing.shared_chars_grouped - sharing.shared_chars_in_input_order
    share = gain / sharing.prompt_chars if sharing.prompt_chars else 0.0
    if share >= PAYS:
        return True, f"sorted by prefix, rows share {share:.0%} more of the prompt text than in the input's order"
    return (
        False,
        f"sorted by prefix, rows would share only {share:.0%} more of the prompt text than in the input's order "
        f"(below {PAYS:.0%})",
    )


def rows_per_grouped_file(rows_per_unit: int) -> int:
    return max(rows_per_unit, FILE_ROWS // rows_per_unit * rows_per_unit)


def grouped_unit_count(kinds: np.ndarray, rows_per_unit: int) -> int:
    """Units over the grouped copy: each kind's rows in files of whole units, the last one shorter."""
    per_file = rows_per_grouped_file(rows_per_unit)
    units = 0
    for rows in np.bincount(kinds, minlength=len(KINDS)):
        full, rest = divmod(int(rows), per_file)
        units += full * (per_file // rows_per_unit) + -(-rest // rows_per_unit)
    return units
