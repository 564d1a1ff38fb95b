"""`models/LATEST` only moves forward: a sequence of create-if-absent records, highest order key wins,
on a local directory and on a real S3 server (moto on loopback)."""

from __future__ import annotations

import random
import threading
from datetime import UTC, datetime, timedelta

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import publish_artifact, read_latest
from pipeline_core.pointers import PointerError, advance, order_key_from_date, read_pointer

DAY = datetime(2026, 1, 1, 2, tzinfo=UTC)


def _key(days: int) -> str:
    return order_key_from_date(DAY + timedelta(days=days))


def _models(tmp_path, root, storage, n: int) -> list[str]:
    out = []
    for i in range(n):
        d = tmp_path / f"m{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / "w.bin").write_bytes(f"model {i}".encode())
        uri = uris.join(root, "runs", f"r{i}", "model")
        publish_artifact(d, uri, kind="model", storage=storage)
        out.append(uri)
    return out


def test_order_keys_sort_like_dates():
    keys = [_key(d) for d in (0, 1, 10, 400)]
    assert keys == sorted(keys) and all(len(k) == 20 for k in keys)
    with pytest.raises(PointerError, match="timezone-aware"):
        order_key_from_date(datetime(2026, 1, 1))


def test_out_of_order_finishes_never_move_it_back(store_root, tmp_path):
    root, storage = store_root
    models_uri = uris.join(root, "models")
    old, new = _models(tmp_path, root, storage, 2)
    assert read_pointer(models_uri, storage) is None
    # the newer run (day 2) finishes first, the older one (day 1, a late backfill) after it
    assert advance(models_uri, new, _key(2), storage, run_id="r1").moved
    late = advance(models_uri, old, _key(1), storage, run_id="r0")
    assert not late.moved and "only moves forward" in late.reason
    assert read_pointer(models_uri, storage).target == new
    assert read_latest(models_uri, storage) == new  # old readers (the plain LATEST mirror) agree
    # a retried publish of the winner is a no-op that still succeeds
    assert advance(models_uri, new, _key(2), storage, run_id="r1").moved
    # an equal key for another target is refused, not a tie that flips
    assert not advance(models_uri, old, _key(2), storage).moved
    assert read_pointer(models_uri, storage).target == new


def test_concurrent_writers_end_at_the_highest_key(store_root, tmp_path):
    root, storage = store_root
    models_uri = uris.join(root, "models")
    targets = _models(tmp_path, root, storage, 6)
    days = list(range(6))
    random.Random(7).shuffle(days)
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def publish(i: int) -> None:
        try:
            barrier.wait()
            advance(models_uri, targets[i], _key(days[i]), storage)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    newest = targets[days.index(max(days))]
    assert read_pointer(models_uri, storage).target == newest
    assert read_latest(models_uri, storage) == newest  # the plain mirror


def test_uncommitted_target_is_refused(local_store_uri):
    from pipeline_core.artifacts import ArtifactNotFound

    with pytest.raises(ArtifactNotFound):
        advance(uris.join(local_store_uri, "models"), uris.join(local_store_uri, "runs/x/model"), _key(0))
    with pytest.raises(PointerError, match="20 decimal digits"):
        advance(uris.join(local_store_uri, "models"), uris.join(local_store_uri, "runs/x/model"), "2026-01-01")
