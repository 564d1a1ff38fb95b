"""Asynchronous checkpoint saves: the step loop waits only for a copy of the state into host
memory; the files are written by a background thread, then uploaded (training/checkpoints.py).

The shape of torch.distributed.checkpoint's ``async_save`` and torchtitan's async checkpointing,
inside DeepSpeed's own save path: ``SnapshotCheckpointEngine`` is a DeepSpeed checkpoint engine
whose ``save(state, path)`` copies every tensor of ``state`` to host memory (pinned buffers,
reused from one save to the next, on a GPU) and queues the file; one writer thread writes the
queued files in order. ``after(fn)`` queues work that must follow this rank's files (the RNG file,
which is also the rank's "my files are complete" marker that the uploader waits for).

Commit protocol (unchanged): a checkpoint's ``.pending.json`` marker is written only after every
rank's files are complete, and the store's manifest only after every file is uploaded, signed.
A crash while writing leaves no marker (the next attempt discards the directory); a crash while
uploading leaves no manifest (nothing committed; the next attempt pushes it again).

At most one checkpoint is in host memory: a save first waits for the previous one's files.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

log = logging.getLogger(__name__)


class SnapshotCheckpointEngine(TorchCheckpointEngine):
    def __init__(self, config_params=None, *, pin_memory: bool = True):
        super().__init__(config_params)
        self.name = "SnapshotCheckpointEngine"
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # (file name, tensor index) -> host buffer
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ DeepSpeed's interface
    def save(self, state_dict, path: str):
        self.raise_if_failed()
        name = path.rsplit("/", 1)[-1]
        counter = iter(range(1 << 62))
        snapshot = _map_tensors(state_dict, lambda t: self._to_host(t, (name, next(counter))))
        if self.pin_memory:
            torch.cuda.current_stream().synchronize()  # the copies are done before training moves on
        self._q.put((self._write, (snapshot, path)))

    def commit(self, info) -> bool:
        return True  # the files are committed by the uploader's manifest, not here

    # ------------------------------------------------------------------ ours
    def after(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the writer thread once every file queued so far is written."""
        self._q.put((fn, ()))

    def flush(self) -> None:
        """Wait until everything queued is written; raise the writer's error, if any."""
        self._q.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"checkpoint writer failed: {self._error}") from self._error

    def _to_host(self, t: torch.Tensor, key: tuple[str, int]) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.detach().clone()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=self.pin_memory)
        return buf

    def _write(self, snapshot, path: str) -> None:
        torch.save(snapshot, path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def _loop(self) -> None:
        while True:
            fn, args = self._q.get()
            try:
                if self._error is None:  # after a failure nothing more is written (no marker either)
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported by the next save / flush
                log.exception("checkpoint writer failed")
                self._error = e
            finally:
                self._q.task_done()


def _map_tensors(obj, fn):
    """``obj`` with every tensor replaced by ``fn(tensor)`` (dicts, lists, tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: _map_tensors(v, fn) for k, v in obj.items()}
        if isinstance(obj, OrderedDict):  # module state dicts: keep the type and its version metadata
            out = OrderedDict(out)
            if hasattr(obj, "_metadata"):
                out._metadata = obj._metadata
        return out
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return obj
