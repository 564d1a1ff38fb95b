"""A pointer that only moves forward (`models/LATEST`), built on create-if-absent alone.

The pointer is a chain of immutable records. A writer that compared its model with the record R
it read first claims R's successor slot `<prefix>/LATEST.d/<R's order key>.next` (`root.next` when
the pointer was never set) with a conditional write (S3 `IfNoneMatch: *`, a `link` on a local
directory), the claim holding its whole record; then it writes `<prefix>/LATEST.d/<order key>.json`
(a shortcut for readers). Only one writer can claim the slot after R, so the swap includes the
target it was compared with (issue 26.4): a writer whose R was replaced meanwhile loses the claim,
and `advance(compared_with=...)` says so (`PointerMoved`) before writing anything, so the caller
re-evaluates against the new target. Readers take the highest record and follow claims from it
(a writer killed between its claim and its record is still the pointer). A writer advances only
when its order key is greater than the pointer's, so two runs that finish out of order (a late
backfill, a zombie retry) never move the pointer backwards. No read-modify-write of one object is
needed, so every store that can create-if-absent is enough.

`<prefix>/LATEST` stays a plain mirror of the pointer (what `artifacts.read_latest` and older
readers read); every `advance`, whatever it decides (and `sync_mirror`, which a publish calls even
when it does not promote), re-writes the mirror until it agrees with the pointer, so a mirror left
behind by a publisher killed after its claim converges on the next publish.

The order key is a fixed-width integer (microseconds of the run's logical date, see
`order_key_from_date`), so that key order is numeric order in a plain object listing.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pipeline_core import uris
from pipeline_core.artifacts import LATEST, require_manifest
from pipeline_core.store import ObjectNotFound, PreconditionFailed, open_store

if TYPE_CHECKING:
    from pipeline_core.config import StorageSection

log = logging.getLogger(__name__)

RECORDS = f"{LATEST}.d"
ORDER_KEY = re.compile(r"^[0-9]{20}$")
CLAIM = ".next"  # `<order key>.next`: the one record allowed to follow that record
ROOT = "root"  # the claim slot of a pointer never set
_MIRROR_ROUNDS = 8
_CHAIN_LIMIT = 1_000_000
_CLAIM_ROUNDS = 64
UNCHECKED = object()  # `advance(compared_with=UNCHECKED)`: the caller compared with nothing


class PointerError(RuntimeError):
    pass


class PointerMoved(PointerError):
    """The pointer no longer names the record the caller compared with: evaluate again."""

    def __init__(self, message: str, current: PointerRecord | None):
        super().__init__(message)
        self.current = current


@dataclass(frozen=True)
class PointerRecord:
    """One immutable step of the pointer."""

    target: str
    manifest_sha256: str
    order_key: str
    run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> PointerRecord:
        d = json.loads(data)
        return cls(target=d["target"], manifest_sha256=d["manifest_sha256"], order_key=d["order_key"],
                   run_id=d.get("run_id"), extra=d.get("extra") or {})


@dataclass(frozen=True)
class Advance:
    """What `advance` did: `moved` is False when a record with an equal or greater key exists."""

    moved: bool
    current: PointerRecord | None
    reason: str


def order_key_from_date(when: datetime) -> str:
    """The order key of a run: microseconds since the epoch of its logical date, 20 digits."""
    if when.tzinfo is None:
        raise PointerError(f"order key needs a timezone-aware datetime, got {when!r}")
    micros = int(when.timestamp() * 1_000_000)
    if micros < 0:
        raise PointerError(f"order key: {when.isoformat()} is before 1970")
    return f"{micros:020d}"


def check_order_key(order_key: str, max_ahead_s: float | None = None) -> str:
    if not ORDER_KEY.match(order_key):
        raise PointerError(f"order key {order_key!r} must be 20 decimal digits (see order_key_from_date)")
    if max_ahead_s is not None and int(order_key) > int((time.time() + max_ahead_s) * 1_000_000):
        # a logical date in 2100 would pin the pointer forever: nothing could ever move it forward
        raise PointerError(f"order key {order_key} is more than release.max_order_key_ahead_s={max_ahead_s:g} s "
                           "ahead of now (a logical date in the future); publish it when its date has come")
    return order_key


def _is_record(name: str) -> bool:
    return name.endswith(".json") and ORDER_KEY.match(name[: -len(".json")]) is not None


def _records_prefix(key: str) -> str:
    return f"{key.rstrip('/')}/{RECORDS}/"


def read_pointer(prefix_uri: str, storage: StorageSection | None = None) -> PointerRecord | None:
    """The pointer: the highest record under `prefix_uri/LATEST.d/`, then the claims that follow it;
    None when the pointer was never set."""
    store, key = open_store(prefix_uri, storage)
    base = _records_prefix(key)
    names = {o.key[len(base):] for o in store.list(base)}
    records = [n for n in names if _is_record(n)]
    current = PointerRecord.from_json(store.get_bytes(base + max(records))) if records else None
    for _ in range(_CHAIN_LIMIT):
        slot = f"{current.order_key if current else ROOT}{CLAIM}"
        if slot not in names:
            return current
        nxt = PointerRecord.from_json(store.get_bytes(base + slot))
        if current is not None and nxt.order_key <= current.order_key:
            raise PointerError(f"{uris.join(prefix_uri, RECORDS, slot)} names order key {nxt.order_key}, "
                               f"not after {current.order_key}: the pointer's chain is broken")
        current = nxt
    raise PointerError(f"{uris.join(prefix_uri, RECORDS)}: the chain of claims does not end")


def advance(prefix_uri: str, target_uri: str, order_key: str, storage: StorageSection | None = None, *,
            run_id: str | None = None, extra: dict[str, Any] | None = None,
            compared_with: PointerRecord | None | object = UNCHECKED,
            max_ahead_s: float | None = None) -> Advance:
    """Move the pointer to `target_uri` (a committed artifact) if `order_key` is the newest.

    `compared_with`: the record the caller evaluated against (None: the pointer was empty). When
    the pointer names another record now, or another writer claims the slot after it first,
    `PointerMoved` is raised and nothing is written: the caller evaluates again. `max_ahead_s`
    refuses order keys that far beyond now. Idempotent: re-running a publish that already claimed
    its step returns `moved=True`. Every outcome leaves the plain mirror naming the pointer.
    """
    check_order_key(order_key, max_ahead_s)
    target_uri = target_uri.rstrip("/")
    manifest = require_manifest(target_uri, storage)
    store, key = open_store(prefix_uri, storage)
    record = PointerRecord(target=target_uri, manifest_sha256=manifest.sha256, order_key=order_key,
                           run_id=run_id, extra=extra or {})
    for _ in range(_CLAIM_ROUNDS):
        current = read_pointer(prefix_uri, storage)
        if current is not None and current.order_key == order_key and current.target == target_uri:
            _put_record(store, key, current)  # a publisher killed between its claim and its record
            sync_mirror(prefix_uri, storage)
            return Advance(True, current, "already points here (a retried publish)")
        if current is not None and current.order_key >= order_key:
            sync_mirror(prefix_uri, storage)
            return Advance(False, current, f"the pointer is at order key {current.order_key} ({current.target}), "
                                           f"not older than this run's {order_key}: it only moves forward")
        if compared_with is not UNCHECKED and _identity(current) != _identity(compared_with):  # type: ignore[arg-type]
            sync_mirror(prefix_uri, storage)
            raise PointerMoved(f"{prefix_uri.rstrip('/')}/LATEST moved to {_describe(current)} after this run was "
                               f"compared with {_describe(compared_with)}", current)  # type: ignore[arg-type]
        slot = f"{_records_prefix(key)}{current.order_key if current else ROOT}{CLAIM}"
        try:
            store.put_bytes(slot, record.to_json(), if_none_match=True)
            break
        except PreconditionFailed:
            other = PointerRecord.from_json(store.get_bytes(slot))
            if (other.order_key, other.target) == (order_key, target_uri):
                break  # our own claim, from an earlier try of this publish
            # lost the slot: an unchecked caller tries again from the new pointer, a comparing one re-evaluates
    else:
        raise PointerError(f"{uris.join(prefix_uri, LATEST)}: the pointer kept moving")
    _put_record(store, key, record)
    newest = sync_mirror(prefix_uri, storage)
    if newest is not None and newest.order_key != order_key:
        # a newer run advanced after us: our record is history, never the pointer
        return Advance(False, newest, f"a newer run advanced the pointer meanwhile ({newest.target})")
    log.info("%s/LATEST -> %s (order key %s)", prefix_uri.rstrip("/"), target_uri, order_key)
    return Advance(True, record, "advanced")


def _identity(record: PointerRecord | None) -> tuple[str, str] | None:
    return None if record is None else (record.order_key, record.target)


def _describe(record: PointerRecord | None) -> str:
    return "nothing" if record is None else f"{record.target} (order key {record.order_key})"


def _put_record(store: Any, key: str, record: PointerRecord) -> None:
    """The reader's shortcut `<order key>.json`, after the claim that made it the pointer."""
    try:
        store.put_bytes(f"{_records_prefix(key)}{record.order_key}.json", record.to_json(), if_none_match=True)
    except PreconditionFailed:
        pass  # written by an earlier try of this publish (the claim names one record per key)


def sync_mirror(prefix_uri: str, storage: StorageSection | None = None) -> PointerRecord | None:
    """Rewrite the plain `LATEST` mirror until it names the pointer; returns the pointer."""
    store, key = open_store(prefix_uri, storage)
    mirror = f"{key.rstrip('/')}/{LATEST}"
    newest = read_pointer(prefix_uri, storage)
    for _ in range(_MIRROR_ROUNDS):
        if newest is None:
            return None
        body = json.dumps({"target": newest.target, "manifest_sha256": newest.manifest_sha256,
                           "order_key": newest.order_key}, sort_keys=True).encode()
        try:
            if store.get_bytes(mirror) == body:
                return newest  # already converged: no write
        except ObjectNotFound:
            pass
        store.put_bytes(mirror, body)
        again = read_pointer(prefix_uri, storage)
        if again == newest:
            return newest
        newest = again
    raise PointerError(f"{uris.join(prefix_uri, LATEST)}: the pointer kept moving while its mirror was written")
