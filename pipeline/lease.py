"""The lease on an output location: one run at a time writes there.

A run writes `_lease.json` (owner, job, attempt) before it plans, and renews its heartbeat
every `lease.heartbeat_seconds` from a background thread. A second run while the heartbeat
is fresh is refused, naming the owner; once the heartbeat is older than
`lease.stale_after_seconds` (its owner is dead: a killed driver, a lost node) a run may take
over with `--take-over`. A duplicated scheduled run is then harmless.

Two runs that start within the same instant could both see no lease: each writes its own and
reads it back, and the loser (whose write was overwritten) gives up. Object stores are
strongly consistent for a single key, which this relies on.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from pipeline.config import LeaseConfig
from pipeline.outputs import LEASE, OutputLocation
from schemas import Lease

log = logging.getLogger("specbatch.lease")


class LeaseHeld(RuntimeError):
    """Another run owns the output location."""


def read_lease(location: OutputLocation) -> Optional[Lease]:
    """The location's lease (one GET); None when no run holds it."""
    try:
        return Lease.model_validate(location.storage.read_json(location.path(LEASE)))
    except FileNotFoundError:
        return None


def heartbeat_age(lease: Lease, now: Optional[float] = None) -> float:
    return (time.time() if now is None else now) - lease.heartbeat_at


def is_stale(lease: Lease, now: Optional[float] = None) -> bool:
    """No heartbeat for stale_after_seconds: its run is dead, and another may take over."""
    return heartbeat_age(lease, now) >= lease.stale_after_seconds


class OutputLease:
    def __init__(self, location: OutputLocation, config: LeaseConfig, job_id: str, attempt: int):
        self.location, self.config = location, config
        self.uri = location.path(LEASE)
        self.lease = Lease(
            owner=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
            job_id=job_id,
            attempt=attempt,
            acquired_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            heartbeat_at=time.time(),
            stale_after_seconds=config.stale_after_seconds,
        )
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def current(self) -> Optional[Lease]:
        return read_lease(self.location)  # a lease released meanwhile is no lease

    def acquire(self, take_over: bool = False) -> Optional[Lease]:
        """Take the lease; returns the stale lease taken over, if any."""
        held = self.check(take_over)
        if held is not None:
            log.warning("taking over %s, leased to run %s (job %s, attempt %s), last heartbeat %.0fs ago",
                        self.location.uri, held.owner, held.job_id, held.attempt, heartbeat_age(held))
        self._write()
        time.sleep(0.05)
        if (self.current() or self.lease).owner != self.lease.owner:
            raise LeaseHeld(
                f"{self.location.uri}: another run took the lease at the same moment; it goes on, this one stops. "
                "Nothing to do while it runs; rerun once it has ended to finish what it left"
            )
        self._thread = threading.Thread(target=self._heartbeat, name="specbatch-lease", daemon=True)
        self._thread.start()
        return held

    def check(self, take_over: bool = False) -> Optional[Lease]:
        """Whether this run could take the lease, writing nothing (one GET): LeaseHeld when
        another run holds it; the stale lease it would take over (with `take_over`), or None."""
        held = self.current()
        if held is not None:
            now = time.time()
            age = heartbeat_age(held, now)
            where = (
                f"{self.location.uri} is leased to run {held.owner} (job {held.job_id}, attempt {held.attempt}), "
                f"last heartbeat {age:.0f}s ago"
            )
            if not is_stale(held, now):
                raise LeaseHeld(
                    f"{where}: that run is alive, and two runs on one output location would duplicate work. "
                    f"Wait for it to end; if it is dead, rerun with --take-over once its heartbeat is older than "
                    f"{held.stale_after_seconds:.0f}s."
                )
            if not take_over:
                raise LeaseHeld(f"{where}, which is stale: its run is dead. Rerun with --take-over to take the location over.")
        return held

    def _write(self) -> None:
        self.lease.heartbeat_at = time.time()
        self.location.storage.write_json(self.uri, self.lease.model_dump(mode="json"))

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_seconds):
            try:
                self._write()
            except Exception as exc:  # the storage retries already; a missed beat is not fatal
                log.warning("lease heartbeat failed: %s", exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        held = self.current()
        if held is not None and held.owner == self.lease.owner:
            self.location.storage.delete(self.uri)
