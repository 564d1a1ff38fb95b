"""Checkpoints in the object store: background push, LATEST, keep-last-K, verified resume.

A checkpoint is an artifact `<run>/checkpoints/step-N/` whose `data/` is the DeepSpeed tag
directory (every rank's model/optimizer files plus per-rank RNG state). What survives what
(docs/reliability.md):

- Pushes run on one background thread with a bounded queue, each retried with backoff; after
  `train.max_failed_pushes` consecutive failures the next save point raises `PushFailed` - while
  training state is still in memory and on local disk, not after eval and export. A local
  `.pending.json` beside each saved checkpoint says it is not pushed yet; the next attempt pushes
  every pending one before it resumes, and a local copy is deleted only once its push committed.
- Every write to the run (push, LATEST, prune, quarantine) first checks the run lease
  (training/lease.py): the moment it is lost, the uploader and pruner stop.
- Resume reads the newest committed checkpoint. A file that does not verify is read again
  (artifacts.READ_ATTEMPTS); a checkpoint that still does not verify is moved to
  `<run>/quarantine/step-N/<time>/`, never deleted. Partial uploads (no manifest) are removed.
- Resume refuses a checkpoint whose training content settings or input differ from this run's
  (naming each difference) unless `train.resume_across_changes` is set.
- DeepSpeed's own files are `torch.load`ed with `weights_only=False` by DeepSpeed, so a checkpoint
  is loaded only if its manifest carries an HMAC-SHA256 signature, made with a key that never
  goes to the store, over the checkpoint's URI and the whole canonical manifest body (every
  file's path, size and sha256, the payload prefix, step, config, inputs: `signed_body`). The
  manifest is read once; that verified record drives the downloads, each file checked against its
  signed sha256. RNG state is saved as plain tensors and loaded with `weights_only=True`.
- A checkpoint's manifest is committed only after the lease's fence (a conditional write on the
  lease, training/lease.py); a conflicting commit of the same step is quarantined by the holder,
  or (an earlier attempt's unpushed copy) moved aside locally - never an endless conflict.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import random
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline_core import layout, uris
from pipeline_core.artifacts import (
    MANIFEST,
    ArtifactConflict,
    ArtifactError,
    Manifest,
    fetch_artifact,
    publish_artifact,
    read_manifest,
    write_latest,
)
from pipeline_core.config import TrainSection
from pipeline_core.settings_loader import ProcessSettings, load_process_settings
from pipeline_core.store import open_store

log = logging.getLogger(__name__)

KIND = "checkpoint"
TAG = "data"  # DeepSpeed tag == the artifact's payload directory
PENDING = ".pending.json"  # beside a saved, not yet committed checkpoint (dot: never uploaded)
QUARANTINE = "quarantine"
HMAC_KEY_ENV = ProcessSettings.env_name("checkpoint_hmac_key")  # MFT_CHECKPOINT_HMAC_KEY
HMAC_KEY_FILE_ENV = ProcessSettings.env_name("checkpoint_hmac_key_file")  # MFT_CHECKPOINT_HMAC_KEY_FILE
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    pass


class PushFailed(CheckpointError):
    """Checkpoints could not be pushed `max_failed_pushes` times in a row."""


class ResumeRefused(CheckpointError):
    """The run's newest checkpoint was made with other content settings or another input."""


class CheckpointUntrusted(CheckpointError):
    """A checkpoint's signature does not verify with this deployment's key."""


