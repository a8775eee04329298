"""Models from object storage: each node copies a model folder once into a local cache.

vLLM, transformers and safetensors read model folders from local disk only, and specbatch never
downloads from a model hub. So `model.path`, `model.tokenizer` and `speculative.drafter` may be
an s3:// (or any fsspec) folder of the user's own storage, and every process that needs the
files calls `localize(uri, storage)` on its own node, which returns a local folder:

- Entry: `<cache>/<name>-<sha256(endpoint, uri)[:16]>/`, the objects under the URI, and a
  manifest (MANIFEST) recording each object's size and ETag. The cache is `storage.model_cache_dir`,
  else $SPECBATCH_MODEL_CACHE, else ~/.cache/specbatch/models.
- Reuse: one listing (one LIST request per 1,000 keys); an entry whose manifest equals it is
  used as it is. A changed object (new ETag or size) makes a new copy of the entry, in which
  the objects that did not change are hard links to the old copy's files (not downloaded).
- Once per node: the download runs under an exclusive `fcntl.flock` on `<entry>.lock` beside
  the entry. Concurrent actors and processes wait for it, then find the entry fresh.
- Atomic: files go into `<entry>.tmp-<random>/`, the manifest last, and the folder is renamed
  into place. A process killed mid-download leaves only a temp folder (the next lock holder
  deletes it), never an entry; the kernel releases a dead process's lock.
- `weights=False` copies everything but weight files (config, tokenizer, index files) into a
  separate `.config` entry, or returns the full entry when that is already fresh. The driver
  uses it for the preflight and the tokenizer: a head node never needs the target's weights.

An object rewritten between the listing and its download is caught by a second listing after
the download (the copy is retried), so a manifest never records an ETag the files do not have.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from pipeline.storage import Storage, is_local

log = logging.getLogger("specbatch.model_cache")

MANIFEST = ".specbatch-manifest.json"
ENV_CACHE_DIR = "SPECBATCH_MODEL_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/specbatch/models"
# Files a tokenizer or a config check never reads; everything else is "config".
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")
# Copies retried when the model changes while it is being copied.
COPY_ATTEMPTS = 3


def cache_root(storage: Optional[Storage] = None) -> Path:
    configured = storage.model_cache_dir if storage else None
    return Path(os.path.expanduser(configured or os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR))


def is_weight(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def remote_files(uri: str, storage: Storage) -> dict[str, dict[str, Any]]:
    """Relative name -> {size, etag} of every object under the folder `uri`, from one listing."""
    base = uri.rstrip("/")
    found = storage.list_details(base)
    files = {
        full[len(base) + 1 :]: {"size": info["size"], "etag": info["version"]}
        for full, info in found.items()
        if full.startswith(base + "/") and not full.endswith("/")
    }
    if not files:
        raise FileNotFoundError(f"{uri}: no files there (a model folder in object storage is expected)")
    return files


def localize(uri: str, storage: Optional[Storage] = None, *, weights: bool = True) -> str:
    """A local folder holding the model at `uri`: the path itself when it is local, else this
    node's cache entry, copied first when missing or stale. `weights=False`: without weights."""
    if is_local(uri):
        return uri[len("file://") :] if uri.startswith("file://") else uri
    storage = storage or Storage()
    files = remote_files(uri, storage)
    full = _entry(uri, storage, "")
    if _fresh(full, files):
        return str(full)
    if not weights:  # a config entry, unless the full one is fresh (checked above)
        files = {name: info for name, info in files.items() if not is_weight(name)}
        return str(_sync(uri, storage, _entry(uri, storage, ".config"), files, weights=False))
    return str(_sync(uri, storage, full, files, weights=True))


def _entry(uri: str, storage: Storage, suffix: str) -> Path:
    key = hashlib.sha256(f"{storage.endpoint_url or ''}\n{uri.rstrip('/')}".encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", uri.rstrip("/").rsplit("/", 1)[-1]) or "model"
    return cache_root(storage) / f"{name}-{key}{suffix}"


def _recorded(entry: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((entry / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return None


def _fresh(entry: Path, files: dict[str, dict[str, Any]]) -> bool:
    return _recorded(entry) == files


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model cache: waiting for another process copying into %s", lock_file.with_suffix(""))
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sync(uri: str, storage: Storage, entry: Path, files: dict[str, dict[str, Any]], weights: bool) -> Path:
    with _locked(entry.parent / f"{entry.name}.lock"):
        for attempt in range(COPY_ATTEMPTS):
            if _fresh(entry, files):  # another process copied it while this one waited
                return entry
            for stale in [*entry.parent.glob(f"{entry.name}.tmp-*"), *entry.parent.glob(f"{entry.name}.old-*")]:
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed process: the lock is ours
            staging = entry.parent / f"{entry.name}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                _copy(uri, storage, staging, files, entry)
                now = remote_files(uri, storage)
                if not weights:
                    now = {name: info for name, info in now.items() if not is_weight(name)}
                if now != files:  # rewritten while copied: the copy may mix versions
                    log.warning("model cache: %s changed while it was copied; copying again", uri)
                    files = now
                    continue
                (staging / MANIFEST).write_text(json.dumps({"uri": uri, "files": files}, indent=1, sort_keys=True))
                _replace(staging, entry)
                return entry
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"{uri} kept changing while it was copied ({COPY_ATTEMPTS} attempts)")


def _copy(uri: str, storage: Storage, staging: Path, files: dict[str, dict[str, Any]], previous: Path) -> None:
    """Every object into `staging`; an object the stale entry `previous` already holds at the
    same size and ETag is hard-linked from it, not downloaded again (a changed config must not
    cost tens of GB of weights)."""
    recorded = _recorded(previous) or {}
    reused = {name for name, info in files.items() if recorded.get(name) == info and (previous / name).is_file()}
    needed = sum(info["size"] for name, info in files.items() if name not in reused)
    staging.mkdir(parents=True)
    free = shutil.disk_usage(staging).free
    if needed > free:
        raise OSError(f"model cache {staging.parent}: {uri} needs {needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    log.info(
        "model cache: copying %s (%d files, %.2f GB; %d kept from the previous copy) to %s",
        uri,
        len(files) - len(reused),
        needed / 1e9,
        len(reused),
        staging.parent,
    )
    fs, root = storage.fs(uri.rstrip("/"))
    for name, info in sorted(files.items()):
        target = staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name in reused:
            try:
                os.link(previous / name, target)
                continue
            except OSError:  # a file system without hard links: download it
                pass
        storage.retrying(f"copy {uri}/{name}", lambda: fs.get_file(f"{root}/{name}", str(target)))
        if target.stat().st_size != info["size"]:
            raise OSError(f"{uri}/{name}: copied {target.stat().st_size} bytes, the listing says {info['size']}")


def _replace(staging: Path, entry: Path) -> None:
    """Rename the finished copy into place; a stale entry is renamed away first and deleted
    (a process still reading its files keeps them open)."""
    old = None
    if entry.exists():
        old = entry.parent / f"{entry.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(entry, old)
    os.rename(staging, entry)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
