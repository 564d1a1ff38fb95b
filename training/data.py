"""Micro-batches over a train-ready artifact (DESIGN.md: data/{train,val}/*.parquet with
`input_ids`, `labels`, `position_ids` lists of seq_len int32).

Order is a pure function of (seed, epoch): files are shuffled, then rows within each file. The
iterator's position is one integer, the number of global micro-batches consumed, so a checkpoint
restores it exactly without replaying data. Only one parquet file's needed columns are held in
memory at a time; a stage reads only the columns it uses (the first stage the inputs, the last
the labels; both need position_ids).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from pipeline_core.names import Split, data_prefix
from training.model import shift_targets

COLUMNS = ("input_ids", "labels", "position_ids")


class DataError(ValueError):
    pass


class ShardSet:
    """The parquet files of one split, read lazily (one file cached)."""

    def __init__(self, files: list[Path], seq_len: int, columns: tuple[str, ...]):
        if not files:
            raise DataError("split has no parquet files")
        self.files = sorted(files)
        self.seq_len = seq_len
        self.columns = columns
        self.rows = []
        for f in self.files:
            pf = pq.ParquetFile(f)
            missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
            if missing:
                raise DataError(f"{f.name}: missing column(s) {missing}; not a train-ready shard")
            self.rows.append(pf.metadata.num_rows)
        self._cached: tuple[int, dict[str, np.ndarray]] | None = None

    @property
    def num_rows(self) -> int:
        return sum(self.rows)

    def file_arrays(self, idx: int) -> dict[str, np.ndarray]:
        if self._cached is None or self._cached[0] != idx:
            table = pq.read_table(self.files[idx], columns=list(self.columns))
            arrays = {}
            for c in self.columns:
                col = table.column(c).combine_chunks()
                lengths = np.diff(col.offsets.to_numpy())
                if (lengths != self.seq_len).any():
                    bad = int(np.nonzero(lengths != self.seq_len)[0][0])
                    raise DataError(
                        f"{self.files[idx].name} row {bad}: {c} has {lengths[bad]} tokens, expected "
                        f"train.seq_len={self.seq_len}"
                    )
                arrays[c] = col.values.to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, self.seq_len)
            self._cached = (idx, arrays)
        return self._cached[1]


@dataclass(frozen=True)
class Order:
    """Which (file, row) is the k-th sample of an epoch."""

    file_order: np.ndarray
    row_orders: list[np.ndarray]
    cum: np.ndarray  # cumulative row counts in file_order

    def locate(self, k: int) -> tuple[int, int]:
        pos = int(np.searchsorted(self.cum, k, side="right"))
        start = 0 if pos == 0 else int(self.cum[pos - 1])
        f = int(self.file_order[pos])
        return f, int(self.row_orders[f][k - start])


def epoch_order(rows: list[int], seed: int, epoch: int, shuffle: bool) -> Order:
    if not shuffle:
        return Order(np.arange(len(rows)), [np.arange(n) for n in rows], np.cumsum(rows))
    rng = np.random.default_rng([seed, epoch])
    file_order = rng.permutation(len(rows))
    row_orders = [np.random.default_rng([seed, epoch, i]).permutation(n) for i, n in enumerate(rows)]
    return Order(file_order, row_orders, np.cumsum([rows[i] for i in file_order]))


class MicroBatches(Iterator):
    """Yields DeepSpeed pipeline batches ``((input_ids, position_ids), targets)``.

    Global micro-batch g takes samples [g*dp*mb, (g+1)*dp*mb) of its epoch's order; this data-parallel
    rank takes its mb-sized slice. Parts a stage does not need are None.
    """

    def __init__(self, shards: ShardSet, *, micro_batch: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True, position: int = 0, need_inputs: bool = True, need_labels: bool = True,
                 device: torch.device | str = "cpu", pin_memory: bool = False):
        self.shards, self.mb, self.dp_rank, self.dp_size = shards, micro_batch, dp_rank, dp_size
        self.seed, self.shuffle, self.device = seed, shuffle, torch.device(device)
        # pinned pages let the copy run on the GPU's copy engine while the host queues more work
        self.pin = pin_memory and self.device.type == "cuda"
        self.need_inputs, self.need_labels = need_inputs, need_labels
        self.per_epoch = shards.num_rows // (micro_batch * dp_size)
        if self.per_epoch == 0:
            raise DataError(
                f"split has {shards.num_rows} rows, fewer than one global micro-batch "
                f"(micro_batch_size={micro_batch} x data-parallel {dp_size})"
            )
        self.position = position
        self._order: tuple[int, Order] | None = None

    def _epoch_order(self, epoch: int) -> Order:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.shards.rows, self.seed, epoch, self.shuffle))
        return self._order[1]

    def __next__(self):
        epoch, g = divmod(self.position, self.per_epoch)
        order = self._epoch_order(epoch)
        first = g * self.mb * self.dp_size + self.dp_rank * self.mb
        batch = self.batch_at([order.locate(k) for k in range(first, first + self.mb)])
        self.position += 1
        return batch

    def batch_at(self, locations: list[tuple[int, int]]):
        """The micro-batch of the given (file, row) samples."""
        rows: dict[str, list[np.ndarray]] = {c: [] for c in self.shards.columns}
        for f, r in locations:
            arrays = self.shards.file_arrays(f)
            for c in self.shards.columns:
                rows[c].append(arrays[c][r])
        t = {c: torch.from_numpy(np.stack(v)) for c, v in rows.items()}
        labels = None
        if self.need_labels:  # on the host: a few thousand integers, no device round trip
            labels = self.make_labels(shift_targets(t.pop("labels"), t["position_ids"]), t["position_ids"], locations)
        t = {c: self._to_device(v) for c, v in t.items()}
        inputs = (t["input_ids"], t["position_ids"]) if self.need_inputs else None
        if isinstance(labels, tuple):
            return inputs, tuple(self._to_device(x) for x in labels)
        return inputs, None if labels is None else self._to_device(labels)

    def make_labels(self, targets: torch.Tensor, position_ids: torch.Tensor, locations: list[tuple[int, int]]):
        """What the last stage's loss gets (host tensors): the shifted targets; ``dpo_data`` adds more."""
        return targets

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.pin:
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)


def split_files(local_root: Path, split: Split) -> list[Path]:
    """A fetched train-ready artifact's Parquet files of `split`."""
    return sorted((local_root / data_prefix(split)).glob("*.parquet"))


def columns_for(first_stage: bool, last_stage: bool) -> tuple[str, ...]:
    cols = ["position_ids"]
    if first_stage:
        cols.insert(0, "input_ids")
    if last_stage:
        cols.append("labels")
    return tuple(cols)
