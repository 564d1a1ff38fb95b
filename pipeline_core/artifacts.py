"""Immutable artifacts, committed atomically (DESIGN.md principle 2 and "Contracts").

An artifact is a prefix holding `data/…`, optionally `rejects/…`, and `_manifest.json`. The data
files are uploaded first, the manifest last with a conditional write: an artifact exists for
readers only once its manifest does, so a crash part-way leaves nothing visible. Publishing the
same content again is a no-op; publishing different content under the same URI is refused.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_core import uris
from pipeline_core.config import PROJECT_ROOT, stable_hash
from pipeline_core.store import (
    ChecksumMismatch,
    ObjectNotFound,
    PreconditionFailed,
    open_store,
    sha256_bytes,
    sha256_file,
)

if TYPE_CHECKING:
    from pipeline_core.config import StorageSection

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
LATEST = "LATEST"
MANIFEST_VERSION = 1


class ArtifactError(RuntimeError):
    pass


class ArtifactConflict(ArtifactError):
    """Different content was already committed under this URI."""


class CorruptArtifact(ArtifactError):
    """A file of a committed artifact is missing or does not match its manifest."""


class ArtifactNotFound(ArtifactError, FileNotFoundError):
    """No committed artifact (no manifest) at this URI."""


@dataclass
class Manifest:
    uri: str
    kind: str
    files: list[dict[str, Any]]
    counts: dict[str, Any]
    config: dict[str, Any]
    config_hash: str
    inputs: list[dict[str, str]]
    code_version: str
    content_sha256: str
    created_at: float
    timings: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    manifest_version: int = MANIFEST_VERSION
    sha256: str = ""  # hash of the manifest's own bytes as stored; not serialised

    def to_json(self) -> bytes:
        d = {k: v for k, v in self.__dict__.items() if k != "sha256"}
        return json.dumps(d, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        d = json.loads(data)
        d.pop("sha256", None)
        m = cls(**d)
        m.sha256 = sha256_bytes(data)
        return m

    def file_paths(self, prefix: str = "") -> list[str]:
        return [f["path"] for f in self.files if f["path"].startswith(prefix)]


def content_hash(files: list[dict[str, Any]]) -> str:
    return stable_hash(sorted((f["path"], f["size"], f["sha256"]) for f in files))


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The git commit of the code that made an artifact (MFT_CODE_VERSION wins, for images)."""
    if os.environ.get("MFT_CODE_VERSION"):
        return os.environ["MFT_CODE_VERSION"]
    try:
        sha = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _check_counts(counts: dict[str, Any]) -> None:
    if {"in", "out"} <= counts.keys():
        rejected = sum(int(v) for v in counts.get("rejected", {}).values())
        if int(counts["in"]) != int(counts["out"]) + rejected:
            raise ArtifactError(
                f"row counts do not add up: in={counts['in']} != out={counts['out']} + rejected={rejected}; "
                "refusing to commit an artifact that lost records"
            )


def read_manifest(uri: str, storage: StorageSection | None = None) -> Manifest | None:
    """The artifact's manifest, or None if the artifact is not committed."""
    store, key = open_store(uri, storage)
    try:
        data = store.get_bytes(f"{key.rstrip('/')}/{MANIFEST}")
    except ObjectNotFound:
        return None
    except ChecksumMismatch as e:
        raise CorruptArtifact(f"{uris.join(uri, MANIFEST)}: {e}") from None
    try:
        return Manifest.from_json(data)
    except (ValueError, TypeError) as e:
        raise CorruptArtifact(f"{uris.join(uri, MANIFEST)} is not a valid manifest: {e}") from None


def require_manifest(uri: str, storage: StorageSection | None = None, kind: str | None = None) -> Manifest:
    m = read_manifest(uri, storage)
    if m is None:
        raise ArtifactNotFound(f"no committed artifact at {uri} (no {MANIFEST}); run the stage that produces it first")
    if kind is not None and m.kind != kind:
        raise ArtifactError(f"{uri} is a {m.kind!r} artifact, expected {kind!r}")
    return m


