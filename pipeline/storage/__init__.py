"""Object storage behind one abstraction, fsspec, for every URI a job reads or writes:
`Storage` (pipeline/storage/store.py), its retries and outage bound (retry.py), the per-node
model cache (model_cache.py)."""

from pipeline.storage.retry import TRANSIENT_ERRORS, StorageUnavailable, is_transient
from pipeline.storage.store import PreconditionFailed, Storage, is_local, json_bytes

__all__ = [
    "TRANSIENT_ERRORS",
    "PreconditionFailed",
    "Storage",
    "StorageUnavailable",
    "is_local",
    "is_transient",
    "json_bytes",
]
