"""The fence an engine checks before each unit's marker: the output location is still leased
to the engine's run, at the generation the run acquired. pipeline/commit/lease.py writes the
lease; this module reads it, below the commit that checks it."""

from __future__ import annotations

from typing import Optional

from pipeline.storage import Storage
from schemas import Fence, Lease

LEASE = "_lease.json"


class LeaseLost(RuntimeError):
    """Another run took the output location over from this one while it ran."""

    def __init__(self, message: str, owner: Optional[Lease] = None):
        super().__init__(message)
        self.owner = owner


def read_lease(storage: Storage, location_uri: str) -> Optional[Lease]:
    """The location's lease (one GET); None when no run holds it."""
    try:
        return Lease.model_validate(storage.read_json(storage.join(location_uri, LEASE)))
    except FileNotFoundError:
        return None


def holds(lease: Optional[Lease], fence: Fence) -> bool:
    return lease is not None and lease.owner == fence.owner and lease.generation == fence.generation


def check_fence(storage: Storage, location_uri: str, fence: Fence) -> None:
    """LeaseLost unless the location is still leased to the fence's run and generation (one GET):
    a run that lost the location commits nothing more."""
    held = read_lease(storage, location_uri)
    if not holds(held, fence):
        taken = f"run {held.owner} (attempt {held.attempt})" if held else "nobody (the lease was removed)"
        raise LeaseLost(f"{location_uri} is now leased to {taken}: this run lost it and commits nothing more", held)
