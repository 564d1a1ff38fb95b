"""One trainer per run: a lease object `runs/<run_id>/_lease.json` in the store.

Acquired with a conditional create; renewed by a background thread with a conditional replace on
the etag it last wrote (IfMatch), so exactly one holder can renew it. Expiry is judged without
trusting anybody's wall clock: a contender takes a lease over only after watching its etag stay
unchanged for the lease's own `ttl_s` on its local monotonic clock (or at once if the holder
released it). The holder declares the lease lost when a renewal meets another etag, or when it has
not managed to renew for half a TTL - before any contender can have taken over - and from then
on every store write of the trainer (checkpoint push, LATEST, prune, quarantine) refuses.

Design note: like any lease (Chubby, etcd), this fences cooperating processes; a holder frozen for
longer than half a TTL mid-request could still land one write. Checkpoint payloads are under
attempt-unique prefixes and manifests are conditional creates, so such a write can never change
committed bytes - it can at most add a checkpoint the new holder then sees as its own step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from pipeline_core import uris
from pipeline_core.store import ObjectNotFound, PreconditionFailed, open_store

log = logging.getLogger(__name__)

LEASE = "_lease.json"


class LeaseError(RuntimeError):
    pass


class LeaseHeld(LeaseError):
    """Another trainer holds the run's lease."""


class LeaseLost(LeaseError):
    """This trainer no longer holds the run's lease: it must stop writing to the run."""


@dataclass(frozen=True)
class LeaseBody:
    holder: str  # host:pid:attempt
    attempt: str
    ttl_s: float
    renewed_at: float  # the holder's wall clock, for people; never compared across machines
    acquired_at: float
    released: bool = False

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LeaseBody:
        d = json.loads(data)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def describe(self) -> str:
        age = time.time() - self.renewed_at
        return f"{self.holder} (attempt {self.attempt}, renewed {age:.0f} s ago, ttl {self.ttl_s:.0f} s)"


def attempt_id() -> str:
    """The same id on every rank of one launch: the launcher's MFT_ATTEMPT_ID, else torchrun's
    rendezvous run id + restart count, else a fresh one (a single process)."""
    raw = os.environ.get("MFT_ATTEMPT_ID")
    if not raw and os.environ.get("TORCHELASTIC_RUN_ID"):
        raw = f"{os.environ['TORCHELASTIC_RUN_ID']}-r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if not raw:
        raw = uuid.uuid4().hex[:12]
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[:100].strip(".-") or uuid.uuid4().hex[:12]


class RunLease:
    def __init__(self, run_uri: str, storage, ttl_s: float, attempt: str):
        self.uri = uris.join(run_uri, LEASE)
        self.storage, self.ttl_s, self.attempt = storage, float(ttl_s), attempt
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{attempt}"
        self._etag: str | None = None
        self._acquired_at = 0.0
        self._last_renewal = 0.0  # monotonic
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- acquire / release
    def acquire(self, wait_s: float | None = None) -> RunLease:
        """Take the lease, waiting up to `wait_s` (default 1.5 x the holder's TTL, long enough for a
        dead holder's lease to expire) for the current holder to stop renewing; LeaseHeld if it
        keeps renewing."""
        store, key = open_store(self.uri, self.storage)
        t0 = time.monotonic()
        seen: tuple[str, float] | None = None  # (etag, monotonic time first seen)
        while True:
            now = time.time()
            mine = LeaseBody(self.holder, self.attempt, self.ttl_s, now, now)
            try:
                info = store.put_bytes(key, mine.to_json(), if_none_match=True)
                return self._start(info.etag, store, key, now)
            except PreconditionFailed:
                pass
            try:
                data, etag = store.get_versioned(key)
            except ObjectNotFound:
                continue  # released and deleted in between: create again
            try:
                other = LeaseBody.from_json(data)
            except (ValueError, TypeError, KeyError):
                other = LeaseBody("<unreadable lease>", "?", self.ttl_s, 0.0, 0.0)
            if seen is None or seen[0] != etag:
                seen = (etag, time.monotonic())
            expired = other.released or time.monotonic() - seen[1] >= other.ttl_s
            if expired:
                try:
                    info = store.put_bytes(key, mine.to_json(), if_match=etag)
                except PreconditionFailed:
                    continue  # another contender took it first, or the holder renewed: look again
                log.warning("took over the run lease %s from %s (%s)", self.uri, other.describe(),
                            "released" if other.released else "not renewed for its ttl")
                return self._start(info.etag, store, key, now)
            limit = 1.5 * other.ttl_s if wait_s is None else wait_s
            if time.monotonic() - t0 >= limit:
                raise LeaseHeld(
                    f"run {uris.parent(self.uri)} is being trained by {other.describe()}; refusing to start a "
                    f"second trainer (waited {limit:.0f} s and it kept renewing). Stop the other trainer, or wait "
                    "for its lease to expire, or use another pipeline.run_id"
                )
            time.sleep(max(0.2, min(other.ttl_s / 6, 5.0)))

    def _start(self, etag: str | None, store, key: str, now: float) -> RunLease:
        if not etag:  # a backend that returns no etag on PUT: read it back
            _, etag = store.get_versioned(key)
        self._etag, self._acquired_at, self._last_renewal = etag, now, time.monotonic()
        log.info("holding the run lease %s as %s (ttl %.0f s)", self.uri, self.holder, self.ttl_s)
        self._thread = threading.Thread(target=self._renew_loop, name="run-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Mark the lease released (conditional on still holding it), so the next attempt starts at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._lost or self._etag is None:
            return
        store, key = open_store(self.uri, self.storage)
        body = LeaseBody(self.holder, self.attempt, self.ttl_s, time.time(), self._acquired_at, released=True)
        try:
            store.put_bytes(key, body.to_json(), if_match=self._etag)
            log.info("released the run lease %s", self.uri)
        except Exception:  # noqa: BLE001 - it then expires after its ttl
            log.warning("could not release the run lease %s; it expires after %.0f s", self.uri, self.ttl_s,
                        exc_info=True)
        self._etag = None

    # -- holding
    def check(self) -> None:
        """Raise LeaseLost unless the lease is (still) held: call before every write to the run."""
        if self._lost is None and time.monotonic() - self._last_renewal > self.ttl_s / 2:
            self._lost = f"not renewed for {time.monotonic() - self._last_renewal:.0f} s (> ttl/2)"
        if self._lost is not None:
            raise LeaseLost(f"lost the run lease {self.uri}: {self._lost}; stopping all writes to the run")

    @property
    def held(self) -> bool:
        try:
            self.check()
            return True
        except LeaseLost:
            return False

    def _renew_loop(self) -> None:
        store, key = open_store(self.uri, self.storage)
        while not self._stop.wait(self.ttl_s / 3 if self._renew_ok else min(2.0, self.ttl_s / 10)):
            if self._lost is not None:
                return
            now = time.time()
            body = LeaseBody(self.holder, self.attempt, self.ttl_s, now, self._acquired_at)
            try:
                info = store.put_bytes(key, body.to_json(), if_match=self._etag)
            except PreconditionFailed as e:
                self._lost = f"another writer changed it ({e})"
                log.error("run lease %s lost: %s", self.uri, self._lost)
                return
            except Exception as e:  # noqa: BLE001 - transient: try again soon; check() times it out
                self._renew_ok = False
                log.warning("run lease %s: renewal failed (%s); retrying", self.uri, e)
                continue
            self._renew_ok = True
            self._etag = info.etag or store.get_versioned(key)[1]
            self._last_renewal = time.monotonic()

    _renew_ok = True
