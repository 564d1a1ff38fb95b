"""The store is data, never a path or a guarantee taken on trust (issue 26.8a, 26.8c, 26.9c):

- input keys under an s3:// source that would write outside the download directory
  (`raw//abs/x`, `raw/../x`) are refused, naming the key, before any file is copied;
- a server that ignores If-None-Match (a real loopback proxy in front of moto strips the header)
  is found by the probe before the first conditional write of a process, and a stage refuses to
  start on it unless `storage.accept_unenforced_conditional_writes` accepts the risk;
- a failed local write (the disk fills mid-way) leaves no `.tmp` file behind.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import publish_artifact, read_manifest
from pipeline_core.config import Config, StorageSection
from pipeline_core.store import ConditionalWritesIgnored, LocalStore
from tests.fault_proxy import FaultProxy

LINE = b'{"uuid": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'


# ---------------------------------------------------------------- 8a: keys are not paths
def test_input_keys_that_would_escape_the_download_dir_are_refused(spark, s3_server, s3_bucket_uri, tmp_path):
    from spark_jobs.enrich.readers import read_records

    bucket = uris.split_bucket_key(s3_bucket_uri)[0]
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="raw/chat-0.jsonl", Body=LINE)
    outside = tmp_path / "outside" / "chat-abs.jsonl"
    download = tmp_path / "staging" / "download"
    for bad in (f"raw/{outside}", "raw/../chat-up.jsonl"):  # raw//tmp/.../outside/..., and a '..' segment
        client.put_object(Bucket=bucket, Key=bad, Body=LINE)
        with pytest.raises(ValueError, match=rf"input key {bad!r}.*absolute or contains '\.\.'"):
            read_records(spark, f"{s3_bucket_uri}/raw", ["chat"], download_dir=download, storage=s3_server.storage)
        client.delete_object(Bucket=bucket, Key=bad)
        assert not outside.exists() and not (tmp_path / "staging" / "chat-up.jsonl").exists()
        assert not download.exists() or not any(download.rglob("*.jsonl"))  # refused before any copy
    # the clean prefix still reads
    df, source = read_records(spark, f"{s3_bucket_uri}/raw", ["chat"], download_dir=download,
                              storage=s3_server.storage)
    assert df.count() == 1 and source["downloaded_to"] == uris.qualify(download)


# ---------------------------------------------------------------- 8c: conditional writes enforced
def _proxied(proxy: FaultProxy, **kw) -> StorageSection:
    return StorageSection(endpoint_url=proxy.endpoint, max_attempts=2, **kw)


def test_a_store_that_ignores_if_none_match_is_refused_naming_the_setting(s3_server, s3_bucket_uri, tmp_path):
    src = tmp_path / "art"
    (src / "data").mkdir(parents=True)
    (src / "data" / "a.txt").write_bytes(b"a")
    uri = f"{s3_bucket_uri}/datasets/x"
    with FaultProxy(s3_server.endpoint, strip_headers=("If-None-Match",)) as proxy:
        with pytest.raises(ConditionalWritesIgnored, match="storage.accept_unenforced_conditional_writes"):
            publish_artifact(src, uri, kind="enriched", storage=_proxied(proxy))
        assert read_manifest(uri, s3_server.storage) is None  # nothing committed
        # the operator accepts the risk: the same publish goes through (with a warning)
        publish_artifact(src, uri, kind="enriched", storage=_proxied(proxy, accept_unenforced_conditional_writes=True))
    assert read_manifest(uri, s3_server.storage) is not None
    # the probe's scratch objects are gone
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=uris.split_bucket_key(s3_bucket_uri)[0])
            .get("Contents", [])]
    assert not [k for k in keys if "conditional-write-probe" in k], keys
    # an enforcing server (moto itself) passes the probe
    publish_artifact(src, f"{s3_bucket_uri}/datasets/y", kind="enriched", storage=s3_server.storage)


def test_a_stage_refuses_to_start_on_such_a_store_before_spark(s3_server, s3_bucket_uri, tmp_path, monkeypatch):
    from spark_jobs import common
    from spark_jobs.enrich import job as enrich

    def no_spark(*a, **k):
        raise AssertionError("Spark started on a store without conditional writes")

    monkeypatch.setattr(common, "spark_session", no_spark)
    with FaultProxy(s3_server.endpoint, strip_headers=("If-None-Match",)) as proxy:
        cfg = Config.model_validate({"pipeline": {"store_uri": s3_bucket_uri,
                                                  "staging_uri": uris.qualify(tmp_path / "staging")},
                                     "storage": _proxied(proxy).model_dump()})
        with pytest.raises(ConditionalWritesIgnored, match="storage.accept_unenforced_conditional_writes"):
            enrich.run(uris.qualify(tmp_path / "raw"), f"{s3_bucket_uri}/datasets/v1/enriched/abc", cfg)


# ---------------------------------------------------------------- 9c: no .tmp left by a failed write
def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def _disk_full(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("op", ["put_bytes", "put_bytes_if_none_match", "put_file", "copy"])
def test_a_failed_local_write_leaves_no_tmp_file(tmp_path, monkeypatch, op):
    store = LocalStore(tmp_path / "store")
    store.put_bytes("a/src", b"old")
    store.put_bytes("a/dest", b"committed")
    src = tmp_path / "big"
    src.write_bytes(b"x" * (3 * 1024 * 1024))
    # the data is written, then the disk fills: fsync (put_*) / the copy's write fail mid-way
    monkeypatch.setattr(os, "fsync", _disk_full)
    real_copy = shutil.copyfileobj

    def half_copy(fsrc, fdst, length=0):
        fdst.write(fsrc.read(1024))
        _disk_full()

    monkeypatch.setattr(shutil, "copyfileobj", half_copy)
    with pytest.raises(OSError, match="No space left"):
        if op == "put_bytes":
            store.put_bytes("a/dest", b"new")
        elif op == "put_bytes_if_none_match":
            store.put_bytes("a/new", b"new", if_none_match=True)
        elif op == "put_file":
            store.put_file("a/dest", src)
        else:
            store.copy("a/src", "a/dest")
    monkeypatch.setattr(shutil, "copyfileobj", real_copy)
    assert _tmp_files(tmp_path / "store") == []
    assert store.get_bytes("a/dest") == b"committed" and not store.exists("a/new")
