"""The object store's contract, run against both backends (local directory, real S3 server)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from pipeline_core import artifacts, uris
from pipeline_core.artifacts import (
    ArtifactConflict,
    ArtifactError,
    CorruptArtifact,
    fetch_artifact,
    publish_artifact,
    read_latest,
    read_manifest,
    write_latest,
)
from pipeline_core.config import PipelineSection, StorageSection
from pipeline_core.store import ChecksumMismatch, ObjectNotFound, PreconditionFailed, open_store, sha256_file
from tests.fault_proxy import FaultProxy


def make_payload(d, n_files=3, size=1000, seed=0):
    (d / "data").mkdir(parents=True, exist_ok=True)
    (d / "rejects").mkdir(exist_ok=True)
    for i in range(n_files):
        (d / "data" / f"part-{i:05d}.parquet").write_bytes(bytes((seed + i + j) % 251 for j in range(size)))
    (d / "rejects" / "part-00000.parquet").write_bytes(b"rejected" * 10)
    return d


def test_bytes_round_trip_and_listing(store_root):
    root, storage = store_root
    store, key = open_store(uris.join(root, "a"), storage)
    info = store.put_bytes(f"{key}/x/1.bin", b"hello")
    store.put_bytes(f"{key}/x/2.bin", b"world")
    store.put_bytes(f"{key}/y.bin", b"!")
    assert store.get_bytes(f"{key}/x/1.bin", expected_sha256=info.sha256) == b"hello"
    assert [o.key for o in store.list(f"{key}/x/")] == [f"{key}/x/1.bin", f"{key}/x/2.bin"]
    assert store.head(f"{key}/x/2.bin").size == 5
    assert store.head(f"{key}/nope") is None
    with pytest.raises(ObjectNotFound):
        store.get_bytes(f"{key}/nope")
    assert store.delete_prefix(f"{key}/x/") == 2
    assert store.list(f"{key}/x/") == []


def test_large_object_round_trip_multipart(store_root, tmp_path):
    """≥ 64 MiB through the multipart path (threshold/chunk 8 MiB... forced low so parts are many)."""
    root, storage = store_root
    storage = storage.model_copy(update={"multipart_threshold_mb": 8, "multipart_chunksize_mb": 8})
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:
        for _i in range(65):
            f.write(os.urandom(1024 * 1024))  # 65 MiB, incompressible
    store, key = open_store(uris.join(root, "big"), storage)
    info = store.put_file(f"{key}/big.bin", src)
    assert info.size == 65 * 1024 * 1024
    if root.startswith("s3://"):
        # multipart uploads carry an ETag of the form "<md5>-<parts>"
        etag = store.client.head_object(Bucket=store.bucket, Key=f"{key}/big.bin")["ETag"]
        assert etag.strip('"').endswith("-9"), etag
    out = tmp_path / "back.bin"
    store.get_file(f"{key}/big.bin", out, expected_sha256=sha256_file(src))
    assert sha256_file(out) == sha256_file(src)


def test_crash_between_data_and_manifest_leaves_no_artifact(store_root, tmp_path):
    root, storage = store_root
    uri = uris.join(root, "datasets/v1/enriched/abc")
    payload = make_payload(tmp_path / "p")
    store, key = open_store(uri, storage)

    # Simulate a crash: the manifest write dies after every data file was uploaded.
    original = store.put_bytes
    import pipeline_core.artifacts as art

    def open_store_crashing(u, s=None):
        st, k = open_store(u, s)

        def put_bytes(k2, data, if_none_match=False):
            if k2.endswith("_manifest.json"):
                raise KeyboardInterrupt("crash before the manifest")
            return original(k2, data, if_none_match)

        st.put_bytes = put_bytes
        return st, k

    art_open = art.open_store
    art.open_store = open_store_crashing
    try:
        with pytest.raises(KeyboardInterrupt):
            publish_artifact(payload, uri, kind="enriched", counts={"in": 3, "out": 3}, storage=storage)
    finally:
        art.open_store = art_open
    assert store.list(f"{key}/{artifacts.ATTEMPTS}/"), "data files were uploaded (under the attempt's prefix)"
    assert read_manifest(uri, storage) is None, "without a manifest the artifact does not exist"
    with pytest.raises(artifacts.ArtifactNotFound):
        fetch_artifact(uri, tmp_path / "out", storage)
    # A retry commits it.
    m = publish_artifact(payload, uri, kind="enriched", counts={"in": 3, "out": 3}, storage=storage)
    assert read_manifest(uri, storage).content_sha256 == m.content_sha256


def test_publish_is_idempotent_and_immutable(store_root, tmp_path):
    root, storage = store_root
    uri = uris.join(root, "datasets/v1/enriched/abc")
    payload = make_payload(tmp_path / "p")
    counts = {"in": 10, "out": 7, "rejected": {"no_question": 2, "bad_json": 1}}
    m1 = publish_artifact(payload, uri, kind="enriched", config={"k": 1}, counts=counts, storage=storage)
    m2 = publish_artifact(payload, uri, kind="enriched", config={"k": 1}, counts=counts, storage=storage)
    assert m1.content_sha256 == m2.content_sha256
    stored = read_manifest(uri, storage)
    assert stored.counts == counts
    assert {f["path"] for f in stored.files} == {
        "data/part-00000.parquet", "data/part-00001.parquet", "data/part-00002.parquet", "rejects/part-00000.parquet"
    }
    other = make_payload(tmp_path / "q", seed=7)
    with pytest.raises(ArtifactConflict, match="already committed with different content"):
        publish_artifact(other, uri, kind="enriched", counts=counts, storage=storage)
    out = tmp_path / "out"
    fetched = fetch_artifact(uri, out, storage)
    for f in fetched.files:
        assert sha256_file(out / f["path"]) == f["sha256"]


def test_counts_must_add_up(store_root, tmp_path):
    root, storage = store_root
    with pytest.raises(ArtifactError, match="do not add up"):
        publish_artifact(make_payload(tmp_path / "p"), uris.join(root, "a"), kind="x",
                         counts={"in": 10, "out": 7, "rejected": {"r": 2}}, storage=storage)


def test_corrupted_object_is_detected_on_read(store_root, tmp_path):
    root, storage = store_root
    uri = uris.join(root, "datasets/v1/train/abc")
    publish_artifact(make_payload(tmp_path / "p"), uri, kind="train", storage=storage)
    store, key = open_store(uri, storage)
    victim = f"{key}/{read_manifest(uri, storage).object_path('data/part-00001.parquet')}"
    # Overwrite the object behind the store's back (bit rot, a partial overwrite, a bad copy).
    if root.startswith("s3://"):
        store.client.put_object(Bucket=store.bucket, Key=victim, Body=b"garbage")
    else:
        (uris.to_local_path(store.uri(victim))).write_bytes(b"garbage")
    with pytest.raises(CorruptArtifact, match="data/part-00001.parquet"):
        fetch_artifact(uri, tmp_path / "out", storage)


def test_s3_read_verifies_stored_sha256_even_without_a_manifest(s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    store, _ = open_store(f"s3://{bucket}/k", s3_server.storage)
    store.put_bytes("k", b"original")
    # Same key, new bytes, stale checksum metadata: what a torn or foreign write looks like.
    s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"tampered", Metadata={"sha256": "0" * 64})
    with pytest.raises(ChecksumMismatch):
        store.get_bytes("k")
    with pytest.raises(ChecksumMismatch):
        store.get_file("k", tmp_path / "k")
    assert not (tmp_path / "k").exists()


def _race(root, storage_json, target, barrier, results, i):
    storage = StorageSection.model_validate_json(storage_json)
    barrier.wait()
    try:
        write_latest(uris.join(root, "datasets/v1/enriched"), target, storage)
        results.put((i, "won"))
    except PreconditionFailed:
        results.put((i, "lost"))


def test_two_writers_racing_for_latest_exactly_one_wins(store_root, tmp_path):
    root, storage = store_root
    targets = []
    for i in range(2):
        uri = uris.join(root, f"datasets/v1/enriched/cfg{i}")
        publish_artifact(make_payload(tmp_path / f"p{i}", seed=i), uri, kind="enriched", storage=storage)
        targets.append(uri)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(root, storage.model_dump_json(), targets[i], barrier, results, i))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    outcome = dict(results.get(timeout=5) for _ in procs)
    assert sorted(outcome.values()) == ["lost", "won"], outcome
    winner = next(i for i, r in outcome.items() if r == "won")
    assert read_latest(uris.join(root, "datasets/v1/enriched"), storage) == targets[winner]


def test_latest_is_written_only_after_target_manifest(store_root):
    root, storage = store_root
    with pytest.raises(artifacts.ArtifactNotFound):
        write_latest(uris.join(root, "runs/r1/checkpoints"), uris.join(root, "runs/r1/checkpoints/step-5"), storage)
    assert read_latest(uris.join(root, "runs/r1/checkpoints"), storage) is None


@pytest.mark.parametrize("version", ["../other", "a/../../b", "..", "v1/../../x", "/abs", "v1\\x", "", ".hidden"])
def test_traversal_in_dataset_version_is_rejected(version):
    with pytest.raises(ValueError, match="dataset_version"):
        PipelineSection(dataset_version=version)


def test_store_refuses_traversal_in_keys(store_root):
    root, storage = store_root
    with pytest.raises(ValueError):
        uris.join(root, "datasets", "../../etc")
    if root.startswith("file://"):
        store, key = open_store(root, storage)
        with pytest.raises(ValueError):
            store.put_bytes(f"{key}/../escape", b"x")


def test_transient_server_errors_are_retried(s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    with FaultProxy(s3_server.endpoint, fail_first=2, status=503, code="SlowDown") as proxy:
        storage = StorageSection(endpoint_url=proxy.endpoint, max_attempts=4)
        uri = f"s3://{bucket}/datasets/v1/enriched/abc"
        publish_artifact(make_payload(tmp_path / "p"), uri, kind="enriched", storage=storage)
        assert proxy.failed == 2 and proxy.forwarded > 0
        assert read_manifest(uri, storage) is not None
    with FaultProxy(s3_server.endpoint, fail_first=10, status=500, code="InternalError") as proxy:
        storage = StorageSection(endpoint_url=proxy.endpoint, max_attempts=3)
        store, key = open_store(f"s3://{bucket}/x", storage)
        from botocore.exceptions import ClientError

        with pytest.raises(ClientError, match="InternalError"):
            store.put_bytes(key, b"data")
        assert proxy.failed == 3, "gives up after max_attempts, not before"


def test_latest_pointer_format(store_root, tmp_path):
    root, storage = store_root
    uri = uris.join(root, "runs/r1/checkpoints/step-2")
    m = publish_artifact(make_payload(tmp_path / "p"), uri, kind="checkpoint", storage=storage)
    write_latest(uris.join(root, "runs/r1/checkpoints"), uri, storage)
    store, key = open_store(uris.join(root, "runs/r1/checkpoints/LATEST"), storage)
    assert json.loads(store.get_bytes(key)) == {"target": uri, "manifest_sha256": m.sha256}
    uri2 = uris.join(root, "runs/r1/checkpoints/step-4")
    publish_artifact(make_payload(tmp_path / "p2", seed=3), uri2, kind="checkpoint", storage=storage)
    with pytest.raises(PreconditionFailed):
        write_latest(uris.join(root, "runs/r1/checkpoints"), uri2, storage)
    write_latest(uris.join(root, "runs/r1/checkpoints"), uri2, storage, replace=True)
    assert read_latest(uris.join(root, "runs/r1/checkpoints"), storage) == uri2


def test_local_objects_get_ordinary_permissions(local_store_uri, tmp_path):
    store, key = open_store(local_store_uri)
    store.put_bytes(f"{key}/a.bin", b"x")
    src = tmp_path / "f"
    src.write_bytes(b"y")
    store.put_file(f"{key}/b.bin", src)
    for name in ("a.bin", "b.bin"):
        mode = (uris.to_local_path(local_store_uri) / name).stat().st_mode & 0o777
        assert mode & 0o044, f"{name} is readable only by its owner ({oct(mode)}): other users of the store cannot read it"


def test_s3_clients_are_reused_per_settings(s3_server):
    a, _ = open_store("s3://bucket-a/x", s3_server.storage)
    b, _ = open_store("s3://bucket-b/y", s3_server.storage)
    c, _ = open_store("s3://bucket-a/x", s3_server.storage.model_copy(update={"max_attempts": 2}))
    assert a.client is b.client
    assert c.client is not a.client
