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

Page-locking that host memory (``cudaHostAlloc``) costs ~1 s per GB, once. ``reserve(nbytes)``
moves it out of the first save: a background thread allocates one pinned slab of the expected
checkpoint size while training runs, and each file's tensors are carved from it as storage slices
(``torch.save`` of a slice writes only its own bytes). What does not fit gets its own buffer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
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
        self._slab: torch.Tensor | None = None  # reserve(): one host buffer that tensors are carved from
        self._slab_used = 0
        self._reserved = threading.Event()
        self._reserved.set()  # nothing reserved: nothing to wait for
        self.reserve_s: float | None = None  # how long the background reservation took
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
    def reserve(self, nbytes: int) -> None:
        """Allocate ``nbytes`` of (pinned, on a GPU) host memory in the background for the saves'
        snapshots; the first save waits for it only if it is not done yet. A failed reservation
        (host memory short) is logged and the saves allocate per tensor, as without it."""
        if nbytes <= 0 or self._slab is not None or not self._reserved.is_set():
            return
        self._reserved.clear()

        def allocate():
            t0 = time.perf_counter()
            try:
                self._slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
                self.reserve_s = time.perf_counter() - t0
                log.info("checkpoint host memory reserved: %.2f GB in %.1f s (background)", nbytes / 1e9, self.reserve_s)
            except (RuntimeError, MemoryError) as e:  # the saves fall back to per-tensor buffers
                log.warning("could not reserve %.2f GB of checkpoint host memory: %s", nbytes / 1e9, e)
            finally:
                self._reserved.set()

        threading.Thread(target=allocate, name="checkpoint-reserve", daemon=True).start()

    @property
    def reserved_bytes(self) -> int:
        self._reserved.wait()
        return 0 if self._slab is None else self._slab.numel()

    @property
    def carved_bytes(self) -> int:
        return self._slab_used

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
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._carve(t)
            if buf is None:
                if t.device.type == "cpu":
                    return t.detach().clone()  # no reserved memory: a fresh copy per save
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=self.pin_memory and t.device.type != "cpu")
        return buf

    def _carve(self, t: torch.Tensor) -> torch.Tensor | None:
        """A host tensor shaped like ``t`` in the reserved slab (its own storage slice), or None."""
        self._reserved.wait()
        if self._slab is None or not t.is_contiguous():
            return None
        start = -(-self._slab_used // _ALIGN) * _ALIGN
        nbytes = t.numel() * t.element_size()
        if start + nbytes > self._slab.numel():
            return None
        self._slab_used = start + nbytes
        storage = self._slab.untyped_storage()[start:start + nbytes]
        return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape, t.stride())

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


_ALIGN = 512  # bytes: every carved tensor starts aligned (any dtype's view; full-speed copies)


def checkpoint_nbytes(module: torch.nn.Module, optimizer) -> int:
    """The host memory one rank's checkpoint snapshot takes: the module's state plus AdamW's
    (DeepSpeed's BF16 optimizer: its fp32 master partition and two fp32 moments; a plain optimizer:
    two moments per trainable parameter), with the slab's alignment per tensor."""
    tensors = list(module.state_dict().values())
    fp32_parts = getattr(optimizer, "fp32_groups_flat_partition", None)
    if fp32_parts is not None:
        states = [p for p in fp32_parts for _ in range(3)]
    else:
        states = [p for p in module.parameters() if p.requires_grad for _ in range(2)]
    tensors += states
    return sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors)


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
