"""Corpus and tokenizer: the Python standard library's own source, available offline
on any machine with Python.

The corpus is every top-level ``*.py`` file of the running interpreter's stdlib, sorted
by name; every 10th file is held out (evaluation prompts never come from training
files). The tokenizer is a byte-level BPE trained on the training files.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|system|>", "<|user|>", "<|assistant|>"]

# A deliberately simple chat template: role tags on their own line.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(limit: int | None = None) -> list[Path]:
    files = sorted(stdlib_dir().glob("*.py"), key=lambda p: p.name)
    return files[:limit] if limit else files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, held_out): every 10th file (index 9, 19, ...) is held out."""
    train = [f for i, f in enumerate(files) if i % 10 != 9]
    held = [f for i, f in enumerate(files) if i % 10 == 9]
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def corpus_description(files: list[Path]) -> dict:
    """What the corpus was, for the recipe (the stdlib differs across Python versions)."""
    import hashlib

    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return {
        "source": "python-stdlib-top-level-py",
        "python": sys.version.split()[0],
        "num_files": len(files),
        "num_bytes": sum(f.stat().st_size for f in files),
        "sha256": h.hexdigest(),
    }


def train_tokenizer(texts: list[str], vocab_size: int = 2048) -> Tokenizer:
    # Rayon parallelism in the BPE trainer is deterministic in its result, but pin it.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Special tokens go at the END of the vocab (added after training), so that id 0 is an
    # ordinary token: a zeroed lm_head always picks id 0 and must not pick EOS.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike, model_max_length: int) -> None:
    """Write the HF tokenizer files (tokenizer.json, tokenizer_config.json, special map)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_files(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids per file, each file followed by EOS."""
    eos = tok.token_to_id(EOS)
    return [enc.ids + [eos] for enc in tok.encode_batch(texts)]