def rng_path(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rng_rank{rank:05d}.pt"


# ----------------------------------------------------------------------------- RNG as tensors
def rng_state() -> dict[str, torch.Tensor]:
    """Every generator's state as tensors only, so it loads with `weights_only=True`."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    if np_name != "MT19937":  # numpy's legacy global generator is the only one saved
        raise RuntimeError(f"numpy global generator is {np_name!r}, expected MT19937")
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos_gauss": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_version_gauss": torch.tensor([py_version, py_gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([py_gauss or 0.0], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    pos, has_gauss = (int(v) for v in state["numpy_pos_gauss"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_gauss"][0])))
    version, has_py_gauss = (int(v) for v in state["python_version_gauss"])
    random.setstate((version, tuple(int(v) for v in state["python_state"]),
                     float(state["python_gauss"][0]) if has_py_gauss else None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(tag_dir: Path, rank: int, state: dict[str, torch.Tensor] | None = None) -> None:
    """``state``: generators captured earlier (async saves capture at the save point, write later).
    Written to a temporary name and renamed: the file is also the rank's completion marker."""
    path = rng_path(tag_dir, rank)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(rng_state() if state is None else state, tmp)
    os.replace(tmp, path)


def load_rng(tag_dir: Path, rank: int) -> None:
    """Restore this rank's generators; the file is data (weights_only=True refuses pickled code)."""
    set_rng_state(torch.load(rng_path(tag_dir, rank), weights_only=True))


def wait_for_all_ranks(local_dir: Path, world_size: int, timeout_s: float, poll_s: float = 0.2) -> None:
    """Async saves: every rank's writer writes its RNG file last; wait until all are there (each
    rank writes into the same directory, see check_all_ranks), then check as a synchronous save does."""
    deadline = time.monotonic() + timeout_s
    while not all(rng_path(local_dir / TAG, r).is_file() for r in range(world_size)):
        if time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    check_all_ranks(local_dir, world_size)


def check_all_ranks(local_dir: Path, world_size: int) -> None:
    """Every rank's files must be in the checkpoint directory rank 0 publishes. On several nodes
    that needs `pipeline.staging_uri` on a file system they share: say so instead of pushing a
    checkpoint that only holds node 0's files."""
    missing = [r for r in range(world_size) if not rng_path(local_dir / TAG, r).is_file()]
    if missing:
        raise CheckpointError(
            f"checkpoint {local_dir}: files of rank(s) {missing[:8]} are not there, though every rank saved; "
            "on several nodes pipeline.staging_uri must be a file system all nodes share (NFS, Lustre, EFS)"
        )


# ----------------------------------------------------------------------------- signing
def hmac_key(staging_root: str) -> bytes:
    """The checkpoint signing key, kept outside the store: MFT_CHECKPOINT_HMAC_KEY, else the file
    MFT_CHECKPOINT_HMAC_KEY_FILE, else `<pipeline.staging_uri>/.keys/checkpoint-hmac.key` (created
    on first use, mode 0600; the staging file system is shared by a run's attempts)."""
    process = load_process_settings()
    if process.checkpoint_hmac_key is not None:
        return process.checkpoint_hmac_key.get_secret_value().encode()
    path = Path(process.checkpoint_hmac_key_file or uris.to_local_path(uris.join(staging_root, ".keys",
                                                                                 "checkpoint-hmac.key")))
    if not path.is_file():
        if process.checkpoint_hmac_key_file:
            raise CheckpointError(f"{HMAC_KEY_FILE_ENV}={path}: no such file")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process created it first
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            log.warning("created the checkpoint signing key %s (set %s or %s to share one across machines)",
                        path, HMAC_KEY_ENV, HMAC_KEY_FILE_ENV)
    key = path.read_bytes().strip()
    if len(key) < 16:
        raise CheckpointError(f"checkpoint signing key {path} is shorter than 16 bytes")
    return key


SIGNED_AS = "mft-checkpoint-manifest-v2"  # what the HMAC covers: see signed_body


def signed_body(uri: str, manifest: Manifest) -> bytes:
    """The bytes a checkpoint's signature covers: the checkpoint URI it was committed at and the
    canonical JSON of its whole manifest except the signature itself - every file's path, size and
    sha256, the payload prefix, the step and data position, config, inputs. Whatever a resume uses
    from the manifest is in here, so nothing that drives a download or a load can be rewritten."""
    body = {k: v for k, v in manifest.__dict__.items() if k != "sha256"}
    body["extra"] = {k: v for k, v in (manifest.extra or {}).items() if k != "signature"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"{SIGNED_AS}\n{uri.rstrip('/')}\n{canonical}".encode()


def signature(key: bytes, uri: str, manifest: Manifest) -> str:
    return hmac.new(key, signed_body(uri, manifest), hashlib.sha256).hexdigest()


def verify_signature(key: bytes, uri: str, manifest: Manifest) -> None:
    got = (manifest.extra or {}).get("signature")
    if not isinstance(got, str) or not hmac.compare_digest(got, signature(key, uri, manifest)):
        raise CheckpointUntrusted(
            f"checkpoint {uri}: its manifest signature {'is missing' if got is None else 'does not verify'}; "
            "DeepSpeed would unpickle its files, so it is not loaded. Either its manifest was changed after it "
            "was signed (files, hashes, payload prefix, step), it was written by someone without the signing key, "
            f"or this trainer has another key ({HMAC_KEY_ENV} / {HMAC_KEY_FILE_ENV} / the key file under "
            "pipeline.staging_uri/.keys): give the trainer the key that signed the run's checkpoints. Checkpoints "
            f"signed before {SIGNED_AS} (the signature covered only the content hash) are refused too"
        )


def check_local_copy(dest: Path, manifest: Manifest) -> None:
    """The downloaded checkpoint directory holds exactly the manifest's files (each was checked
    against its signed sha256 on download): anything else there (left by an earlier partial
    download, planted) is removed before DeepSpeed globs the directory."""
    listed = {dest / p for p in manifest.file_paths()}
    for p in sorted(dest.rglob("*"), reverse=True):
        if (p.is_file() or p.is_symlink()) and p not in listed:
            log.warning("removing %s from the checkpoint copy: not a file of its signed manifest", p)
            p.unlink()
    missing = [str(p) for p in listed if not p.is_file() or p.is_symlink()]
    if missing:
        raise CheckpointError(f"checkpoint copy {dest}: files of the manifest missing after download: {missing[:5]}")


# ----------------------------------------------------------------------------- what a checkpoint was made from
@dataclass(frozen=True)
class ResumeContract:
    """What a checkpoint must have been made from for this run to continue it."""

    train: dict[str, Any]  # the train section's content settings
    inputs: list[dict[str, str]]  # [{"uri", "manifest_sha256"}]
    allow_changes: bool = False

    @classmethod
    def of(cls, config: dict[str, Any], inputs: list[dict[str, str]], allow_changes: bool) -> ResumeContract:
        return cls(layout.train_content_settings(config.get("train") or {}),
                   [{"uri": i["uri"], "manifest_sha256": i["manifest_sha256"]} for i in inputs], allow_changes)

    def differences(self, manifest: Manifest) -> list[str]:
        # A field this code added after the checkpoint was written reads as its default: an upgrade
        # that adds a setting is not a change of what the run computes.
        theirs = {**layout.train_content_settings(TrainSection().model_dump(mode="json")),
                  **layout.train_content_settings((manifest.config or {}).get("train") or {})}
        diffs = [f"train.{k}: checkpoint {theirs.get(k)!r}, this run {self.train.get(k)!r}"
                 for k in sorted(set(theirs) | set(self.train)) if theirs.get(k) != self.train.get(k)]
        ckpt_inputs = [{"uri": i.uri, "manifest_sha256": i.manifest_sha256} for i in manifest.input_refs()]
        if ckpt_inputs != self.inputs:
            diffs.append(f"input: checkpoint trained on {_describe(ckpt_inputs)}, this run on {_describe(self.inputs)}")
        return diffs


def resume_contract(config: dict[str, Any], input_uri: str, storage, allow_changes: bool) -> ResumeContract:
    from pipeline_core.artifacts import require_manifest

    m = require_manifest(input_uri, storage)
    return ResumeContract.of(config, [{"uri": input_uri, "manifest_sha256": m.sha256}], allow_changes)


def _describe(inputs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{i['uri']} (manifest {str(i['manifest_sha256'])[:12]})" for i in inputs) or "nothing"


# ----------------------------------------------------------------------------- store side
def store_steps(run_uri: str, storage) -> list[int]:
    """Step numbers that have any object under checkpoints/ (committed or not), newest first."""
    prefix = layout.checkpoints_uri(run_uri)
    store, key = open_store(prefix, storage)
    steps = set()
    for info in store.list(key.rstrip("/") + "/"):
        first = info.key[len(key.rstrip("/")) + 1:].split("/", 1)[0]
        m = _STEP_RE.match(first)
        if m:
            steps.add(int(m.group(1)))
    return sorted(steps, reverse=True)


@dataclass
class Restored:
    step: int
    local_dir: Path  # contains TAG/
    uri: str


def _check_lease(lease) -> None:
    if lease is not None:
        lease.check()


def _fence(lease) -> Callable[[], None] | None:
    """What runs right before a checkpoint's manifest commit: the lease's conditional renewal."""
    return None if lease is None else lease.fence


def fetch_newest_valid(run_uri: str, storage, local_root: Path, *, contract: ResumeContract | None = None,
                       key: bytes | None = None, lease=None) -> Restored | None:
    """Download the newest committed checkpoint that verifies into local_root/step-N; None if none.

    Newer checkpoints that do not verify are quarantined (moved aside, never deleted); partial
    uploads are removed. Raises ResumeRefused / CheckpointUntrusted before touching anything when
    the newest committed checkpoint belongs to other settings or is not signed with `key`."""
    for step in store_steps(run_uri, storage):
        uri = layout.checkpoint_uri(run_uri, step)
        try:
            manifest = read_manifest(uri, storage)
        except ArtifactError as e:
            _quarantine(run_uri, step, storage, f"unreadable manifest: {e}", lease)
            continue
        if manifest is None:
            log.warning("skipping checkpoint %s: no manifest (partial upload); removing it", uri)
            _check_lease(lease)
            _delete_checkpoint(run_uri, step, storage)
            continue
        if manifest.kind != KIND:
            _quarantine(run_uri, step, storage, f"artifact kind {manifest.kind!r}", lease)
            continue
        if contract is not None:
            diffs = contract.differences(manifest)
            if diffs and not contract.allow_changes:
                raise ResumeRefused(
                    f"run {run_uri} has checkpoint {uri} made with other settings than this run: " + "; ".join(diffs)
                    + ". Use another pipeline.run_id for a new run, or set train.resume_across_changes: true to "
                    "continue these weights deliberately"
                )
            if diffs:
                log.warning("resuming %s across changes (train.resume_across_changes): %s", uri, "; ".join(diffs))
        if key is not None:
            verify_signature(key, uri, manifest)
        dest = local_root / f"step-{step}"
        try:  # the manifest read and verified above drives the downloads: it is not read again
            fetch_artifact(uri, dest, storage, manifest=manifest)
        except ArtifactError as e:
            log.warning("skipping checkpoint %s: %s", uri, e)
            _quarantine(run_uri, step, storage, str(e), lease)
            continue
        check_local_copy(dest, manifest)
        for p in dest.rglob("*"):  # a verified copy, read-only from here to DeepSpeed's torch.load
            if p.is_file():
                p.chmod(0o444)
        log.info("resuming from checkpoint %s", uri)
        return Restored(step, dest, uri)
    return None


def _delete_checkpoint(run_uri: str, step: int, storage) -> None:
    uri = layout.checkpoint_uri(run_uri, step)
    store, key = open_store(uri, storage)
    # manifest first: the checkpoint stops existing before its files go
    store.delete(f"{key.rstrip('/')}/{MANIFEST}")
    store.delete_prefix(key.rstrip("/") + "/")


def quarantine_uri(run_uri: str, step: int) -> str:
    return uris.join(run_uri, QUARANTINE, f"step-{step}")


def _quarantine(run_uri: str, step: int, storage, reason: str, lease) -> str:
    """Move every object of checkpoints/step-N to quarantine/step-N/<time>/ (with a note saying
    why): out of the resume's way, kept for a person to inspect or restore."""
    _check_lease(lease)
    src = layout.checkpoint_uri(run_uri, step)
    dst = uris.join(quarantine_uri(run_uri, step), time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    store, skey = open_store(src, storage)
    _, dkey = open_store(dst, storage)
    skey, dkey = skey.rstrip("/"), dkey.rstrip("/")
    objs = store.list(skey + "/")
    for o in objs:
        store.copy(o.key, dkey + o.key[len(skey):])
    store.put_bytes(f"{dkey}/QUARANTINED.json", json.dumps({"from": src, "reason": reason, "at": time.time()},
                                                            sort_keys=True).encode())
    _check_lease(lease)
    keys = {o.key for o in objs}
    if f"{skey}/{MANIFEST}" in keys:
        store.delete(f"{skey}/{MANIFEST}")  # uncommitted first, then its files
    for k in sorted(keys - {f"{skey}/{MANIFEST}"}):
        store.delete(k)
    log.warning("quarantined checkpoint %s -> %s: %s", src, dst, reason)
    return dst


def discard_after(run_uri: str, storage, step: int, restored_uri: str | None, lease=None) -> None:
    """Checkpoints newer than the one resumed from are of a timeline about to be redone: committed
    ones are quarantined (never deleted by a resume), partial ones removed; LATEST then points at
    what was restored."""
    for s in store_steps(run_uri, storage):
        if s > step:
            if read_manifest(layout.checkpoint_uri(run_uri, s), storage) is not None:
                _quarantine(run_uri, s, storage, f"newer than the resume point step-{step}", lease)
            else:
                _check_lease(lease)
                _delete_checkpoint(run_uri, s, storage)
    if restored_uri is not None:
        _check_lease(lease)
        write_latest(layout.checkpoints_uri(run_uri), restored_uri, storage, replace=True)


# ----------------------------------------------------------------------------- local side
@dataclass(frozen=True)
class Pending:
    """A checkpoint saved on local disk whose push has not committed yet."""

    step: int
    local_dir: Path
    run_uri: str
    config: dict[str, Any]
    inputs: list[str]
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        body = {"step": self.step, "run_uri": self.run_uri, "config": self.config, "inputs": self.inputs,
                "extra": self.extra}
        tmp = self.local_dir / f"{PENDING}.tmp"
        tmp.write_text(json.dumps(body, sort_keys=True))
        os.replace(tmp, self.local_dir / PENDING)

    @classmethod
    def read(cls, local_dir: Path) -> Pending:
        d = json.loads((local_dir / PENDING).read_text())
        return cls(int(d["step"]), local_dir, d["run_uri"], d["config"], list(d["inputs"]), d.get("extra") or {})


def find_pending(run_staging: Path, run_uri: str) -> list[Pending]:
    """Checkpoints any attempt of this run saved and did not push (`<run staging>/attempts/*/checkpoints/*`)."""
    out = []
    for marker in sorted(run_staging.glob(f"attempts/*/checkpoints/step-*/{PENDING}")):
        try:
            p = Pending.read(marker.parent)
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring unreadable pending-push marker %s: %s", marker, e)
            continue
        if p.run_uri.rstrip("/") == run_uri.rstrip("/"):
            out.append(p)
    return sorted(out, key=lambda p: p.step)


def prepare_attempt(run_staging: Path, attempt_staging: Path, run_uri: str, storage, *, key: bytes,
                    keep_last: int, lease=None) -> list[int]:
    """Before a resume (holding the lease): push what earlier attempts saved but never pushed,
    then remove those attempts' directories. Returns the steps pushed."""
    pushed = []
    for p in find_pending(run_staging, run_uri):
        if p.local_dir.parent.parent == attempt_staging:
            continue
        _check_lease(lease)
        uri = layout.checkpoint_uri(run_uri, p.step)
        log.info("pushing checkpoint step-%d that attempt %s saved but did not push", p.step,
                 p.local_dir.parent.parent.name)
        try:
            _push(p, storage, key, before_commit=_fence(lease))
        except ArtifactConflict as e:  # the store's committed step wins; this copy is kept aside
            _quarantine_local(run_staging, p, str(e))
            continue
        pushed.append(p.step)
        (p.local_dir / PENDING).unlink()
        log.info("pushed checkpoint %s (left over from an earlier attempt)", uri)
    if pushed:
        _check_lease(lease)
        write_latest(layout.checkpoints_uri(run_uri), layout.checkpoint_uri(run_uri, max(pushed)), storage,
                     replace=True)
    for old in sorted(run_staging.glob("attempts/*")):
        if old != attempt_staging and not any(old.glob(f"checkpoints/step-*/{PENDING}")):
            shutil.rmtree(old, ignore_errors=True)
    return pushed


def _quarantine_local(run_staging: Path, p: Pending, reason: str) -> Path:
    """An earlier attempt's unpushed copy of a step the store already holds with other content (a
    writer that was fenced out late, a timeline redone): the committed one is kept, this copy is
    moved to `<run staging>/quarantine/` for a person, out of every later attempt's way."""
    dest = run_staging / QUARANTINE / f"step-{p.step}-{p.local_dir.parent.parent.name}-{int(time.time())}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    (p.local_dir / PENDING).rename(p.local_dir / "QUARANTINED.pending.json")
    (p.local_dir / "QUARANTINED.txt").write_text(reason + "\n")
    shutil.move(str(p.local_dir), dest)
    log.warning("checkpoint step-%d saved by attempt %s conflicts with the committed one; kept the committed "
                "one, moved this copy to %s: %s", p.step, p.local_dir.parent.parent.name, dest, reason)
    return dest


def _push(p: Pending, storage, key: bytes, before_commit: Callable[[], None] | None = None) -> Manifest:
    return publish_artifact(p.local_dir, layout.checkpoint_uri(p.run_uri, p.step), kind=KIND, config=p.config,
                            inputs=p.inputs, counts={}, extra={"step": p.step, **p.extra}, storage=storage,
                            seal=lambda m: {"signature": signature(key, m.uri, m)}, before_commit=before_commit)


@dataclass(frozen=True)
class PushPolicy:
    keep_last: int
    max_failed_pushes: int = 3
    max_pending: int = 2
    backoff_s: float = 2.0


class CheckpointUploader:
    """One background thread (on rank 0) that pushes checkpoints in order: artifact, LATEST, prune."""

    def __init__(self, run_uri: str, storage, policy: PushPolicy, config: dict[str, Any], inputs: list[str], *,
                 key: bytes, lease=None):
        self.run_uri, self.storage, self.policy = run_uri, storage, policy
        self.config, self.inputs, self.key, self.lease = config, inputs, key, lease
        self.errors: list[str] = []
        self.pushed: list[int] = []
        self._fatal: BaseException | None = None
        self._q: queue.Queue = queue.Queue(maxsize=policy.max_pending)
        self._thread = threading.Thread(target=self._loop, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    def raise_if_failed(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def submit(self, step: int, local_dir: Path, extra: dict[str, Any],
               ready: Callable[[], None] | None = None) -> None:
        """Queue a saved checkpoint (waits while `max_pending` are queued: disk is bounded too);
        raises at once if pushing has failed for good or the lease is lost. ``ready`` (async
        saves): called on the upload thread before anything else, returns once every rank's files
        are complete; only then is the pending marker written, so a crash while the files are
        still being written leaves nothing that a later attempt would push."""
        p = Pending(step, local_dir, self.run_uri, self.config, self.inputs, extra)
        if ready is None:
            p.write()  # first: a push that fails (or a crash) from here leaves it for the next attempt
        try:
            self.raise_if_failed()
            _check_lease(self.lease)
        except BaseException:
            if ready is not None:  # async: mark it once its files are complete, then stop
                self._mark_when_ready(p, ready)
            raise
        while True:
            try:
                self._q.put((p, ready), timeout=1.0)
                return
            except queue.Full:
                self.raise_if_failed()

    @staticmethod
    def _mark_when_ready(p: Pending, ready: Callable[[], None]) -> None:
        try:
            ready()
        except Exception as e:  # noqa: BLE001 - its files never completed: nothing to keep
            log.warning("checkpoint %s was not written completely (%s); not kept for the next attempt", p.local_dir, e)
            return
        p.write()

    def close(self) -> None:
        """Wait for every queued upload; raise if any failed."""
        while True:
            try:
                self._q.put(None, timeout=1.0)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    break
        self._thread.join()
        self.raise_if_failed()
        if self.errors:
            raise PushFailed("checkpoint upload(s) failed: " + "; ".join(self.errors))

    def _loop(self) -> None:
        from training.lease import LeaseLost

        failures = 0
        while True:
            item = self._q.get()
            if item is None:
                return
            p, ready = item
            uri = layout.checkpoint_uri(self.run_uri, p.step)
            if ready is not None:
                try:
                    ready()
                except Exception as e:  # noqa: BLE001 - the files never completed: nothing to push
                    self._fatal = CheckpointError(f"checkpoint {p.local_dir} was not written completely: {e}")
                    log.error("checkpoint uploader stops: %s", self._fatal)
                    return
                p.write()  # every rank's files are complete: from here a crash leaves it for the next attempt
            displaced = False
            while True:
                try:
                    _check_lease(self.lease)
                    try:
                        _push(p, self.storage, self.key, before_commit=_fence(self.lease))
                    except ArtifactConflict:
                        if self.lease is None or displaced:  # no lease proves the run is ours; or twice
                            raise
                        self._displace(p.step)
                        displaced = True
                        _push(p, self.storage, self.key, before_commit=_fence(self.lease))
                    _check_lease(self.lease)
                    write_latest(layout.checkpoints_uri(self.run_uri), uri, self.storage, replace=True)
                except LeaseLost as e:
                    self._fatal = e
                    log.error("checkpoint uploader stops: %s", e)
                    return
                except Exception as e:  # noqa: BLE001 - retried, then fatal
                    failures += 1
                    self.errors.append(f"{uri}: {e}")
                    log.exception("checkpoint push %s failed (%d in a row, train.max_failed_pushes=%d)", uri,
                                  failures, self.policy.max_failed_pushes)
                    if failures >= self.policy.max_failed_pushes:
                        self._fatal = PushFailed(
                            f"{failures} checkpoint pushes in a row failed (train.max_failed_pushes="
                            f"{self.policy.max_failed_pushes}); last: {uri}: {e}. Local copies are kept under "
                            f"{p.local_dir.parent} and the next attempt pushes them first"
                        )
                        return
                    time.sleep(min(60.0, self.policy.backoff_s * 2 ** (failures - 1)))
                    continue
                failures = 0
                self.errors.clear()
                break
            self.pushed.append(p.step)
            log.info("pushed checkpoint %s", uri)
            (p.local_dir / PENDING).unlink(missing_ok=True)
            shutil.rmtree(p.local_dir, ignore_errors=True)  # committed: the store has it now
            try:
                self._prune(p.step)
            except LeaseLost as e:
                self._fatal = e
                return
            except Exception:  # noqa: BLE001 - pruning is housekeeping; the next push prunes again
                log.warning("pruning after %s failed", uri, exc_info=True)

    def _displace(self, step: int) -> None:
        """A checkpoint of `step` committed by someone else since this trainer resumed: a fenced-out
        writer's late commit. With the lease proved (fence), it is moved aside, never deleted."""
        self.lease.fence()
        _quarantine(self.run_uri, step, self.storage, f"committed by another writer while {self.lease.holder} held "
                    f"the run lease; replaced by the holder's own step-{step}", self.lease)

    def _prune(self, newest: int) -> None:
        """Keep the newest keep_last committed checkpoints; drop older ones and stale partials."""
        committed = []
        for step in store_steps(self.run_uri, self.storage):
            uri = layout.checkpoint_uri(self.run_uri, step)
            if step <= newest and read_manifest(uri, self.storage) is not None:
                committed.append(step)
        keep = set(committed[: self.policy.keep_last])
        for step in store_steps(self.run_uri, self.storage):
            if step < newest and step not in keep:
                _check_lease(self.lease)
                _delete_checkpoint(self.run_uri, step, self.storage)
                log.info("pruned checkpoint %s (keep_last=%d)", layout.checkpoint_uri(self.run_uri, step),
                         self.policy.keep_last)


def run_id_of(run_uri: str) -> str:
    return uris.safe_component(uris.name(run_uri), "run id (last component of --output)")
