"""A pointer that only moves forward (`models/LATEST`), built on create-if-absent alone.

The pointer is a sequence of immutable records `<prefix>/LATEST.d/<order key>.json`, each created
with a conditional write (S3 `IfNoneMatch: *`, a `link` on a local directory); readers take the
record with the highest order key. A writer advances only when its order key is greater than the
highest one it sees, so two runs that finish out of order (a late backfill, a zombie retry) can
never move the pointer backwards: the older one's record is either refused or sorts below. No
read-modify-write of one object is needed, so every store that can create-if-absent is enough.

`<prefix>/LATEST` stays a plain mirror of the highest record (what `artifacts.read_latest` and
older readers read); each writer re-checks the highest record after writing the mirror and
rewrites it until they agree, so the mirror converges to the newest record too.

The order key is a fixed-width integer (microseconds of the run's logical date, see
`order_key_from_date`), so that key order is numeric order in a plain object listing.
"""

from __future__ import annotations

import json
import logging
import re
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
_MIRROR_ROUNDS = 8


class PointerError(RuntimeError):
    pass


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


def _check_key(order_key: str) -> str:
    if not ORDER_KEY.match(order_key):
        raise PointerError(f"order key {order_key!r} must be 20 decimal digits (see order_key_from_date)")
    return order_key


def _is_record(name: str) -> bool:
    return name.endswith(".json") and ORDER_KEY.match(name[: -len(".json")]) is not None


def _records_prefix(key: str) -> str:
    return f"{key.rstrip('/')}/{RECORDS}/"


def read_pointer(prefix_uri: str, storage: StorageSection | None = None) -> PointerRecord | None:
    """The highest record under `prefix_uri/LATEST.d/`, or None when the pointer was never set."""
    store, key = open_store(prefix_uri, storage)
    names = [o.key for o in store.list(_records_prefix(key)) if _is_record(o.key.rsplit("/", 1)[-1])]
    if not names:
        return None
    return PointerRecord.from_json(store.get_bytes(max(names)))


def advance(prefix_uri: str, target_uri: str, order_key: str, storage: StorageSection | None = None, *,
            run_id: str | None = None, extra: dict[str, Any] | None = None) -> Advance:
    """Move the pointer to `target_uri` (a committed artifact) if `order_key` is the newest.

    Idempotent: re-running a publish that already created its record returns `moved=True`.
    """
    _check_key(order_key)
    target_uri = target_uri.rstrip("/")
    manifest = require_manifest(target_uri, storage)
    store, key = open_store(prefix_uri, storage)
    record = PointerRecord(target=target_uri, manifest_sha256=manifest.sha256, order_key=order_key,
                           run_id=run_id, extra=extra or {})
    current = read_pointer(prefix_uri, storage)
    if current is not None and current.order_key == order_key and current.target == target_uri:
        _sync_mirror(prefix_uri, storage)
        return Advance(True, current, "already points here (a retried publish)")
    if current is not None and current.order_key >= order_key:
        return Advance(False, current, f"the pointer is at order key {current.order_key} ({current.target}), "
                                       f"not older than this run's {order_key}: it only moves forward")
    try:
        store.put_bytes(f"{_records_prefix(key)}{order_key}.json", record.to_json(), if_none_match=True)
    except PreconditionFailed:
        other = PointerRecord.from_json(store.get_bytes(f"{_records_prefix(key)}{order_key}.json"))
        if other.target != target_uri:
            return Advance(False, other, f"another publish took order key {order_key} first ({other.target})")
    newest = _sync_mirror(prefix_uri, storage)
    if newest is not None and newest.order_key != order_key:
        # a newer run advanced while we did: our record is history, never the pointer
        return Advance(False, newest, f"a newer run advanced the pointer meanwhile ({newest.target})")
    log.info("%s/LATEST -> %s (order key %s)", prefix_uri.rstrip("/"), target_uri, order_key)
    return Advance(True, record, "advanced")


def _sync_mirror(prefix_uri: str, storage: StorageSection | None) -> PointerRecord | None:
    """Rewrite the plain `LATEST` mirror until it names the highest record."""
    store, key = open_store(prefix_uri, storage)
    mirror = f"{key.rstrip('/')}/{LATEST}"
    newest = read_pointer(prefix_uri, storage)
    for _ in range(_MIRROR_ROUNDS):
        if newest is None:
            return None
        body = json.dumps({"target": newest.target, "manifest_sha256": newest.manifest_sha256,
                           "order_key": newest.order_key}, sort_keys=True).encode()
        store.put_bytes(mirror, body)
        again = read_pointer(prefix_uri, storage)
        if again == newest:
            return newest
        newest = again
    raise PointerError(f"{uris.join(prefix_uri, LATEST)}: the pointer kept moving while its mirror was written")


def read_mirror(prefix_uri: str, storage: StorageSection | None = None) -> str | None:
    """The target named by the plain mirror (what older readers see)."""
    store, key = open_store(prefix_uri, storage)
    try:
        return json.loads(store.get_bytes(f"{key.rstrip('/')}/{LATEST}"))["target"]
    except ObjectNotFound:
        return None
