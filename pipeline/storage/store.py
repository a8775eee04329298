"""`Storage`: every URI the job reads or writes, through fsspec.

Credentials are never passed here: s3fs/botocore find them in the environment
(AWS_ACCESS_KEY_ID, AWS_PROFILE, ...) or the cloud identity (IRSA, instance profile).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.core import url_to_fs

from pipeline.config import StorageConfig
from pipeline.storage.retry import call_deadline, describe_store, retrying, s3_client_config

log = logging.getLogger("specbatch.storage")
T = TypeVar("T")


class PreconditionFailed(RuntimeError):
    """A conditional write or delete found the object changed since its version was read, or
    present where it was to be created."""


def _precondition_failed(exc: BaseException) -> bool:
    """s3fs turns S3's 412 PreconditionFailed into FileExistsError or OSError(EINVAL), and a
    conditional write that raced another (409 ConditionalRequestConflict) into OSError(EBUSY)."""
    while exc is not None:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return True
        exc = exc.__cause__
    return False


@dataclass(frozen=True)
class Storage:
    """A picklable handle: actors rebuild their file systems from it."""

    endpoint_url: Optional[str] = None
    region: Optional[str] = None
    outage_seconds: float = 120.0  # how long a silent store is waited for (pipeline/storage/retry.py)
    request_timeout_seconds: float = 30.0  # the bound on one attempt at a call
    model_cache_dir: Optional[str] = (
        None  # where models from object storage are copied (pipeline/storage/model_cache.py)
    )

    @classmethod
    def from_config(cls, config: StorageConfig) -> "Storage":
        return cls(
            endpoint_url=config.endpoint_url,
            region=config.region,
            outage_seconds=config.outage_seconds,
            request_timeout_seconds=config.request_timeout_seconds,
            model_cache_dir=config.model_cache_dir,
        )

    def retrying(self, what: str, operation: Callable[[], T]) -> T:
        """`operation`, with transient errors retried for up to `outage_seconds`; a store silent for
        longer raises StorageUnavailable. `what`: the operation, a space, then the key."""
        uri = next((word for word in what.split() if "://" in word), None)
        return retrying(describe_store(uri, self.endpoint_url, self.region), what, operation, self.outage_seconds)

    def _options(self, uri: str) -> dict[str, Any]:
        if not uri.startswith(("s3://", "s3a://")):
            return {}
        client_kwargs = {}
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        if self.region:
            client_kwargs["region_name"] = self.region
        # Listings must not be served from a cache: a resumed job must see every commit.
        # botocore's default pool (10 connections) would queue the parallel marker and footer reads.
        config = {"max_pool_connections": 64, **s3_client_config(self.request_timeout_seconds)}
        return {"client_kwargs": client_kwargs, "use_listings_cache": False, "config_kwargs": config}

    def fs(self, uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, path = url_to_fs(uri, **self._options(uri))
        if _is_s3(fs):
            fs.retries = 1  # one request per attempt: `retrying` is the one retry policy (pipeline/storage/retry.py)
        return fs, path

    def _deadline(self, fs: fsspec.AbstractFileSystem, body_bytes: int = 0) -> dict[str, float]:
        """The whole call's deadline, as fsspec takes it (it cancels the call then), on a store
        whose calls are coroutines."""
        return (
            {"timeout": call_deadline(self.request_timeout_seconds, body_bytes)}
            if isinstance(fs, AsyncFileSystem)
            else {}
        )

    def join(self, base: str, *parts: str) -> str:
        return posixpath.join(base.rstrip("/"), *parts)

    def exists(self, uri: str) -> bool:
        fs, path = self.fs(uri)
        return self.retrying(f"exists {uri}", lambda: fs.exists(path, **self._deadline(fs)))

    def write_bytes(self, uri: str, data: bytes) -> None:
        fs, path = self.fs(uri)

        def write():
            if "file" not in fs.protocol:  # an object store PUT is atomic already, and has no folders
                fs.pipe_file(path, data, **self._deadline(fs, len(data)))  # one PUT up to 100 MB on S3
                return
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            # On a file system a reader could see a half-written file: write aside, then rename.
            staging = f"{path}.tmp-{uuid.uuid4().hex}"
            with fs.open(staging, "wb") as f:
                f.write(data)
            os.replace(staging, path)

        self.retrying(f"write {uri}", write)

    def read_bytes(self, uri: str) -> bytes:
        """One GET on S3. (Opening the file would add a HEAD, and pin its ETag: a small object
        rewritten meanwhile, such as the lease renewed by its heartbeat, would fail the read.
        s3fs asks for the size first (a HEAD) unless told to read in one request.)"""
        fs, path = self.fs(uri)
        one_request = {"max_concurrency": 1} if "s3" in fs.protocol else {}
        return self.retrying(f"read {uri}", lambda: fs.cat_file(path, **one_request, **self._deadline(fs)))

    def delete(self, uri: str, recursive: bool = False) -> None:
        fs, path = self.fs(uri)
        if self.exists(uri):
            self.retrying(f"delete {uri}", lambda: fs.rm(path, recursive=recursive))

    def delete_many(self, uris: list[str]) -> None:
        """Delete files in bulk: s3fs sends one DeleteObjects request per 1,000 keys."""
        if not uris:
            return
        fs, _ = self.fs(uris[0])
        paths = [self.fs(uri)[1] for uri in uris]
        self.retrying(f"delete {len(uris)} files under {posixpath.dirname(uris[0])}", lambda: fs.rm(paths))

    # -------------------------------------------------- conditional writes (the lease's compare-and-swap)

    def conditional_writes(self, uri: str) -> bool:
        """Whether `write_if` and `delete_if` are atomic here: S3 (If-Match, If-None-Match) and
        local folders (an exclusive lock on the folder); elsewhere they check, then write."""
        fs, _ = self.fs(uri)
        return _is_s3(fs) or _is_local(fs)

    def read_versioned(self, uri: str) -> tuple[bytes, str]:
        """The object and its version, read together (one GET on S3: the ETag comes with the
        body); FileNotFoundError when absent."""
        fs, path = self.fs(uri)
        if not _is_s3(fs):
            data = self.read_bytes(uri)
            return data, _digest(data)
        bucket, key, _ = fs.split_path(path)

        async def get() -> tuple[bytes, str]:
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with response["Body"] as body:
                return await body.read(), response["ETag"]

        return self.retrying(f"read {uri}", lambda: sync(fs.loop, get, **self._deadline(fs)))

    def write_if(self, uri: str, data: bytes, version: Optional[str]) -> str:
        """Writes `data` only if the object is still at `version` (None: only if it does not
        exist); returns its new version, or raises PreconditionFailed. A write whose reply was
        lost and that is retried fails its own precondition: the caller reads the object to
        tell whether its write landed."""
        fs, path = self.fs(uri)
        if _is_s3(fs):
            bucket, key, _ = fs.split_path(path)
            condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
            try:
                reply = self.retrying(
                    f"write {uri}",
                    lambda: fs.call_s3(
                        "put_object", Bucket=bucket, Key=key, Body=data, **condition, **self._deadline(fs, len(data))
                    ),
                )
            except Exception as exc:
                if _precondition_failed(exc):
                    raise PreconditionFailed(f"{uri} changed since version {version}") from None
                raise
            return reply["ETag"]
        with self._folder_lock(uri):
            self._check_version(uri, version)
            self.write_bytes(uri, data)
        return _digest(data)

    def delete_if(self, uri: str, version: str) -> None:
        """Deletes the object only if it is still at `version`; PreconditionFailed otherwise."""
        fs, path = self.fs(uri)
        if _is_s3(fs):
            self._check_version(uri, version)  # S3 general purpose buckets may ignore If-Match on a delete
            bucket, key, _ = fs.split_path(path)
            try:
                self.retrying(
                    f"delete {uri}",
                    lambda: fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version, **self._deadline(fs)),
                )
            except FileNotFoundError:
                return  # gone: a retried delete whose first try landed, its reply lost
            except Exception as exc:
                if _precondition_failed(exc):
                    raise PreconditionFailed(f"{uri} changed since version {version}") from None
                raise
            return
        with self._folder_lock(uri):
            self._check_version(uri, version)
            self.delete(uri)

    def _check_version(self, uri: str, version: Optional[str]) -> None:
        try:
            current = self.read_versioned(uri)[1]
        except FileNotFoundError:
            current = None
        if current != version:
            raise PreconditionFailed(f"{uri} is at version {current}, not {version}")

    def _folder_lock(self, uri: str):
        """An exclusive flock on the object's folder, held by every conditional write here."""
        fs, path = self.fs(uri)
        folder = posixpath.dirname(path)
        if _is_local(fs):
            fs.makedirs(folder, exist_ok=True)
        return _FolderLock(folder if _is_local(fs) else None)

    def open_ranged(self, uri: str, size: Optional[int] = None):
        """A file opened for ranged reads only: no readahead cache (s3fs would otherwise read
        up to 50 MiB past every footer), and, when the listing gave its size, no HEAD request
        (s3fs asks for the object's details before its first read unless they are set)."""
        fs, path = self.fs(uri)
        if "s3" not in fs.protocol:
            return fs.open(path, "rb")
        f = fs.open(path, "rb", cache_type="none", size=size)
        if size is not None:
            f.details = {"name": path, "size": size, "type": "file"}
        return f

    def list_details(self, uri: str, suffix: str = "") -> dict[str, dict[str, Any]]:
        """Full URI -> {size, version} of the files under a folder, from the listing alone
        (one LIST request per 1,000 keys on S3); version is the ETag, or the mtime locally."""
        fs, path = self.fs(uri)
        found = self.retrying(f"list {uri}", lambda: fs.find(path, detail=True) if fs.exists(path) else {})
        return {
            self._unstrip(uri, p): {"size": int(info.get("size") or 0), "version": _version_of(info)}
            for p, info in sorted(found.items())
            if p.endswith(suffix)
        }

    def write_json(self, uri: str, doc: Any) -> None:
        self.write_bytes(uri, json_bytes(doc))

    def read_json(self, uri: str) -> Any:
        return json.loads(self.read_bytes(uri))

    def write_parquet(self, uri: str, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        self.write_bytes(uri, sink.getvalue().to_pybytes())

    def read_parquet(self, uri: str, columns: Optional[list[str]] = None) -> pa.Table:
        # Decoded on this thread: once Arrow's thread pool has started, a process now and then
        # aborts at interpreter exit after its work is done ("terminate called without an
        # active exception", exit 134; apache/arrow issue 34314). Files read whole are small.
        return pq.ParquetFile(pa.BufferReader(self.read_bytes(uri))).read(columns=columns, use_threads=False)

    def list_files(self, uri: str, suffix: str = "") -> list[str]:
        """Full URIs of the files directly or recursively under a folder, sorted; [] if absent.
        On S3 the listing pages are read for their keys alone: 100k keys stay a few MB, where
        s3fs's `find` would keep a dict of details per key."""
        fs, path = self.fs(uri)
        if "s3" in fs.protocol:
            found = self.retrying(f"list {uri}", lambda: self._s3_keys(fs, path.rstrip("/") + "/"))
        else:
            found = self.retrying(f"list {uri}", lambda: fs.find(path) if fs.exists(path) else [])
        return sorted(self._unstrip(uri, p) for p in found if p.endswith(suffix))

    def list_modified(self, uri: str, suffix: str = "") -> dict[str, float]:
        """As list_files, with each file's last write (epoch seconds; an object store's clock)."""
        fs, path = self.fs(uri)
        if "s3" in fs.protocol:
            listing = lambda: self._s3_keys(fs, path.rstrip("/") + "/", modified=True)  # noqa: E731
        else:
            listing = lambda: (
                [(p, _modified_of(i)) for p, i in fs.find(path, detail=True).items()] if fs.exists(path) else []
            )  # noqa: E731
        return {
            self._unstrip(uri, p): m for p, m in sorted(self.retrying(f"list {uri}", listing)) if p.endswith(suffix)
        }

    def _s3_keys(self, fs, prefix: str, modified: bool = False) -> list:
        """Keys under prefix, or (key, LastModified) pairs with `modified`."""
        bucket, _, key_prefix = prefix.partition("/")
        keys, token, deadline = [], {}, self._deadline(fs)
        while True:
            page = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key_prefix, **token, **deadline)
            for item in page.get("Contents", []):
                key = f"{bucket}/{item['Key']}"
                keys.append((key, item["LastModified"].timestamp()) if modified else key)
            if not page.get("IsTruncated"):
                return keys
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def expand_input(self, uri: str, suffix: str = ".parquet") -> dict[str, dict[str, Any]]:
        """A file, a folder of `suffix` files (recursively) or a glob -> {file URI: {size,
        version}}, sorted, from listings only (no request per file)."""
        fs, path = self.fs(uri)

        def expand():
            if any(ch in path for ch in "*?["):
                return {p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") == "file"}
            if fs.isdir(path):
                return {p: i for p, i in fs.find(path, detail=True).items() if p.endswith(suffix)}
            return {path: fs.info(path)} if fs.exists(path) else {}

        found = self.retrying(f"list {uri}", expand)
        return {
            self._unstrip(uri, p): {"size": int(info.get("size") or 0), "version": _version_of(info)}
            for p, info in sorted(found.items())
        }

    @staticmethod
    def _unstrip(original_uri: str, path: str) -> str:
        """fsspec returns protocol-less paths; give them back their scheme."""
        if "://" in original_uri and not original_uri.startswith("file://"):
            scheme = original_uri.split("://", 1)[0]
            return f"{scheme}://{path}"
        return path


def _version_of(info: dict[str, Any]) -> str:
    """What changes when a file is rewritten: the ETag on object stores, the mtime locally."""
    for key in ("ETag", "etag"):
        if info.get(key):
            return str(info[key]).strip('"')
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    return str(mtime)


def _modified_of(info: dict[str, Any]) -> float:
    """A listed file's last write in epoch seconds (local `mtime`, other stores' datetimes or
    ISO strings); 0.0 where the store gives none."""
    stamp = info.get("mtime") or info.get("LastModified") or info.get("updated") or info.get("created") or 0.0
    stamp = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")) if isinstance(stamp, str) else stamp
    return stamp.timestamp() if isinstance(stamp, dt.datetime) else float(stamp)


def json_bytes(doc: Any) -> bytes:
    """A JSON document as every writer here writes it."""
    return (json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n").encode()


def _is_s3(fs) -> bool:
    return "s3" in fs.protocol


def _is_local(fs) -> bool:
    return "file" in fs.protocol


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


class _FolderLock:
    """flock(LOCK_EX) on a folder for the length of a `with`; no lock where there is no folder
    to lock (a store that is neither S3 nor local: its conditional writes check, then write)."""

    def __init__(self, folder: Optional[str]):
        self.folder, self.fd = folder, None

    def __enter__(self):
        if self.folder is not None:
            self.fd = os.open(self.folder, os.O_RDONLY)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases its lock


def is_local(uri: str) -> bool:
    """A path on this machine's own file system (no scheme, or file://)."""
    return "://" not in uri or uri.startswith("file://")
