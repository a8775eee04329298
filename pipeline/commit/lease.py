"""The lease on an output location: one run at a time writes there, and a run that lost it
stops writing.

A run writes `_lease.json` (owner, job, attempt, its host and process, a generation) before
it plans, and renews its heartbeat every `lease.heartbeat_seconds` from a background thread.
A second run decides from what it finds, with no flag for what the lease can tell:
- the owner ran on this host and its process is gone (pid and start time, so a reused pid is
  not taken for it): taken over at once;
- the owner's process is alive here, also stopped (Ctrl-Z, SIGSTOP), also with `--take-over`:
  refused, naming it and how to end it (`_alive_here`);
- the owner runs elsewhere: the run watches the heartbeat for up to `lease.wait_seconds`. A
  heartbeat renewed meanwhile is a live run: refused. One older than
  `lease.stale_after_seconds` is a dead run (a killed driver, a lost node): taken over.
`--take-over` takes it at once, for a person who knows the owner is dead.

Every write of the lease is a compare-and-swap on the version last read (S3: If-Match and
If-None-Match on the PUT; local folders: the same under an exclusive lock on the folder), and
each acquisition raises the generation by one. So of two runs that start in the same instant
exactly one gets the lease, and a run whose renewal finds another owner's write has lost it:
it stops (LeaseLost), and its engines, which check the generation before each unit's marker,
commit nothing more. On a store with neither (the run says so at start) the lease is written,
then read back, which narrows a race without closing it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

from pipeline.commit.fence import LEASE, LeaseLost, check_fence, holds
from pipeline.commit.outputs import OutputLocation
from pipeline.config import LeaseConfig
from pipeline.storage import PreconditionFailed, StorageUnavailable, json_bytes
from schemas import Fence, Lease, utc_timestamp

log = logging.getLogger("specbatch.lease")


class LeaseHeld(RuntimeError):
    """Another run owns the output location."""


def heartbeat_age(lease: Lease, now: Optional[float] = None) -> float:
    return (time.time() if now is None else now) - lease.heartbeat_at


def is_stale(lease: Lease, now: Optional[float] = None) -> bool:
    """No heartbeat for stale_after_seconds: its run is dead, and another may take over."""
    return heartbeat_age(lease, now) >= lease.stale_after_seconds


def owner_status_here(lease: Lease) -> Optional[str]:
    """The owner's process state on this host as psutil tells it ('running', 'sleeping',
    'stopped', ...), or 'gone': ended, a zombie (it ran to its end; its parent has not
    reaped it yet) or its pid reused by another process (another start time). None when it
    ran elsewhere (or wrote a lease of an older specbatch, without its process)."""
    import psutil

    if lease.host != socket.gethostname() or lease.pid is None:
        return None
    try:
        process = psutil.Process(lease.pid)
        started, status = process.create_time(), process.status()
    except psutil.NoSuchProcess:
        return "gone"
    if status == psutil.STATUS_ZOMBIE or (
        lease.pid_started_at is not None and abs(started - lease.pid_started_at) >= 1.0
    ):
        return "gone"
    return status


def describe(lease: Lease, location: OutputLocation, now: Optional[float] = None) -> str:
    return (
        f"{location.uri} is leased to run {lease.owner} (job {lease.job_id}, attempt {lease.attempt}), "
        f"last heartbeat {heartbeat_age(lease, now):.0f}s ago"
    )


class OutputLease:
    def __init__(self, location: OutputLocation, config: LeaseConfig, job_id: str, attempt: int):
        import psutil

        self.location, self.config = location, config
        self.uri = location.path(LEASE)
        host, pid = socket.gethostname(), os.getpid()
        self.lease = Lease(
            owner=f"{host}:{pid}:{uuid.uuid4().hex[:8]}",
            job_id=job_id,
            attempt=attempt,
            acquired_at=utc_timestamp(),
            heartbeat_at=time.time(),
            stale_after_seconds=config.stale_after_seconds,
            host=host,
            pid=pid,
            pid_started_at=psutil.Process(pid).create_time(),
        )
        self.atomic = location.storage.conditional_writes(self.uri)
        # set by the heartbeat when another run took over, or the store did not answer a renewal for
        # storage.outage_seconds
        self.lost: Optional[LeaseLost | StorageUnavailable] = None
        self._version: Optional[str] = None  # of this run's last write
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def fence(self) -> Fence:
        """What an engine checks before each commit (pipeline/commit/fence.check_fence)."""
        return Fence(owner=self.lease.owner, generation=self.lease.generation)

    def still_ours(self) -> None:
        """LeaseLost when another run has taken the location over (one GET unless the heartbeat
        found it already)."""
        if self.lost is None:
            try:
                check_fence(self.location.storage, self.location.uri, self.fence)
            except LeaseLost as lost:
                self.lost = lost
        if self.lost is not None:
            raise self.lost

    def current(self) -> Optional[Lease]:
        return self._read()[0]

    def _read(self) -> tuple[Optional[Lease], Optional[str]]:
        try:
            data, version = self.location.storage.read_versioned(self.uri)
        except FileNotFoundError:
            return None, None
        return Lease.model_validate(json.loads(data)), version

    def acquire(self, take_over: bool = False, say: Callable[[str], None] = log.warning) -> Optional[Lease]:
        """Take the lease, waiting for a silent owner elsewhere as the module says; returns the
        lease taken over, if any. LeaseHeld when another run holds it."""
        if not self.atomic:
            say(
                f"{self.location.uri}: this store has no conditional writes; the lease is written and read back, "
                "which narrows, but cannot close, a race between two runs started at the same instant"
            )
        watch, held = _Watch(self.config, say), None
        while True:
            before = held
            held, version = self._read()
            if held is not None and held.owner == self.lease.owner:  # our write landed and its answer was lost
                self._version, self.lease.generation, held = version, held.generation, before
                break
            if held is not None and not watch.may_take(held, self.location, take_over):
                continue
            self.lease.generation = (held.generation if held else 0) + 1
            self.lease.heartbeat_at = time.time()
            try:
                self._version = self.location.storage.write_if(self.uri, self._bytes(), version)
            except PreconditionFailed:
                continue  # another run wrote first: judge its lease
            if not self.atomic:
                self._read_back()
            if held is not None:
                say(f"taking over {describe(held, self.location)}: {watch.why}")
            break
        self._thread = threading.Thread(target=self._heartbeat, name="specbatch-lease", daemon=True)
        self._thread.start()
        return held

    def check(self, take_over: bool = False) -> Optional[str]:
        """Whether this run could take the lease now, writing nothing and waiting for nothing (one
        GET): LeaseHeld when it would be refused or would have to wait; what it would take over
        and why, or None when no run holds it."""
        held = self.current()
        if held is None:
            return None
        watch = _Watch(self.config, log.info, waits=False)
        watch.may_take(held, self.location, take_over)
        return f"the lease of run {held.owner} (job {held.job_id}) would be taken over: {watch.why}"

    def _bytes(self) -> bytes:
        return json_bytes(self.lease.model_dump(mode="json"))

    def _read_back(self) -> None:
        time.sleep(0.05)
        if (self.current() or self.lease).owner != self.lease.owner:
            raise LeaseHeld(
                f"{self.location.uri}: another run took the lease at the same moment; it goes on, this one stops. "
                "Nothing to do while it runs; rerun once it has ended to finish what it left"
            )

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_seconds):
            try:
                self._renew()
            except (LeaseLost, StorageUnavailable) as lost:  # the attempt stops (graph_run raises it)
                self.lost = lost
                log.error("%s", lost)
                return
            except Exception as exc:  # the storage retries already; a missed beat is not fatal
                log.warning("lease heartbeat failed: %s", exc)

    def _renew(self) -> None:
        self.lease.heartbeat_at = time.time()
        try:
            self._version = self.location.storage.write_if(self.uri, self._bytes(), self._version)
        except PreconditionFailed:
            held, version = self._read()
            if not holds(held, self.fence):  # a retried write of ours lands as ours
                check_fence(self.location.storage, self.location.uri, self.fence)
            self._version = version

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        held, version = self._read()
        if holds(held, self.fence):
            try:
                self.location.storage.delete_if(self.uri, version)
            except PreconditionFailed:  # taken over in between: the new owner's lease stays
                pass


class _Watch:
    """One run's look at a lease held by another, over the reads of `acquire`'s loop.
    `waits`: False for a look that must not wait (the dry run)."""

    def __init__(self, config: LeaseConfig, say: Callable[[str], None], waits: bool = True):
        self.config, self.say, self.waits = config, say, waits
        self.started = time.time()
        self.seen: Optional[Lease] = None  # the lease as first read, for a heartbeat that moves
        self.why = ""

    def may_take(self, held: Lease, location: OutputLocation, take_over: bool) -> bool:
        """True when `held` may be taken over now (`why` says why); False after a pause, to read
        it again; LeaseHeld when its run is alive, or when waiting would outlast wait_seconds."""
        now, where = time.time(), describe(held, location)
        status = owner_status_here(held)
        if status not in (None, "gone"):
            raise LeaseHeld(f"{where}: {_alive_here(held, status, take_over)}")
        if status == "gone":
            self.why = f"its process {held.pid} on this host is gone"
        elif take_over:
            self.why = "--take-over"
        elif is_stale(held, now):
            self.why = f"no heartbeat for {heartbeat_age(held, now):.0f}s: its run is dead"
        elif self.seen is not None and self.seen.owner == held.owner and self.seen.heartbeat_at != held.heartbeat_at:
            raise LeaseHeld(
                f"{where}: that run is alive (its heartbeat was renewed while this run waited). {_way_out(held)}"
            )
        else:
            return self._wait(held, now, where)
        return True

    def _wait(self, held: Lease, now: float, where: str) -> bool:
        stale_at = held.heartbeat_at + held.stale_after_seconds
        if not self.waits or stale_at > self.started + self.config.wait_seconds:
            waits = (
                f"a run waits up to lease.wait_seconds ({self.config.wait_seconds:g}s) for a silent lease to go stale"
                if not self.waits
                else f"that is after lease.wait_seconds ({self.config.wait_seconds:g}s)"
            )
            raise LeaseHeld(
                f"{where}: that run is alive as far as its heartbeat tells; its lease goes stale in "
                f"{stale_at - now:.0f}s, and {waits}. {_way_out(held)}"
            )
        if self.seen is None or self.seen.owner != held.owner:
            until = dt.datetime.fromtimestamp(stale_at, dt.timezone.utc).strftime("%H:%M:%S UTC")
            self.say(
                f"{where}: waiting until {until} ({stale_at - now:.0f}s) for it to go stale; "
                "a heartbeat renewed meanwhile means it is alive, and this run stops"
            )
            self.seen = held
        time.sleep(min(self.config.heartbeat_seconds / 2, 5.0, max(0.05, stale_at - now)))
        return False


def _alive_here(held: Lease, status: str, take_over: bool) -> str:
    """The refusal of an owner whose process is alive on this host: it names the process and how
    to end it, and never suggests --take-over, which takes nothing from a live run here (with the
    flag, it says so). A stopped process (Ctrl-Z, SIGSTOP) is refused as well: fencing would keep
    the location right (continued, it would find the lease gone and its engines would commit
    nothing more), but it is not dead. SIGSTOP stops its driver alone: its Ray and engine
    processes keep this host's accelerators and memory, which a second run here would compete
    for, and nothing would ever end them. Ending it is one command, and then the location is
    taken over at once."""
    stopped = status in ("stopped", "tracing-stop")
    if stopped:
        what = (
            f"that run is stopped, not dead: its process {held.pid} on this host ({held.host}) is in state "
            f"'{status}' (Ctrl-Z or SIGSTOP), and its engines still hold this host's resources"
        )
        end = (
            f"`kill -INT {held.pid} && kill -CONT {held.pid}` (it resumes only to stop, as after Ctrl-C: it ends "
            "its engines and records its attempt as interrupted)"
        )
    else:
        what = f"that run is alive: its process {held.pid} on this host ({held.host}) is {status}"
        end = (
            f"`kill -INT {held.pid}` (as Ctrl-C in its terminal: it ends its engines and records its attempt as "
            "interrupted)"
        )
    flag = "; --take-over takes a location only from a run that is dead" if take_over else ""
    return (
        f"{what}{flag}. Two runs on one output location would duplicate work: wait for it to end, or end it: {end}; "
        f"`kill -9 {held.pid}` if it has not ended within a minute. Then run the same command again: a run whose "
        "process has ended here is taken over at once."
    )


def _way_out(held: Lease) -> str:
    return (
        "Two runs on one output location would duplicate work: wait for it to end. If you know it is dead, rerun "
        f"with --take-over; without it the next run takes over once its heartbeat is older than "
        f"{held.stale_after_seconds:g}s."
    )
