"""The asynchronous save's reserved host memory (training/async_save.py ``reserve``): the snapshot is
carved from one slab allocated in the background, each file holds only its own tensors' bytes, the
state is the one at the save while the writer is still behind, later saves reuse the same memory,
and a slab too small or a failed reservation falls back to per-tensor buffers with the same files.
On CPU the slab is pageable; on a GPU the same code pins it (measured in bench/RESULTS.md)."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

from training.async_save import SnapshotCheckpointEngine, checkpoint_nbytes


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "module": {"w": torch.randn(64, 48, generator=g).to(torch.bfloat16), "b": torch.randn(48, generator=g)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(3072, generator=g), "step": torch.tensor(7.0)}},
                      "groups": [torch.randn(5, generator=g, dtype=torch.float64)], "lr": 1e-4},
        "client": {"step": 3, "name": "x"},
    }


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _assert_same(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _engine_with_slab(nbytes: int) -> SnapshotCheckpointEngine:
    eng = SnapshotCheckpointEngine(None, pin_memory=False)
    eng.reserve(nbytes)
    assert eng.reserved_bytes == nbytes  # waits for the background allocation
    return eng


def test_snapshot_is_carved_from_the_slab_and_each_file_holds_only_its_bytes(tmp_path):
    state = _state(0)
    eng = _engine_with_slab(1 << 20)  # 1 MiB, far more than this state
    eng.save(state, str(tmp_path / "a.pt"))
    eng.flush()
    _assert_same(torch.load(tmp_path / "a.pt"), state)
    assert 0 < eng.carved_bytes < 1 << 20
    # torch.save writes a tensor's whole storage: a plain view of the slab would write all 1 MiB
    assert os.path.getsize(tmp_path / "a.pt") < _nbytes(state) + 16_384


def test_the_file_holds_the_state_at_the_save_while_the_writer_is_behind_and_memory_is_reused(tmp_path):
    state = _state(1)
    expected = _state(1)
    eng = _engine_with_slab(1 << 20)
    hold = threading.Event()
    eng.after(hold.wait)  # the writer is busy: the save's file is queued behind it
    eng.save(state, str(tmp_path / "a.pt"))
    for t in _tensors(state):  # training goes on and changes the live state in place
        t.add_(1)
    hold.set()
    eng.flush()
    _assert_same(torch.load(tmp_path / "a.pt"), expected)
    used = eng.carved_bytes
    (tmp_path / "step-2").mkdir()
    eng.save(state, str(tmp_path / "step-2" / "a.pt"))  # the next checkpoint's file: same buffers, new values
    eng.flush()
    assert eng.carved_bytes == used
    _assert_same(torch.load(tmp_path / "step-2" / "a.pt"), state)


def test_a_slab_too_small_or_a_failed_reservation_falls_back_to_per_tensor_buffers(tmp_path):
    state = _state(2)
    small = _engine_with_slab(4096)  # the first tensor (6 KiB of bf16) does not fit, later small ones do
    small.save(state, str(tmp_path / "small.pt"))
    small.flush()
    _assert_same(torch.load(tmp_path / "small.pt"), state)
    assert 0 < small.carved_bytes <= 4096

    failed = SnapshotCheckpointEngine(None, pin_memory=False)
    failed.reserve(1 << 62)  # no machine has this: logged, nothing reserved
    assert failed.reserved_bytes == 0
    failed.save(state, str(tmp_path / "failed.pt"))
    failed.flush()
    _assert_same(torch.load(tmp_path / "failed.pt"), state)
    assert failed.carved_bytes == 0


def test_checkpoint_nbytes_counts_the_module_and_adamw_states():
    model = nn.Sequential(nn.Linear(32, 16), nn.LayerNorm(16))
    params = sum(p.numel() for p in model.parameters())
    plain = checkpoint_nbytes(model, torch.optim.AdamW(model.parameters()))
    assert 3 * 4 * params <= plain <= 3 * 4 * params + 512 * 12  # fp32 weights + two moments, aligned

    class BF16Like:  # DeepSpeed's BF16 optimizer: an fp32 master partition + two moments of it
        fp32_groups_flat_partition = [torch.zeros(1000)]

    half = nn.Sequential(nn.Linear(32, 16)).to(torch.bfloat16)
    got = checkpoint_nbytes(half, BF16Like())
    assert got >= 2 * sum(p.numel() for p in half.parameters()) + 3 * 4000
