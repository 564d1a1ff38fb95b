"""Checkpoints in the object store: background push, LATEST, keep-last-K, verified resume.

A checkpoint is an artifact `<run>/checkpoints/step-N/` whose `data/` is the DeepSpeed tag
directory (every rank's model/optimizer files plus per-rank RNG state). The uploader thread
publishes it (files, then manifest), then moves `checkpoints/LATEST`, then prunes older ones, so
training never waits on the network and a half-uploaded checkpoint is never visible. On start the
newest checkpoint whose manifest and file hashes verify is restored; others are skipped with a
warning naming them.
"""

from __future__ import annotations

import logging
import queue
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline_core import layout, uris
from pipeline_core.artifacts import (
    ArtifactError,
    fetch_artifact,
    publish_artifact,
    read_manifest,
    write_latest,
)
from pipeline_core.store import open_store

log = logging.getLogger(__name__)

KIND = "checkpoint"
TAG = "data"  # DeepSpeed tag == the artifact's payload directory
_STEP_RE = re.compile(r"^step-(\d+)$")


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


def fetch_newest_valid(run_uri: str, storage, local_root: Path) -> Restored | None:
    """Download the newest verifiable checkpoint into local_root/step-N; None if there is none."""
    for step in store_steps(run_uri, storage):
        uri = layout.checkpoint_uri(run_uri, step)
        try:
            manifest = read_manifest(uri, storage)
            if manifest is None:
                log.warning("skipping checkpoint %s: no manifest (partial upload)", uri)
                continue
            if manifest.kind != KIND:
                log.warning("skipping checkpoint %s: artifact kind %r", uri, manifest.kind)
                continue
            dest = local_root / f"step-{step}"
            fetch_artifact(uri, dest, storage)
        except ArtifactError as e:
            log.warning("skipping checkpoint %s: %s", uri, e)
            continue
        log.info("resuming from checkpoint %s", uri)
        return Restored(step, dest, uri)
    return None


def delete_checkpoint(run_uri: str, step: int, storage) -> None:
    uri = layout.checkpoint_uri(run_uri, step)
    store, key = open_store(uri, storage)
    # manifest first: the checkpoint stops existing before its files go
    store.delete(f"{key.rstrip('/')}/_manifest.json")
    store.delete_prefix(key.rstrip("/") + "/")


def discard_after(run_uri: str, storage, step: int, restored_uri: str | None) -> None:
    """Drop every checkpoint newer than the one resumed from (skipped as corrupt/partial, or from
    a timeline that is about to be redone) and point LATEST at what was restored."""
    for s in store_steps(run_uri, storage):
        if s > step:
            delete_checkpoint(run_uri, s, storage)
            log.info("discarded checkpoint %s (newer than the resume point)", layout.checkpoint_uri(run_uri, s))
    if restored_uri is not None:
        write_latest(layout.checkpoints_uri(run_uri), restored_uri, storage, replace=True)


class CheckpointUploader:
    """One background thread (on one rank) that pushes checkpoints in order."""

    def __init__(self, run_uri: str, storage, keep_last: int, config: dict[str, Any], inputs: list[str]):
        self.run_uri, self.storage, self.keep_last = run_uri, storage, keep_last
        self.config, self.inputs = config, inputs
        self.errors: list[str] = []
        self.pushed: list[int] = []
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    def submit(self, step: int, local_dir: Path, extra: dict[str, Any]) -> None:
        self._q.put((step, local_dir, extra))

    def close(self) -> None:
        """Wait for every queued upload; raise if any failed."""
        self._q.put(None)
        self._thread.join()
        if self.errors:
            raise RuntimeError("checkpoint upload(s) failed: " + "; ".join(self.errors))

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            step, local_dir, extra = item
            uri = layout.checkpoint_uri(self.run_uri, step)
            try:
                publish_artifact(local_dir, uri, kind=KIND, config=self.config, inputs=self.inputs,
                                 counts={}, extra={"step": step, **extra}, storage=self.storage)
                write_latest(layout.checkpoints_uri(self.run_uri), uri, self.storage, replace=True)
                self.pushed.append(step)
                log.info("pushed checkpoint %s", uri)
                shutil.rmtree(local_dir, ignore_errors=True)
                self._prune(step)
            except Exception as e:  # keep training; surfaced at close()
                log.exception("checkpoint upload %s failed", uri)
                self.errors.append(f"{uri}: {e}")

    def _prune(self, newest: int) -> None:
        """Keep the newest keep_last committed checkpoints; drop older ones and stale partials."""
        committed = []
        for step in store_steps(self.run_uri, self.storage):
            uri = layout.checkpoint_uri(self.run_uri, step)
            if step <= newest and read_manifest(uri, self.storage) is not None:
                committed.append(step)
        keep = set(committed[: self.keep_last])
        for step in store_steps(self.run_uri, self.storage):
            if step < newest and step not in keep:
                delete_checkpoint(self.run_uri, step, self.storage)
                log.info("pruned checkpoint %s (keep_last=%d)", layout.checkpoint_uri(self.run_uri, step),
                         self.keep_last)


def run_id_of(run_uri: str) -> str:
    return uris.safe_component(uris.name(run_uri), "run id (last component of --output)")
