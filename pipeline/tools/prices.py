"""Prices for cost figures: dollars per hour per accelerator kind (per GPU) or, for CPU-only
replicas, per node kind. Defaults in `pipeline/tools/prices.yaml`; a user file of the same shape
adds to or replaces them (`--prices FILE`, a local path or any storage URI)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from pipeline.storage import Storage

DEFAULT_PRICES_FILE = Path(__file__).with_name("prices.yaml")


class Prices(BaseModel):
    model_config = ConfigDict(extra="forbid")

    currency: str = "USD"
    gpu: dict[str, float] = Field(default_factory=dict, description="Dollars per hour for one GPU of this kind.")
    cpu: dict[str, float] = Field(default_factory=dict, description="Dollars per hour for one CPU-only replica (node).")
    _from: dict[str, str] = PrivateAttr(default_factory=dict)  # "gpu:<kind>" -> the file that set it

    def billing(self, accelerator: str, gpus_per_replica: float) -> tuple[float, Optional[float]]:
        """(billed units per replica, dollars per unit-hour or None when the kind has no price).
        A GPU replica bills `gpus_per_replica` GPUs; a CPU-only replica bills one node."""
        if gpus_per_replica > 0:
            return gpus_per_replica, self.gpu.get(accelerator)
        return 1.0, self.cpu.get(accelerator)

    def source(self, accelerator: str, gpus_per_replica: float) -> str:
        """Where the price of this kind came from: the --prices file, or specbatch's defaults."""
        section = "gpu" if gpus_per_replica > 0 else "cpu"
        return self._from.get(f"{section}:{accelerator}", "specbatch's default prices (pipeline/tools/prices.yaml)")

    def missing_price_message(self, accelerator: str, gpus_per_replica: float) -> str:
        section = "gpu" if gpus_per_replica > 0 else "cpu"
        known = ", ".join(sorted(getattr(self, section))) or "none"
        return (
            f"no price for accelerator {accelerator!r} under '{section}:' (known: {known}); "
            f"add it to a prices file and pass --prices FILE"
        )


def load_prices(uri: Optional[str] = None, storage: Optional[Storage] = None) -> Prices:
    """The default prices, with the entries of `uri` (if given) added or replaced."""
    defaults = yaml.safe_load(DEFAULT_PRICES_FILE.read_text())
    if uri:
        override = yaml.safe_load((storage or Storage()).read_bytes(uri)) or {}
        Prices.model_validate(override)  # names the bad field of the user's file
        defaults["currency"] = override.get("currency", defaults["currency"])
        for section in ("gpu", "cpu"):
            defaults[section] = {**defaults.get(section, {}), **(override.get(section) or {})}
    prices = Prices.model_validate(defaults)
    if uri:
        prices._from = {
            f"{section}:{kind}": f"--prices {uri}"
            for section in ("gpu", "cpu")
            for kind in (override.get(section) or {})
        }
    return prices
