"""Faults against the store layer, forced deterministically on a real S3 server (moto over HTTP,
through tests/fault_proxy.py) and on the local backend: racing writers, a corrupted GET, 409s,
manifests that try to write outside their directory, conditional replace, rotated credentials."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from pipeline_core import artifacts, uris
from pipeline_core.artifacts import (
    ArtifactConflict,
    CorruptArtifact,
    fetch_artifact,
    publish_artifact,
    read_artifact_file,
    read_manifest,
)
from pipeline_core.config import StorageSection
from pipeline_core.store import PreconditionFailed, open_store, s3_client, sha256_file
from tests.fault_proxy import FaultProxy
from tests.test_store_contract import make_payload


def _objects(store, key: str) -> dict[str, str]:
    """key -> sha256 of every object under the artifact (what 'committed bytes' means)."""
    out = {}
    for o in store.list(key.rstrip("/") + "/"):
        out[o.key] = artifacts.sha256_bytes(store.get_bytes(o.key))
    return out


@pytest.mark.parametrize("same_content", [False, True])
def test_writer_paused_between_check_and_upload_never_touches_committed_bytes(s3_server, tmp_path, same_content):
    """B checks (no manifest yet), is paused before its first upload; A commits; B resumes. B must
    lose without changing one byte of A's artifact, and remove what it uploaded."""
    bucket = s3_server.new_bucket()
    uri = f"s3://{bucket}/datasets/v1/enriched/abc"
    a_payload = make_payload(tmp_path / "a", seed=0)
    b_payload = make_payload(tmp_path / "b", seed=0 if same_content else 9)
    release = threading.Event()
    with FaultProxy(s3_server.endpoint, fail_first=1, methods=("PUT",), hold=release) as proxy:
        b_storage = StorageSection(endpoint_url=proxy.endpoint, max_attempts=3)
        outcome: dict[str, object] = {}

        def writer_b():
            try:
                outcome["manifest"] = publish_artifact(b_payload, uri, kind="enriched", storage=b_storage)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                outcome["error"] = e

        t = threading.Thread(target=writer_b)
        t.start()
        deadline = time.time() + 60
        while proxy.held == 0:  # B has done its check and is stuck in its first PUT
            assert time.time() < deadline and t.is_alive(), "writer B never reached its upload"
            time.sleep(0.05)
        a = publish_artifact(a_payload, uri, kind="enriched", storage=s3_server.storage)
        store, key = open_store(uri, s3_server.storage)
        committed = _objects(store, key)
        release.set()
        t.join(timeout=60)
    assert not t.is_alive()
    if same_content:
        assert outcome["manifest"].sha256 == a.sha256, "same content: B's publish is a no-op returning A's manifest"
    else:
        assert isinstance(outcome.get("error"), ArtifactConflict), outcome
    assert _objects(store, key) == committed, "the losing writer changed or left objects under the artifact"
    assert read_manifest(uri, s3_server.storage).sha256 == a.sha256
    fetched = fetch_artifact(uri, tmp_path / "out", s3_server.storage)
    for f in fetched.files:
        assert sha256_file(tmp_path / "out" / f["path"]) == sha256_file(a_payload / f["path"])


