"""Object store: one interface, two backends (local directory, S3 through boto3).

Every object's sha256 is computed on write. The S3 backend stores it as object metadata
(`x-amz-meta-sha256`) and verifies it on every read, because S3-compatible servers differ in
whether they check `ChecksumSHA256` themselves. Callers that hold a manifest pass
`expected_sha256` and get the same check on both backends.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import logging
import os
import random
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from pipeline_core import uris

if TYPE_CHECKING:
    from pipeline_core.config import StorageSection

log = logging.getLogger(__name__)

CHUNK = 8 * 1024 * 1024
LOCK_SUFFIX = ".lock"
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class StoreError(RuntimeError):
    pass


class PreconditionFailed(StoreError):
    """A conditional write lost: the key already exists (create) or changed since it was read (replace)."""


class ChecksumMismatch(StoreError):
    """Bytes read do not hash to what was written."""


class ConditionalWritesIgnored(StoreError):
    """The server accepted a second create-if-absent of one key: it does not enforce If-None-Match."""


class ObjectNotFound(StoreError, FileNotFoundError):
    pass


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    sha256: str | None = None
    etag: str | None = None


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore(ABC):
    """Keys are '/'-separated paths relative to the store's root; `uri(key)` gives the full URI."""

    @abstractmethod
    def uri(self, key: str) -> str: ...

    @abstractmethod
    def put_file(self, key: str, path: str | Path, if_none_match: bool = False) -> ObjectInfo: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> ObjectInfo:
        """`if_none_match`: create only if absent. `if_match`: replace only if the object's current
        etag (from `get_versioned`) is still `if_match`. Either raises PreconditionFailed on losing."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and its etag, the token a later `put_bytes(if_match=...)` compares."""

    @abstractmethod
    def get_file(self, key: str, path: str | Path, expected_sha256: str | None = None) -> ObjectInfo: ...

    @abstractmethod
    def get_bytes(self, key: str, expected_sha256: str | None = None) -> bytes: ...

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None: ...

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Objects whose key starts with `prefix` (use a trailing '/' for a directory), sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def copy(self, src_key: str, dst_key: str) -> None:
        """Server-side copy (S3) / file copy (local) of one object."""

    def delete_prefix(self, prefix: str) -> int:
        objs = self.list(prefix)
        for o in objs:
            self.delete(o.key)
        return len(objs)

    def check_conditional_writes(self, near: str) -> None:
        """Raise `ConditionalWritesIgnored` if create-if-absent is not enforced (S3: probed once per
        process). A local directory's `link` always is."""
        return None

    def exists(self, key: str) -> bool:
        return self.head(key) is not None


def _check(key: str, got: str, expected: str | None) -> None:
    if expected is not None and got != expected:
        raise ChecksumMismatch(f"{key}: sha256 {got} does not match the expected {expected}; the object is corrupt")


