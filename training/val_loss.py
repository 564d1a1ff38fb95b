"""Token-weighted validation loss of a Hugging Face model on a train-ready split.

The promotion gate evaluates the new model and the current `models/LATEST` with this one
function, on the same rows of the same val split, so the two numbers compare: loss =
Σ cross-entropy / Σ target tokens over every packed document (never a mean of per-batch means).
Each packed row is cut into its documents at `position_ids == 0` and every document runs on its
own, so no token attends across a document boundary whatever attention the model uses; targets
are the next token's label inside the document (the trainer's `shift_targets` rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline_core.handoffs import IGNORE_INDEX


@dataclass(frozen=True)
class ValLoss:
    loss: float
    target_tokens: int
    documents: int
    rows: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))


def documents(input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray):
    """(input_ids, labels) of each packed document of one row; trailing padding is a document
    without targets and is skipped."""
    starts = np.flatnonzero(position_ids == 0).tolist() + [len(position_ids)]
    for s, e in zip(starts[:-1], starts[1:], strict=True):
        lab = labels[s:e]
        if (lab[1:] != IGNORE_INDEX).any():
            yield input_ids[s:e], lab


def val_loss(model_dir: str | Path, val_files: list[Path], *, max_rows: int | None = None,
             device: str = "cpu") -> ValLoss:
    """Evaluate `model_dir` (config.json + safetensors) on the first `max_rows` rows of `val_files`."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    if not val_files:
        raise ValueError("val_loss: the train-ready artifact has no val split (filter.val_fraction = 0?)")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    loss_sum, n_targets, n_docs, n_rows = 0.0, 0, 0, 0
    with torch.inference_mode():
        for f in sorted(val_files):
            table = pq.read_table(f, columns=["input_ids", "labels", "position_ids"])
            for ids, lab, pos in zip(*(table.column(c).to_pylist() for c in ("input_ids", "labels", "position_ids")),
                                     strict=True):
                if max_rows is not None and n_rows >= max_rows:
                    break
                n_rows += 1
                for d_ids, d_lab in documents(np.asarray(ids), np.asarray(lab), np.asarray(pos)):
                    x = torch.as_tensor(d_ids, dtype=torch.long, device=device)[None]
                    logits = model(input_ids=x).logits[0, :-1].float()
                    targets = torch.as_tensor(d_lab[1:], dtype=torch.long, device=device)
                    loss_sum += float(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"))
                    n_targets += int((targets != IGNORE_INDEX).sum())
                    n_docs += 1
    if n_targets == 0:
        raise ValueError("val_loss: the val split has no target tokens")
    return ValLoss(loss=loss_sum / n_targets, target_tokens=n_targets, documents=n_docs, rows=n_rows)
