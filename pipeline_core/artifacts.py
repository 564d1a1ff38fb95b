"""Immutable artifacts, committed atomically (DESIGN.md principle 2 and "Contracts").

An artifact is a prefix holding `_manifest.json` and a payload (`data/…`, optionally `rejects/…`).
Each publishing attempt uploads its payload under its own prefix `_attempts/<attempt>/` and then
commits the manifest, which names that prefix, with a conditional create: the manifest is the one
contended write. A losing writer (a zombie task and its retry, a backfill racing a manual run)
therefore never touches the bytes a committed manifest describes, and removes its own prefix.
Publishing the same content again is a no-op; different content under the same URI is refused.

Manifests are data from the store, never trusted as paths: every file path (and the payload
prefix) is checked to be a relative path without `..`, `.`, empty segments, backslashes or NUL
when a manifest is read, and a fetched file must resolve inside the destination directory.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_core import uris
from pipeline_core.config import PROJECT_ROOT, stable_hash
from pipeline_core.handoffs import Counts, FileEntry, StageCounts, UnbalancedCounts, read_counts
from pipeline_core.settings_loader import load_process_settings
from pipeline_core.store import (
    ChecksumMismatch,
    ObjectNotFound,
    PreconditionFailed,
    open_store,
    sha256_bytes,
    sha256_file,
)
from pipeline_core.uris import safe_relpath

if TYPE_CHECKING:
    from pipeline_core.config import StorageSection

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
LATEST = "LATEST"
MANIFEST_VERSION = 2  # 2: the payload lives under `payload` (an attempt prefix); 1: at the artifact root
ATTEMPTS = "_attempts"
READ_ATTEMPTS = 3  # a file whose bytes do not hash right is read again this often: a corrupt GET is transient


class ArtifactError(RuntimeError):
    pass


class ArtifactConflict(ArtifactError):
    """Different content was already committed under this URI."""


class CorruptArtifact(ArtifactError):
    """A file of a committed artifact is missing or does not match its manifest."""


class ArtifactNotFound(ArtifactError, FileNotFoundError):
    """No committed artifact (no manifest) at this URI."""


@dataclass(frozen=True)
class InputRef:
    """One entry of a manifest's `inputs`: an artifact it was made from, and which commit of it."""

    uri: str
    manifest_sha256: str
    kind: str | None = None  # not recorded by manifests written before kinds were


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
    payload: str = ""  # prefix of the files under the artifact, e.g. _attempts/<attempt>; "" for version 1
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
        if m.payload:
            safe_relpath(m.payload, "manifest payload")
        FileEntry.all_of(m)  # every entry typed: a path that could escape is refused here
        return m

    def input_refs(self) -> list[InputRef]:
        """`inputs` typed (readers compare or pick inputs through this, not by dict keys)."""
        try:
            return [InputRef(str(i["uri"]), str(i["manifest_sha256"]), i.get("kind")) for i in self.inputs]
        except (KeyError, TypeError, AttributeError) as e:
            raise CorruptArtifact(f"{self.uri}: an entry of the manifest's inputs lacks {e}") from None

    def input_of_kind(self, kind: str) -> InputRef | None:
        return next((i for i in self.input_refs() if i.kind == kind), None)

    def file_paths(self, prefix: str = "") -> list[str]:
        return [f.path for f in FileEntry.all_of(self, prefix)]

    def object_path(self, path: str) -> str:
        """Where the file `path` (as listed, e.g. data/part-0.parquet) lies under the artifact's prefix."""
        return f"{self.payload}/{path}" if self.payload else path


def file_uri(uri: str, manifest: Manifest, path: str) -> str:
    """The URI of a committed artifact's file, for readers that hand it to another tool (Spark)."""
    return uris.join(uri, manifest.object_path(path))


def new_attempt_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:12]


