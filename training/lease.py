"""One trainer per run: a lease object `runs/<run_id>/_lease.json` in the store.

Acquired with a conditional create; renewed by a background thread with a conditional replace on
the etag it last wrote (IfMatch), so exactly one holder can renew it. Expiry is judged without
trusting anybody's wall clock: a contender takes a lease over only after watching its etag stay
unchanged for the lease's own `ttl_s` on its local monotonic clock (or at once if the holder
released it).

The margins (issue 26 item 10), all on the holder's monotonic clock from the moment a renewal
that then succeeded was *sent* (it landed later, so a contender cannot take over before
sent + ttl):
  - renewals every ttl/3 (RENEW_EVERY); a failed one is retried every min(2 s, ttl/10);
  - each renewal request is bounded by ttl/8 (connect and read timeout, no client retries:
    REQUEST_TIMEOUT), so a throttled PUT cannot eat the lease's remaining time;
  - the lease counts as lost after LOST_AFTER = 3/4 ttl without a successful renewal - the
    remaining quarter is the safety margin for clock-rate differences and a write in flight -
    or at once when a renewal meets another etag. From then on every store write of the trainer
    (checkpoint push, LATEST, prune, quarantine) refuses.

Fencing (issue 26 item 2): `fence()` is a conditional renewal (If-Match on the etag this holder
last wrote) run right before a checkpoint's manifest is committed. A holder that was paused
(SIGSTOP, a VM pause, a GC stall) while it uploaded finds on waking either its lease timed out
(monotonic clock) or the lease object moved (the If-Match fails): the commit does not happen. What
remains is the instant between the fence and the manifest PUT; a commit landing there is
recovered by the holder (training/checkpoints.py quarantines a conflicting checkpoint that it did
not write, and keeps the committed one over an earlier attempt's unpushed copy).
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
from pipeline_core.settings_loader import load_process_settings
from pipeline_core.store import ObjectNotFound, PreconditionFailed, open_store

log = logging.getLogger(__name__)

LEASE = "_lease.json"
RENEW_EVERY = 1 / 3  # of the ttl
LOST_AFTER = 3 / 4  # of the ttl without a successful renewal (sent time)
REQUEST_TIMEOUT = 1 / 8  # of the ttl, per renewal request


def lease_storage(storage, ttl_s: float):
    """The storage settings for lease requests: timeouts bounded by REQUEST_TIMEOUT x ttl and no
    client-side retries (the renewal loop retries), so one request never outlives the lease."""
    from pipeline_core.config import StorageSection

    storage = storage or StorageSection()
    bound = max(1.0, ttl_s * REQUEST_TIMEOUT)
    return storage.model_copy(update={"connect_timeout_s": min(storage.connect_timeout_s, bound),
                                      "read_timeout_s": min(storage.read_timeout_s, bound), "max_attempts": 1})


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
    """This launch's attempt: the launcher's MFT_ATTEMPT_ID (one per Airflow try), else torchrun's
    rendezvous run id, else a fresh one (a single process); under torchrun the agent's restart
    count is appended, so a restart of the workers is an attempt of its own too. The ranks of one
    launch use rank 0's (training/train.py broadcasts it): a replaced node's agent counts its
    restarts from 0."""
    raw = load_process_settings().attempt_id or os.environ.get("TORCHELASTIC_RUN_ID")
    if raw and os.environ.get("TORCHELASTIC_RUN_ID"):
        raw = f"{raw}-r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if not raw:
        raw = uuid.uuid4().hex[:12]
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[-100:].strip(".-") or uuid.uuid4().hex[:12]


class RunLease:
    def __init__(self, run_uri: str, storage, ttl_s: float, attempt: str):
        self.uri = uris.join(run_uri, LEASE)
        self.ttl_s, self.attempt = float(ttl_s), attempt
        self.storage = storage  # acquire / release: the store's usual retries (not time-critical)
        self._renew_storage = lease_storage(storage, self.ttl_s)  # renewals and fences: bounded
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{attempt}"
        self._etag: str | None = None
        self._acquired_at = 0.0
        self._last_renewal = 0.0  # monotonic
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewing = threading.Lock()  # the renewal thread and fence() never race on one etag

    # -- acquire / release
    def acquire(self, wait_s: float | None = None) -> RunLease:
        """Take the lease, waiting up to `wait_s` (default 1.5 x the holder's TTL, long enough for a
        dead holder's lease to expire) for the current holder to stop renewing; LeaseHeld if it
        keeps renewing."""
        store, key = open_store(self.uri, self.storage)
        t0 = time.monotonic()
        seen: tuple[str, float] | None = None  # (etag, monotonic time first seen)
        while True:
            now, sent = time.time(), time.monotonic()
            mine = LeaseBody(self.holder, self.attempt, self.ttl_s, now, now)
            try:
                info = store.put_bytes(key, mine.to_json(), if_none_match=True)
                return self._start(info.etag, store, key, now, sent)
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
                sent = time.monotonic()
                try:
                    info = store.put_bytes(key, mine.to_json(), if_match=etag)
                except PreconditionFailed:
                    continue  # another contender took it first, or the holder renewed: look again
                log.warning("took over the run lease %s from %s (%s)", self.uri, other.describe(),
                            "released" if other.released else "not renewed for its ttl")
                return self._start(info.etag, store, key, now, sent)
            limit = 1.5 * other.ttl_s if wait_s is None else wait_s
            if time.monotonic() - t0 >= limit:
                raise LeaseHeld(
                    f"run {uris.parent(self.uri)} is being trained by {other.describe()}; refusing to start a "
                    f"second trainer (waited {limit:.0f} s and it kept renewing). Stop the other trainer, or wait "
                    "for its lease to expire, or use another pipeline.run_id"
                )
            time.sleep(max(0.2, min(other.ttl_s / 6, 5.0)))

    def _start(self, etag: str | None, store, key: str, now: float, sent: float) -> RunLease:
        if not etag:  # a backend that returns no etag on PUT: read it back
            _, etag = store.get_versioned(key)
        self._etag, self._acquired_at, self._last_renewal = etag, now, sent
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
        quiet = time.monotonic() - self._last_renewal
        if self._lost is None and quiet > self.ttl_s * LOST_AFTER:
            self._lost = f"not renewed for {quiet:.1f} s (> {LOST_AFTER:.2f} x ttl {self.ttl_s:.0f} s)"
        if self._lost is not None:
            raise LeaseLost(f"lost the run lease {self.uri}: {self._lost}; stopping all writes to the run")

    @property
    def held(self) -> bool:
        try:
            self.check()
            return True
        except LeaseLost:
            return False

    def fence(self) -> None:
        """Prove the lease is still ours with a conditional write, right before a commit: LeaseLost
        when it timed out or moved to another holder; another error (the store unreachable) when it
        could not be proved - either way the caller does not commit."""
        self.check()
        store, key = open_store(self.uri, self._renew_storage)
        self._renew(store, key)
        self.check()

    def _renew(self, store, key: str) -> None:
        """One conditional renewal; LeaseLost if another writer changed the lease."""
        with self._renewing:
            if self._lost is not None:
                self.check()
            sent = time.monotonic()
            body = LeaseBody(self.holder, self.attempt, self.ttl_s, time.time(), self._acquired_at)
            try:
                info = store.put_bytes(key, body.to_json(), if_match=self._etag)
            except PreconditionFailed as e:
                self._lost = f"another writer changed it ({e})"
                log.error("run lease %s lost: %s", self.uri, self._lost)
                self.check()
            self._etag = info.etag or store.get_versioned(key)[1]
            self._last_renewal = max(self._last_renewal, sent)

    def _renew_loop(self) -> None:
        store, key = open_store(self.uri, self._renew_storage)
        while not self._stop.wait(self.ttl_s * RENEW_EVERY if self._renew_ok else min(2.0, self.ttl_s / 10)):
            if self._lost is not None:
                return
            try:
                self._renew(store, key)
            except LeaseLost:
                return
            except Exception as e:  # noqa: BLE001 - transient: try again soon; check() times it out
                self._renew_ok = False
                log.warning("run lease %s: renewal failed (%s); retrying", self.uri, e)
                continue
            self._renew_ok = True

    _renew_ok = True