# --------------------------------------------------------------------------------------------
class LocalStore(ObjectStore):
    """A directory on a local or shared file system. Writes go to a temporary file then `rename`,
    so a reader never sees a half-written object; conditional writes use `link`, which fails
    atomically when the target exists."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        key = key.lstrip("/")
        if key:
            uris.join("file:///x", key)  # rejects traversal
        return self.root / key

    def uri(self, key: str) -> str:
        return uris.qualify(self._path(key))

    def _commit(self, tmp: Path, dest: Path, key: str, if_none_match: bool) -> None:
        if if_none_match:
            try:
                os.link(tmp, dest)
            except FileExistsError:
                raise PreconditionFailed(f"{self.uri(key)} already exists") from None
            finally:
                tmp.unlink(missing_ok=True)
        else:
            os.replace(tmp, dest)

    def _tmp(self, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        os.chmod(name, 0o666 & ~_UMASK)  # mkstemp makes 0600; objects get ordinary file permissions
        return Path(name)

    @staticmethod
    def _write_tmp(tmp: Path, write: Callable[[BinaryIO], None]) -> None:
        """Fill `tmp`, durably; a failed write (disk full, an I/O error) removes it, so no `.tmp`
        file is left behind (issue 26.9c)."""
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: str | Path, if_none_match: bool = False) -> ObjectInfo:
        dest = self._path(key)
        tmp = self._tmp(dest)
        h = hashlib.sha256()

        def write(dst: BinaryIO) -> None:
            with open(path, "rb") as src:
                for chunk in iter(lambda: src.read(CHUNK), b""):
                    h.update(chunk)
                    dst.write(chunk)

        self._write_tmp(tmp, write)
        size = tmp.stat().st_size
        self._commit(tmp, dest, key, if_none_match)
        return ObjectInfo(key, size, h.hexdigest())

    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> ObjectInfo:
        dest = self._path(key)
        tmp = self._tmp(dest)
        self._write_tmp(tmp, lambda f: f.write(data))
        if if_match is None:
            self._commit(tmp, dest, key, if_none_match)
        else:
            self._replace_if(tmp, dest, key, if_match)
        return ObjectInfo(key, len(data), sha256_bytes(data), sha256_bytes(data))

    def _replace_if(self, tmp: Path, dest: Path, key: str, if_match: str) -> None:
        """Compare-and-swap under an exclusive lock on a sidecar file: the etag of a local object
        is its sha256, so the comparison and the rename happen as one step for every writer that
        uses this method (conditional creates use `link`, which cannot overwrite)."""
        lock = dest.with_name(f".{dest.name}{LOCK_SUFFIX}")
        with open(lock, "a") as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = sha256_file(dest) if dest.is_file() else None
                if current != if_match:
                    tmp.unlink(missing_ok=True)
                    raise PreconditionFailed(f"{self.uri(key)} changed since it was read (etag {current} != {if_match})")
                os.replace(tmp, dest)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.get_bytes(key)
        return data, sha256_bytes(data)

    def get_file(self, key: str, path: str | Path, expected_sha256: str | None = None) -> ObjectInfo:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFound(self.uri(key))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        h = hashlib.sha256()
        with open(src, "rb") as s, open(tmp, "wb") as d:
            for chunk in iter(lambda: s.read(CHUNK), b""):
                h.update(chunk)
                d.write(chunk)
        try:
            _check(self.uri(key), h.hexdigest(), expected_sha256)
        except ChecksumMismatch:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        return ObjectInfo(key, path.stat().st_size, h.hexdigest())

    def get_bytes(self, key: str, expected_sha256: str | None = None) -> bytes:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFound(self.uri(key))
        data = src.read_bytes()
        _check(self.uri(key), sha256_bytes(data), expected_sha256)
        return data

    def head(self, key: str) -> ObjectInfo | None:
        p = self._path(key)
        return ObjectInfo(key, p.stat().st_size) if p.is_file() else None

    def list(self, prefix: str) -> list[ObjectInfo]:
        prefix = prefix.lstrip("/")
        base = self._path(prefix.rpartition("/")[0])
        if not base.is_dir():
            return []
        out = []
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.startswith(".") and f.endswith((".tmp", LOCK_SUFFIX)):
                    continue  # an in-flight write, or the lock of a conditional replace
                p = Path(dirpath) / f
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(ObjectInfo(key, p.stat().st_size))
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def copy(self, src_key: str, dst_key: str) -> None:
        src = self._path(src_key)
        if not src.is_file():
            raise ObjectNotFound(self.uri(src_key))
        dest = self._path(dst_key)
        tmp = self._tmp(dest)

        def write(dst: BinaryIO) -> None:
            with open(src, "rb") as f:
                shutil.copyfileobj(f, dst, CHUNK)

        self._write_tmp(tmp, write)
        os.replace(tmp, dest)

    def delete_prefix(self, prefix: str) -> int:
        n = super().delete_prefix(prefix)
        d = self._path(prefix)
        if prefix.endswith("/") and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        return n


# --------------------------------------------------------------------------------------------
# (endpoint, bucket, pid) -> the store enforces If-None-Match. Per process on purpose: the probe
# costs three requests and its answer is a property of the server, not of a call.
_CONDITIONAL_WRITES: dict[tuple[str, str, int], bool] = {}
PROBE_PREFIX = ".mft-conditional-write-probe-"


class S3Store(ObjectStore):
    """One bucket of an S3-compatible server (AWS, MinIO, moto...)."""

    def __init__(self, bucket: str, client: Any, transfer_config: Any, multipart_threshold: int, max_attempts: int = 8,
                 accept_unenforced_conditional_writes: bool = False):
        self.bucket = bucket
        self.client = client
        self.transfer_config = transfer_config
        self.multipart_threshold = multipart_threshold
        self.max_attempts = max_attempts
        self.accept_unenforced = accept_unenforced_conditional_writes

    def check_conditional_writes(self, near: str) -> None:
        """Before this process's first conditional write to the bucket: create a scratch key twice
        with If-None-Match; the second must fail (412). A server that ignores the header would let
        two writers both commit a lease, a manifest or a LATEST step (issue 26.8c)."""
        ident = (str(self.client.meta.endpoint_url), self.bucket, os.getpid())
        if ident in _CONDITIONAL_WRITES:
            enforced = _CONDITIONAL_WRITES[ident]
        else:
            # next to the key about to be written: a prefix-scoped credential may write only there
            parent = near.rpartition("/")[0]
            key = f"{parent + '/' if parent else ''}{PROBE_PREFIX}{os.getpid()}-{random.getrandbits(64):016x}"
            self._put_if(key, b"1", sha256_bytes(b"1"), 1)
            try:
                self._put_if(key, b"2", sha256_bytes(b"2"), 1)
                enforced = False
            except PreconditionFailed:
                enforced = True
            finally:
                self.client.delete_object(Bucket=self.bucket, Key=key)
            _CONDITIONAL_WRITES[ident] = enforced
        if enforced:
            return
        msg = (f"s3://{self.bucket} at {ident[0]} accepted a second create-if-absent (If-None-Match: *) of one key: "
               "it does not enforce conditional writes, so two writers could both commit a lease, a manifest or a "
               "models/LATEST step")
        if not self.accept_unenforced:
            raise ConditionalWritesIgnored(f"{msg}. Use a store (or proxy) that passes If-None-Match on, or set "
                                           "storage.accept_unenforced_conditional_writes: true to run with that risk")
        log.warning("%s; running anyway (storage.accept_unenforced_conditional_writes)", msg)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def _err_code(self, e: Exception) -> str:
        return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))

    def _conditional_put(self, key: str, body: Any, sha: str, size: int, if_match: str | None = None) -> ObjectInfo:
        self.check_conditional_writes(key)
        return self._put_if(key, body, sha, size, if_match)

    def _put_if(self, key: str, body: Any, sha: str, size: int, if_match: str | None = None) -> ObjectInfo:
        """One conditional PUT. 412 means another writer won. 409 ConditionalRequestConflict means a
        concurrent conditional write on the same key was in flight: the outcome is unknown, so the
        request is retried (with backoff, up to storage.max_attempts) instead of being read as a loss."""
        from botocore.exceptions import ClientError

        cond = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": if_match}
        for attempt in range(1, self.max_attempts + 1):
            if hasattr(body, "seek"):
                body.seek(0)
            try:
                r = self.client.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata={"sha256": sha}, **cond)
            except ClientError as e:
                code = self._err_code(e)
                if code in ("PreconditionFailed", "412"):
                    what = "already exists" if if_match is None else f"changed since it was read (etag {if_match})"
                    raise PreconditionFailed(f"{self.uri(key)} {what}") from None
                if code in ("ConditionalRequestConflict", "409") and attempt < self.max_attempts:
                    delay = min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())
                    log.warning("%s: 409 %s (attempt %d/%d); retrying in %.2f s",
                                self.uri(key), code, attempt, self.max_attempts, delay)
                    time.sleep(delay)
                    continue
                if code == "NoSuchKey" and if_match is not None:
                    raise PreconditionFailed(f"{self.uri(key)} no longer exists (expected etag {if_match})") from None
                raise
            return ObjectInfo(key, size, sha, r.get("ETag"))
        raise AssertionError("unreachable")  # the loop returns or raises

    def put_file(self, key: str, path: str | Path, if_none_match: bool = False) -> ObjectInfo:
        sha = sha256_file(path)
        size = os.path.getsize(path)
        if if_none_match:
            # Conditional writes need a single PUT; they are for small control objects.
            with open(path, "rb") as f:
                return self._conditional_put(key, f, sha, size)
        self.client.upload_file(
            str(path), self.bucket, key, ExtraArgs={"Metadata": {"sha256": sha}}, Config=self.transfer_config
        )
        return ObjectInfo(key, size, sha)

    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> ObjectInfo:
        sha = sha256_bytes(data)
        if if_none_match or if_match is not None:
            return self._conditional_put(key, data, sha, len(data), if_match=if_match)
        if len(data) >= self.multipart_threshold:
            self.client.upload_fileobj(
                io.BytesIO(data), self.bucket, key, ExtraArgs={"Metadata": {"sha256": sha}}, Config=self.transfer_config
            )
            return ObjectInfo(key, len(data), sha)
        r = self.client.put_object(Bucket=self.bucket, Key=key, Body=data, Metadata={"sha256": sha})
        return ObjectInfo(key, len(data), sha, r.get("ETag"))

    def _stored_sha(self, key: str) -> str | None:
        info = self.head(key)
        if info is None:
            raise ObjectNotFound(self.uri(key))
        return info.sha256

    def get_file(self, key: str, path: str | Path, expected_sha256: str | None = None) -> ObjectInfo:
        stored = self._stored_sha(key)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        self.client.download_file(self.bucket, key, str(tmp), Config=self.transfer_config)
        got = sha256_file(tmp)
        try:
            _check(self.uri(key), got, stored)
            _check(self.uri(key), got, expected_sha256)
        except ChecksumMismatch:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        return ObjectInfo(key, path.stat().st_size, got)

    def _get(self, key: str, expected_sha256: str | None) -> tuple[bytes, str]:
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if self._err_code(e) in ("NoSuchKey", "404"):
                raise ObjectNotFound(self.uri(key)) from None
            raise
        data = r["Body"].read()
        got = sha256_bytes(data)
        _check(self.uri(key), got, r.get("Metadata", {}).get("sha256"))
        _check(self.uri(key), got, expected_sha256)
        return data, r.get("ETag", "")

    def get_bytes(self, key: str, expected_sha256: str | None = None) -> bytes:
        return self._get(key, expected_sha256)[0]

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        return self._get(key, None)

    def head(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import ClientError

        try:
            r = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if self._err_code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return ObjectInfo(key, r["ContentLength"], r.get("Metadata", {}).get("sha256"), r.get("ETag"))

    def list(self, prefix: str) -> list[ObjectInfo]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out.append(ObjectInfo(o["Key"], o["Size"], None, o.get("ETag")))
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def copy(self, src_key: str, dst_key: str) -> None:
        sha = self._stored_sha(src_key)
        self.client.copy({"Bucket": self.bucket, "Key": src_key}, self.bucket, dst_key,
                         ExtraArgs={"Metadata": {"sha256": sha or ""}, "MetadataDirective": "REPLACE"},
                         Config=self.transfer_config)

    def delete_prefix(self, prefix: str) -> int:
        keys = [o.key for o in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        return len(keys)


_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
# Files a long-lived container's credentials are rotated through (a mounted Kubernetes/Docker secret,
# a web-identity token): a new mtime means new credentials, so it is part of the client cache key.
_CREDENTIAL_FILES = ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE")


def _mtime(path: str | None) -> float | None:
    try:
        return os.stat(path).st_mtime if path else None
    except OSError:
        return None


def credentials_key(storage: StorageSection) -> tuple[object, ...]:
    """What the cached client's credentials depend on. Nothing is frozen for longer than
    `storage.credentials_refresh_s`: boto3 refreshes role / web-identity / container credentials by
    itself, but static keys read from the environment, a profile or an Airflow connection are read
    once per client, so clients are rebuilt when those change and at least every refresh period."""
    epoch = int(time.time() // storage.credentials_refresh_s) if storage.credentials_refresh_s else 0
    files = tuple(_mtime(os.environ.get(k)) for k in _CREDENTIAL_FILES)
    # The pid keeps a forked child (Spark worker, launcher) from reusing its parent's sockets.
    return (os.getpid(), epoch, files, *(os.environ.get(k) for k in _CREDENTIAL_ENV))


def s3_client(storage: StorageSection | None) -> tuple[Any, Any]:
    """A boto3 S3 client and TransferConfig from the storage section, reused across calls with the
    same settings and credentials (building one costs ~50 ms; clients are thread-safe)."""
    from pipeline_core.config import StorageSection

    storage = storage or StorageSection()
    return _cached_s3_client(storage.model_dump_json(), credentials_key(storage))


@functools.lru_cache(maxsize=16)
def _cached_s3_client(storage_json: str, _key: tuple[object, ...]) -> tuple[Any, Any]:
    """Credentials come from the Airflow connection `aws_conn_id` when set, else from boto3's usual
    chain (environment, profile, instance role); `_key` is part of the cache key only."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config as BotoConfig

    from pipeline_core.config import StorageSection

    storage = StorageSection.model_validate_json(storage_json)
    session = boto3.session.Session()
    endpoint = storage.endpoint_url
    if storage.aws_conn_id:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

        hook = AwsBaseHook(aws_conn_id=storage.aws_conn_id, client_type="s3")
        session = hook.get_session()
        endpoint = endpoint or hook.conn_config.endpoint_url
    boto_cfg = BotoConfig(
        region_name=storage.region,
        s3={"addressing_style": storage.addressing_style},
        retries={"total_max_attempts": storage.max_attempts, "mode": "standard"},
        connect_timeout=storage.connect_timeout_s,
        read_timeout=storage.read_timeout_s,
        # Checksums only where the operation requires them: several S3-compatible servers reject
        # the newer default trailing checksums; we verify sha256 ourselves.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    client = session.client("s3", endpoint_url=endpoint, config=boto_cfg)
    mb = 1024 * 1024
    transfer = TransferConfig(
        multipart_threshold=storage.multipart_threshold_mb * mb,
        multipart_chunksize=storage.multipart_chunksize_mb * mb,
        max_concurrency=storage.max_concurrency,
    )
    return client, transfer


def require_conditional_writes(uri: str, storage: StorageSection | None = None) -> None:
    """Refuse a store that ignores If-None-Match before any work for `uri` starts (issue 26.8c)."""
    store, key = open_store(uri, storage)
    store.check_conditional_writes(key.rstrip("/") + "/")


def open_store(uri: str, storage: StorageSection | None = None) -> tuple[ObjectStore, str]:
    """The store holding `uri`, and the key of `uri` inside it."""
    uri = uris.require_uri(uri, "store URI")
    scheme = uris.scheme_of(uri)
    if scheme == "file":
        path = uris.to_local_path(uri)
        return LocalStore("/"), path.as_posix().lstrip("/")
    if scheme == "s3":
        bucket, key = uris.split_bucket_key(uri)
        client, transfer = s3_client(storage)
        threshold = (storage.multipart_threshold_mb if storage else 64) * 1024 * 1024
        return S3Store(bucket, client, transfer, threshold, storage.max_attempts if storage else 8,
                       storage.accept_unenforced_conditional_writes if storage else False), key
    raise ValueError(f"{uri!r}: the object store supports file:// and s3:// (hdfs:// is for Spark paths only)")
