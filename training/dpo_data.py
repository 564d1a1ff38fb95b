"""Micro-batches of DPO pair rows: the last stage's labels carry what ``dpo_loss.DPOLoss`` needs.

``labels = (targets, side, reference, row)``: the shifted targets; per target which side of the
pair it belongs to (0 chosen = the row's first document, 1 rejected = the second; from the
position-id segments, ``model.document_ids``); the reference model's summed log-probs of the
row's sides ([B, 2], zeros when none are loaded yet: the reference pass itself); the row's index in
its split (files in sorted order, rows in file order), the key of the reference table.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from training.data import DataError, MicroBatches, ShardSet
from training.loss import IGNORE_INDEX
from training.model import document_ids


def pair_sides(targets: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: 0 where a target belongs to the row's first document (chosen), 1 to its second
    (rejected), -1 elsewhere. A target shares its position's document (``shift_targets`` masks the
    document boundaries), so the segments of ``position_ids`` say it."""
    doc = document_ids(position_ids).to(torch.int64) - 1
    has = targets != IGNORE_INDEX
    if bool((has & (doc > 1)).any()):
        raise DataError("a DPO row has trained tokens past its second document: not a pair row (chosen, rejected); "
                        "filter the data with filter.objective dpo")
    return torch.where(has, doc, torch.full_like(doc, -1))


def row_offsets(shards: ShardSet) -> np.ndarray:
    """Index of each file's first row in the split (files in ShardSet's sorted order)."""
    return np.concatenate([[0], np.cumsum(shards.rows)[:-1]]).astype(np.int64)


class PairMicroBatches(MicroBatches):
    """``MicroBatches`` whose labels are ``(targets, side, reference, row)``. ``reference``: [rows, 2]
    summed log-probs of the split's rows (None: zeros, for the reference pass)."""

    def __init__(self, shards: ShardSet, reference: np.ndarray | None = None, **kwargs):
        super().__init__(shards, **kwargs)
        if reference is not None and reference.shape != (shards.num_rows, 2):
            raise DataError(f"reference log-probs for {reference.shape[0]} rows, the split has {shards.num_rows}")
        self.reference = reference
        self.offsets = row_offsets(shards)

    def make_labels(self, targets, position_ids, locations):
        rows = torch.tensor([int(self.offsets[f]) + r for f, r in locations], dtype=torch.int64)
        ref = (torch.from_numpy(self.reference[rows.numpy()]) if self.reference is not None
               else torch.zeros(len(locations), 2, dtype=torch.float64))
        return targets, pair_sides(targets, position_ids), ref, rows

    def in_order(self) -> tuple[int, Iterator]:
        """(micro-batches per replica, iterator) over every row of the split once, in order, for this
        data-parallel rank; the last global micro-batch is completed with rows from the start (their
        values are recorded twice, identically)."""
        n, per = self.shards.num_rows, self.mb * self.dp_size
        count = -(-n // per)
        starts = np.concatenate([[0], np.cumsum(self.shards.rows)])

        def locate(k: int) -> tuple[int, int]:
            k %= n
            f = int(np.searchsorted(starts, k, side="right") - 1)
            return f, k - int(starts[f])

        def batches():
            for g in range(count):
                first = g * per + self.dp_rank * self.mb
                yield self.batch_at([locate(k) for k in range(first, first + self.mb)])

        return count, batches()