def content_hash(files: list[FileEntry]) -> str:
    return stable_hash(sorted((f.path, f.size, f.sha256) for f in files))


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The git commit of the code that made an artifact (MFT_CODE_VERSION wins, for images)."""
    if pinned := load_process_settings().code_version:
        return pinned
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


def _check_counts(counts: Counts | None) -> None:
    if isinstance(counts, StageCounts):
        try:
            counts.require_balanced()
        except UnbalancedCounts as e:
            raise ArtifactError(f"{e}; refusing to commit an artifact that lost records") from None


def read_manifest(uri: str, storage: StorageSection | None = None) -> Manifest | None:
    """The artifact's manifest, or None if the artifact is not committed."""
    store, key = open_store(uri, storage)
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            data = store.get_bytes(f"{key.rstrip('/')}/{MANIFEST}")
            break
        except ObjectNotFound:
            return None
        except ChecksumMismatch as e:
            if attempt == READ_ATTEMPTS:
                raise CorruptArtifact(f"{uris.join(uri, MANIFEST)}: {e}") from None
            log.warning("%s: read %d/%d did not verify; reading again", uris.join(uri, MANIFEST), attempt, READ_ATTEMPTS)
    try:
        return Manifest.from_json(data)
    except (ValueError, TypeError, KeyError) as e:
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
    counts: Counts | Mapping[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    storage: StorageSection | None = None,
    seal: Callable[[Manifest], dict[str, Any]] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> Manifest:
    """Upload every file under `local_dir` to `uri`, then commit `uri/_manifest.json`.

    `seal(manifest)` may add entries to `extra` once the manifest is complete (the trainer signs
    its checkpoints' whole manifest body with it). `before_commit()` runs right before the
    manifest's conditional create and may raise to stop it (the trainer's lease fence); the
    uploaded payload is then removed."""
    uri = uris.require_uri(uri, "artifact URI").rstrip("/")
    local_dir = Path(local_dir)
    counts = read_counts(counts)
    _check_counts(counts)
    store, key = open_store(uri, storage)
    key = key.rstrip("/")

    local_files = sorted(
        p for p in local_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith((".", "_SUCCESS")) and not p.name.endswith(".crc")
    )
    existing = read_manifest(uri, storage)
    if existing is not None:
        mine = [FileEntry(path=p.relative_to(local_dir).as_posix(), size=p.stat().st_size, sha256=sha256_file(p))
                for p in local_files]
        return _same_or_conflict(existing, content_hash(mine), uri)

    attempt = f"{ATTEMPTS}/{new_attempt_id()}"
    t0 = time.time()
    files = []
    try:
        for p in local_files:
            rel = p.relative_to(local_dir).as_posix()
            info = store.put_file(f"{key}/{attempt}/{rel}", p)
            files.append(FileEntry(path=rel, size=info.size, sha256=info.sha256))
    except BaseException:
        _drop_attempt(store, key, attempt)  # ours alone: nothing else names or writes it
        raise
    upload_s = time.time() - t0

    input_refs = []
    for in_uri in inputs:
        m = require_manifest(in_uri, storage)
        input_refs.append({"uri": in_uri, "manifest_sha256": m.sha256, "kind": m.kind})
    config = config or {}
    manifest = Manifest(
        uri=uri,
        kind=kind,
        files=[f.to_entry() for f in files],
        counts=counts.to_counts() if counts is not None else {},
        config=config,
        config_hash=stable_hash(config)[:12],
        inputs=input_refs,
        code_version=code_version(),
        content_sha256=content_hash(files),
        created_at=time.time(),
        timings={**(timings or {}), "upload_s": round(upload_s, 3)},
        extra=dict(extra or {}),
        payload=attempt,
    )
    if seal is not None:
        manifest.extra.update(seal(manifest))
    body = manifest.to_json()
    if before_commit is not None:
        try:
            before_commit()
        except BaseException:
            _drop_attempt(store, key, attempt)
            raise
    try:
        store.put_bytes(f"{key}/{MANIFEST}", body, if_none_match=True)
    except PreconditionFailed:
        other = read_manifest(uri, storage)
        if other is None:
            _drop_attempt(store, key, attempt)
            raise ArtifactError(f"{uri}: the manifest's conditional create failed but no manifest is there; retry") from None
        if other.payload == attempt:
            # our own write, whose response was lost and whose retry met itself: committed
            log.info("artifact %s: committed by this attempt (a retried request found it)", uri)
            return other
        # Another writer committed first: its payload is under its own prefix; ours goes.
        _drop_attempt(store, key, attempt)
        return _same_or_conflict(other, manifest.content_sha256, uri)
    manifest.sha256 = sha256_bytes(body)
    log.info("committed %s artifact %s: %d files, counts=%s", kind, uri, len(files), manifest.counts)
    return manifest


def _drop_attempt(store: Any, key: str, attempt: str) -> None:
    try:
        store.delete_prefix(f"{key}/{attempt}/")
    except Exception:  # best effort: an orphaned attempt prefix is garbage, never read
        log.warning("could not remove the uncommitted attempt %s/%s", key, attempt, exc_info=True)


def _same_or_conflict(existing: Manifest, content_sha: str, uri: str) -> Manifest:
    if existing.content_sha256 == content_sha:
        log.info("artifact %s already committed with the same content; nothing to do", uri)
        return existing
    raise ArtifactConflict(
        f"{uri} is already committed with different content (content_sha256 {existing.content_sha256} != "
        f"{content_sha}); artifacts are immutable: publish under a new version or config"
    )


def fetch_artifact(
    uri: str, local_dir: str | Path, storage: StorageSection | None = None, prefix: str = "",
    manifest: Manifest | None = None,
) -> Manifest:
    """Download the committed artifact's files under `prefix` into `local_dir`, verifying each
    file's size and sha256 against the manifest. Files already present and intact are kept.
    `manifest`: one the caller already read (and verified): used as is, the store's manifest is
    not read again (no window between a check of the manifest and the downloads it drives)."""
    manifest = require_manifest(uri, storage) if manifest is None else manifest
    store, key = open_store(uri, storage)
    key = key.rstrip("/")
    local_dir = Path(local_dir)
    root = local_dir.resolve()
    for f in FileEntry.all_of(manifest, prefix):
        dest = local_dir / f.path
        if not dest.resolve().is_relative_to(root):  # a symlink planted in local_dir
            raise CorruptArtifact(f"{uris.join(uri, MANIFEST)}: file {f.path!r} resolves outside {local_dir}")
        if dest.is_file() and dest.stat().st_size == f.size and sha256_file(dest) == f.sha256:
            continue
        _fetch_file(store, f"{key}/{manifest.object_path(f.path)}", dest, f, uris.join(uri, f.path))
    return manifest


def _fetch_file(store: Any, key: str, dest: Path, f: FileEntry, name: str) -> None:
    """One verified download (see `_verified_read`)."""
    _verified_read(lambda: (None, store.get_file(key, dest, expected_sha256=f.sha256).size), f, name)


def read_artifact_file(manifest: Manifest, path: str, storage: StorageSection | None = None) -> bytes:
    """The bytes of the committed artifact's file `path` (as the manifest lists it), verified like
    `fetch_artifact`'s files; FileNotFoundError when the manifest does not list `path`."""
    f = FileEntry.named(manifest, path)
    if f is None:
        raise FileNotFoundError(f"{path!r} is not a file of the committed artifact {manifest.uri}")
    store, key = open_store(manifest.uri, storage)
    key = f"{key.rstrip('/')}/{manifest.object_path(path)}"

    def get() -> tuple[bytes, int]:
        data = store.get_bytes(key, expected_sha256=f.sha256)
        return data, len(data)

    return _verified_read(get, f, uris.join(manifest.uri, path))


def _verified_read(get: Callable[[], tuple[Any, int]], f: FileEntry, name: str) -> Any:
    """`get()` (its value and the size it read) checked against the manifest entry `f`; a sha256
    mismatch is read again (a corrupted GET on the wire is transient, corrupt bytes at rest are not
    and fail every attempt)."""
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            value, size = get()
        except ObjectNotFound:
            raise CorruptArtifact(f"{name} is listed in the manifest but missing from the store") from None
        except ChecksumMismatch as e:
            if attempt == READ_ATTEMPTS:
                raise CorruptArtifact(f"{name} is corrupt ({READ_ATTEMPTS} reads): {e}") from None
            log.warning("%s: read %d/%d did not verify (%s); reading again", name, attempt, READ_ATTEMPTS, e)
            continue
        if size != f.size:
            raise CorruptArtifact(f"{name} is corrupt: size {size} != manifest's {f.size}")
        return value


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