def publish_artifact(
    local_dir: str | Path,
    uri: str,
    *,
    kind: str,
    config: dict[str, Any] | None = None,
    inputs: list[str] | tuple[str, ...] = (),
    counts: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    storage: StorageSection | None = None,
) -> Manifest:
    """Upload every file under `local_dir` to `uri`, then commit `uri/_manifest.json`."""
    uri = uris.require_uri(uri, "artifact URI").rstrip("/")
    local_dir = Path(local_dir)
    counts = counts or {}
    _check_counts(counts)
    store, key = open_store(uri, storage)
    key = key.rstrip("/")

    local_files = sorted(
        p for p in local_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith((".", "_SUCCESS")) and not p.name.endswith(".crc")
    )
    existing = read_manifest(uri, storage)
    if existing is not None:
        mine = [{"path": p.relative_to(local_dir).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in local_files]
        return _same_or_conflict(existing, content_hash(mine), uri)

    t0 = time.time()
    files = []
    for p in local_files:
        rel = p.relative_to(local_dir).as_posix()
        info = store.put_file(f"{key}/{rel}", p)
        files.append({"path": rel, "size": info.size, "sha256": info.sha256})
    upload_s = time.time() - t0

    input_refs = []
    for in_uri in inputs:
        m = require_manifest(in_uri, storage)
        input_refs.append({"uri": in_uri, "manifest_sha256": m.sha256, "kind": m.kind})
    config = config or {}
    manifest = Manifest(
        uri=uri,
        kind=kind,
        files=files,
        counts=counts,
        config=config,
        config_hash=stable_hash(config)[:12],
        inputs=input_refs,
        code_version=code_version(),
        content_sha256=content_hash(files),
        created_at=time.time(),
        timings={**(timings or {}), "upload_s": round(upload_s, 3)},
        extra=extra or {},
    )
    body = manifest.to_json()
    try:
        store.put_bytes(f"{key}/{MANIFEST}", body, if_none_match=True)
    except PreconditionFailed:
        # Another writer committed first: fine if it committed the same content.
        other = read_manifest(uri, storage)
        if other is None:  # the store said "exists" yet serves nothing: not something to paper over
            raise ArtifactError(f"{uris.join(uri, MANIFEST)}: the conditional write was refused as existing, "
                                "but no manifest can be read back; check the store's consistency") from None
        return _same_or_conflict(other, manifest.content_sha256, uri)
    manifest.sha256 = sha256_bytes(body)
    log.info("committed %s artifact %s: %d files, counts=%s", kind, uri, len(files), counts)
    return manifest


def _same_or_conflict(existing: Manifest, content_sha: str, uri: str) -> Manifest:
    if existing.content_sha256 == content_sha:
        log.info("artifact %s already committed with the same content; nothing to do", uri)
        return existing
    raise ArtifactConflict(
        f"{uri} is already committed with different content (content_sha256 {existing.content_sha256} != "
        f"{content_sha}); artifacts are immutable: publish under a new version or config"
    )


def fetch_artifact(
    uri: str, local_dir: str | Path, storage: StorageSection | None = None, prefix: str = ""
) -> Manifest:
    """Download the committed artifact's files under `prefix` into `local_dir`, verifying each
    file's size and sha256 against the manifest. Files already present and intact are kept."""
    manifest = require_manifest(uri, storage)
    store, key = open_store(uri, storage)
    key = key.rstrip("/")
    local_dir = Path(local_dir)
    for f in manifest.files:
        if not f["path"].startswith(prefix):
            continue
        dest = local_dir / f["path"]
        if dest.is_file() and dest.stat().st_size == f["size"] and sha256_file(dest) == f["sha256"]:
            continue
        name = uris.join(uri, f["path"])
        try:
            info = store.get_file(f"{key}/{f['path']}", dest, expected_sha256=f["sha256"])
        except ObjectNotFound:
            raise CorruptArtifact(f"{name} is listed in the manifest but missing from the store") from None
        except ChecksumMismatch as e:
            raise CorruptArtifact(f"{name} is corrupt: {e}") from None
        if info.size != f["size"]:
            raise CorruptArtifact(f"{name} is corrupt: size {info.size} != manifest's {f['size']}")
    return manifest


def verify_artifact(uri: str, storage: StorageSection | None = None) -> Manifest:
    """Check every file of a committed artifact without keeping a copy."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        return fetch_artifact(uri, tmp, storage)


def write_latest(prefix_uri: str, target_uri: str, storage: StorageSection | None = None, replace: bool = False) -> None:
    """Point `prefix_uri/LATEST` at a committed artifact, written after the target's manifest.

    `replace=False` is a conditional create: of several writers racing, exactly one wins and the
    others get `PreconditionFailed` (unless they point at the same target). `replace=True` moves
    an existing pointer forward; use it where one writer owns the sequence (a run's checkpoints).
    """
    target = require_manifest(target_uri, storage)
    store, key = open_store(prefix_uri, storage)
    body = json.dumps({"target": target_uri.rstrip("/"), "manifest_sha256": target.sha256}, sort_keys=True).encode()
    try:
        store.put_bytes(f"{key.rstrip('/')}/{LATEST}", body, if_none_match=not replace)
    except PreconditionFailed:
        if read_latest(prefix_uri, storage) == target_uri.rstrip("/"):
            return
        raise


def read_latest(prefix_uri: str, storage: StorageSection | None = None) -> str | None:
    """The URI that `prefix_uri/LATEST` points at, or None."""
    store, key = open_store(prefix_uri, storage)
    try:
        data = store.get_bytes(f"{key.rstrip('/')}/{LATEST}")
    except ObjectNotFound:
        return None
    return json.loads(data)["target"]
