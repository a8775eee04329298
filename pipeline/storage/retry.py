"""How long a job waits for a store that does not answer: never longer than a known bound.

Each attempt at a call is bounded (storage.request_timeout_seconds, T below), and transient
errors are retried with jittered exponential backoff for up to `storage.outage_seconds`. A
store that answers again within that window costs nothing but time; one that does not raises
StorageUnavailable, which names the store, the operation and the key, and ends the attempt (a
rerun resumes from the committed units). So a call gives up at most outage_seconds plus one
attempt's deadline after it began.

The bound on one attempt, on S3:
- connect and read timeouts of T: the read timeout is how long the store may stay silent
  while it answers; aiohttp starts it once a request's body is sent, so a slow upload of a
  large Parquet part never trips it;
- botocore's and s3fs's own retries are off (one request per attempt): this loop is the only
  retry policy. Their defaults (5 botocore attempts within each of 5 s3fs tries, each waiting
  out s3fs's 15 s read timeout) made one read of a frozen store take minutes
  (docs/measurements.md);
- a deadline on the whole call (fsspec cancels it): T + 1 s, plus a second per 512 KiB of a
  write's body. S3 PUTs ask `Expect: 100-continue`, and aiohttp waits for that interim answer
  with no timer at all: a PUT to a stopped server waits until fsspec's timeout cancels it
  (docs/measurements.md).

Once a call in a process has given up on a store, the other calls of that process that fail on
it within the next outage_seconds give up at once (one that succeeds clears this): the attempt
is ending, and its close, its lease release and its heartbeat must not each wait out the window
again.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Optional, TypeVar

log = logging.getLogger("specbatch.storage")
T = TypeVar("T")

# Messages of errors that a later attempt can cure: the endpoint away or silent for a while,
# throttling. Ray Data's file reads retry on the same patterns (pipeline/graph adds them).
TRANSIENT_ERRORS = (
    "Cannot connect to host",
    "Connection refused",
    "Could not connect to the endpoint URL",
    "Connection reset",
    "Server disconnected",
    "ServerDisconnected",
    "Connection aborted",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "timed out",
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "503",
)
FIRST_DELAY, LONGEST_DELAY = 0.25, 8.0  # seconds between attempts: doubled each time, jittered
SLOWEST_UPLOAD_BYTES_PER_SECOND = 512 * 1024  # a link slower than this (4 Mbit/s) is taken for a store that stopped

# store -> (since when it was silent, when a call gave up on it), in time.monotonic()
_given_up: dict[str, tuple[float, float]] = {}


class StorageUnavailable(RuntimeError):
    """A store that did not answer for `storage.outage_seconds`. Built by `gave_up`; its args are
    the message alone, so that it pickles (Ray carries it from an actor to the driver)."""

    store, operation, key = "", "", ""


def gave_up(
    store: str, what: str, silent_seconds: float, outage_seconds: float, last: BaseException
) -> StorageUnavailable:
    operation, _, key = what.partition(" ")
    down = StorageUnavailable(
        f"storage unavailable: {store} has not answered for {silent_seconds:.0f}s, over storage.outage_seconds "
        f"({outage_seconds:g}s); gave up on '{operation}' of {key} (last error: {said(last)}). This attempt stops here "
        "and what it committed stays: rerun the same command once the store answers again, and it resumes from there."
    )
    down.store, down.operation, down.key = store, operation, key
    return down


def said(exc: BaseException) -> str:
    """An error in one line: its type, and its message when it has one (a timeout's has none)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (StorageUnavailable, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    text = f"{type(exc).__name__}: {exc}"
    return any(pattern in text for pattern in TRANSIENT_ERRORS) or isinstance(exc, (ConnectionError, TimeoutError))


def retrying(store: str, what: str, operation: Callable[[], T], outage_seconds: float) -> T:
    """`operation`, retried on transient errors for up to `outage_seconds` from the call's start;
    other errors are raised as they are, a store silent for longer as StorageUnavailable.
    `what`: the operation, a space, then the key ("write s3://bucket/out/_commits/u.json")."""
    began, delay = time.monotonic(), FIRST_DELAY
    while True:
        try:
            result = operation()
        except Exception as exc:
            if not is_transient(exc):
                raise
            pause = delay * (0.5 + random.random())
            silent_since = _gives_up(store, began, pause, outage_seconds)
            if silent_since is not None:
                raise gave_up(store, what, time.monotonic() - silent_since, outage_seconds, exc) from exc
            log.warning("storage: %s failed (%s); retrying in %.1fs", what, said(exc), pause)
            time.sleep(pause)
            delay = min(delay * 2, LONGEST_DELAY)
        else:
            _given_up.pop(store, None)
            return result


def _gives_up(store: str, began: float, pause: float, outage_seconds: float) -> Optional[float]:
    """Since when the store has been silent, when this call gives up: after outage_seconds, or at
    once within outage_seconds of another call of this process giving up on the same store."""
    now = time.monotonic()
    silent_since, given_up_at = _given_up.get(store, (began, -outage_seconds))
    if now - given_up_at <= outage_seconds:
        return silent_since
    if now + pause - began > outage_seconds:
        _given_up[store] = (began, now)
        return began
    return None


def call_deadline(request_timeout: float, body_bytes: int = 0) -> float:
    """The deadline of a whole call that sends `body_bytes`: see the module's docstring. A second
    over the socket timeouts, so that those, which say what timed out, come first where they can."""
    return request_timeout + 1.0 + body_bytes / SLOWEST_UPLOAD_BYTES_PER_SECOND


def s3_client_config(request_timeout: float) -> dict:
    """botocore Config arguments: one request per attempt, each with connect and read timeouts."""
    return {"connect_timeout": request_timeout, "read_timeout": request_timeout, "retries": {"total_max_attempts": 1}}


def describe_store(uri: Optional[str], endpoint_url: Optional[str], region: Optional[str]) -> str:
    """The store a URI lives in, as an error names it."""
    scheme = uri.split("://", 1)[0] if uri and "://" in uri else "file"
    if scheme in ("s3", "s3a"):
        if endpoint_url:
            return f"the S3 endpoint {endpoint_url}"
        return f"AWS S3 (region {region})" if region else "AWS S3"
    return "the local file system" if scheme == "file" else f"the {scheme}:// store"