def test_a_corrupted_get_is_read_again(s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    uri = f"s3://{bucket}/runs/r/checkpoints/step-2"
    publish_artifact(make_payload(tmp_path / "p"), uri, kind="checkpoint", storage=s3_server.storage)
    with FaultProxy(s3_server.endpoint, fail_first=1, methods=("GET",), path_contains="part-00001",
                    corrupt=True) as proxy:
        storage = StorageSection(endpoint_url=proxy.endpoint, max_attempts=3)
        m = fetch_artifact(uri, tmp_path / "out", storage)
        assert proxy.corrupted == 1
    for f in m.files:
        assert sha256_file(tmp_path / "out" / f["path"]) == f["sha256"]
    # corrupt on every read (bytes at rest): refused, naming the file, after a bounded number of reads
    with FaultProxy(s3_server.endpoint, fail_first=100, methods=("GET",), path_contains="part-00001",
                    corrupt=True) as proxy:
        storage = StorageSection(endpoint_url=proxy.endpoint, max_attempts=3)
        with pytest.raises(CorruptArtifact, match="part-00001"):
            fetch_artifact(uri, tmp_path / "out2", storage)
        assert proxy.corrupted == artifacts.READ_ATTEMPTS


def test_one_file_read_in_memory_is_verified_like_a_fetch(s3_server, tmp_path):
    """`read_artifact_file` (the served data report, the run summary's metrics): the listed file's
    bytes, a corrupted GET read again, corrupt bytes at rest refused, an unlisted path refused."""
    bucket = s3_server.new_bucket()
    uri = f"s3://{bucket}/datasets/v/report/r"
    payload = make_payload(tmp_path / "p")
    m = publish_artifact(payload, uri, kind="report", storage=s3_server.storage)
    path = "data/part-00001.parquet"
    with FaultProxy(s3_server.endpoint, fail_first=1, methods=("GET",), path_contains="part-00001",
                    corrupt=True) as proxy:
        storage = StorageSection(endpoint_url=proxy.endpoint, max_attempts=3)
        assert read_artifact_file(m, path, storage) == (payload / path).read_bytes()
        assert proxy.corrupted == 1
    with FaultProxy(s3_server.endpoint, fail_first=100, methods=("GET",), path_contains="part-00001",
                    corrupt=True) as proxy:
        storage = StorageSection(endpoint_url=proxy.endpoint, max_attempts=3)
        with pytest.raises(CorruptArtifact, match="part-00001"):
            read_artifact_file(m, path, storage)
        assert proxy.corrupted == artifacts.READ_ATTEMPTS
    for unlisted in ("_manifest.json", "data/part-00009.parquet", "data/../_manifest.json"):
        with pytest.raises(FileNotFoundError, match="is not a file of the committed artifact"):
            read_artifact_file(m, unlisted, s3_server.storage)


def test_conditional_request_conflict_409_is_retried_not_read_as_exists(s3_server):
    bucket = s3_server.new_bucket()
    with FaultProxy(s3_server.endpoint, fail_first=2, status=409, code="ConditionalRequestConflict",
                    methods=("PUT",)) as proxy:
        store, key = open_store(f"s3://{bucket}/x/_manifest.json", StorageSection(endpoint_url=proxy.endpoint,
                                                                                  max_attempts=4))
        store.put_bytes(key, b"body", if_none_match=True)
        assert proxy.failed == 2
    assert store.get_bytes(key) == b"body"
    with pytest.raises(PreconditionFailed):  # a real "exists" still loses
        store.put_bytes(key, b"other", if_none_match=True)


def _write_manifest(uri: str, storage, files: list[dict], payload: str = "") -> None:
    store, key = open_store(uri, storage)
    body = {"uri": uri, "kind": "checkpoint", "files": files, "counts": {}, "config": {}, "config_hash": "",
            "inputs": [], "code_version": "x", "content_sha256": "", "created_at": 0.0, "payload": payload}
    store.put_bytes(f"{key}/_manifest.json", json.dumps(body).encode())


@pytest.mark.parametrize("bad", ["/tmp/evil-abs", "../evil", "data/../../evil", "data//x", "./x", "a\\b", ""])
def test_manifest_paths_that_escape_are_refused(store_root, tmp_path, bad):
    root, storage = store_root
    uri = uris.join(root, "runs/r/checkpoints/step-1")
    store, key = open_store(uri, storage)
    store.put_bytes(f"{key}/evil", b"pwned")
    _write_manifest(uri, storage, [{"path": bad, "size": 5, "sha256": artifacts.sha256_bytes(b"pwned")}])
    dest = tmp_path / "d" / "e"
    with pytest.raises(CorruptArtifact, match="manifest file path"):
        fetch_artifact(uri, dest, storage)
    assert not (tmp_path / "evil").exists() and not (tmp_path / "d" / "evil").exists()
    assert not os.path.exists("/tmp/evil-abs")


def test_manifest_payload_prefix_that_escapes_is_refused(store_root, tmp_path):
    root, storage = store_root
    uri = uris.join(root, "a/b")
    _write_manifest(uri, storage, [{"path": "data/x", "size": 1, "sha256": "0"}], payload="../../c")
    with pytest.raises(CorruptArtifact, match="payload"):
        read_manifest(uri, storage)


def test_a_symlink_planted_in_the_destination_is_not_followed(store_root, tmp_path):
    root, storage = store_root
    uri = uris.join(root, "a/b")
    publish_artifact(make_payload(tmp_path / "p"), uri, kind="x", storage=storage)
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (dest / "data").symlink_to(outside)
    with pytest.raises(CorruptArtifact, match="resolves outside"):
        fetch_artifact(uri, dest, storage)
    assert not any(outside.iterdir())


@pytest.mark.parametrize("uri", ["s3://bucket/runs/r#1", "s3://bucket/runs?versionId=1", "file:///tmp/a#b"])
def test_uris_with_query_or_fragment_are_refused(uri):
    with pytest.raises(ValueError, match="query or fragment"):
        uris.require_uri(uri)


def test_conditional_replace(store_root):
    root, storage = store_root
    store, key = open_store(uris.join(root, "runs/r/lease.json"), storage)
    store.put_bytes(key, b"v1", if_none_match=True)
    data, etag = store.get_versioned(key)
    assert data == b"v1"
    store.put_bytes(key, b"v2", if_match=etag)
    with pytest.raises(PreconditionFailed):
        store.put_bytes(key, b"v3", if_match=etag)  # stale: someone replaced it since
    assert store.get_bytes(key) == b"v2"
    _, etag2 = store.get_versioned(key)
    store.delete(key)
    with pytest.raises(PreconditionFailed):
        store.put_bytes(key, b"v4", if_match=etag2)  # gone: a replace never recreates
    assert [o.key for o in store.list(key.rpartition("/")[0] + "/")] == []


def test_s3_clients_are_rebuilt_when_credentials_rotate(s3_server, tmp_path, monkeypatch):
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    a, _ = s3_client(s3_server.storage)
    assert s3_client(s3_server.storage)[0] is a
    os.utime(creds, (time.time() + 5, time.time() + 5))  # the secret mount was rotated
    assert s3_client(s3_server.storage)[0] is not a


def test_a_commit_whose_response_was_lost_is_recognised_as_ours(store_root, tmp_path, monkeypatch):
    """The manifest PUT lands, its response is lost, the retried request meets the object (412):
    the writer must see its own commit (payload prefix), not delete its payload as a loser's."""
    root, storage = store_root
    uri = uris.join(root, "datasets/v1/enriched/lost")
    real_open = artifacts.open_store

    def open_store_losing_response(u, s=None):
        st, k = real_open(u, s)
        put = st.put_bytes

        def put_bytes(key, data, if_none_match=False, if_match=None):
            info = put(key, data, if_none_match=if_none_match, if_match=if_match)
            if if_none_match and key.endswith("_manifest.json"):
                raise PreconditionFailed(f"{key} already exists")  # what the retry of the same request sees
            return info

        st.put_bytes = put_bytes
        return st, k

    monkeypatch.setattr(artifacts, "open_store", open_store_losing_response)
    m = publish_artifact(make_payload(tmp_path / "p"), uri, kind="enriched", storage=storage)
    monkeypatch.setattr(artifacts, "open_store", real_open)
    assert read_manifest(uri, storage).sha256 == m.sha256
    fetch_artifact(uri, tmp_path / "out", storage)  # every file still there and verified
