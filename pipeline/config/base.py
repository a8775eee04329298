"""What every config section shares: unknown keys are errors, and a mistyped one gets a did-you-mean."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfigError(ValueError):
    pass


def closest(word: str, choices: Iterable[str], cutoff: float = 0.6) -> Optional[str]:
    """The choice a mistyped `word` most likely meant (case aside), or None: the one
    did-you-mean of config keys, row overrides, LoRA names and drafter check names."""
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(str(choice).lower(), str(choice))
    match = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[match[0]] if match else None
