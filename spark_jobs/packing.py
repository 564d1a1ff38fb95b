"""Length limits per document and packing of documents into fixed-length training rows.

A document is one rendered conversation: its token ids with labels (-100 on every token the loss
must not look at: system prompt, user turns, tool schemas and results). Packing never splits a
document across rows: a document longer than `seq_len` is rejected or (by configuration) cut at
`seq_len` when trained tokens remain before the cut, and the cut is counted. Rows follow the
train-ready contract (DESIGN.md): `input_ids`, `labels` (-100 on prompt and padding),
`position_ids` restarting at 0 at each document. Padding fills the end of a row as one more
segment whose positions also restart at 0, so attention never joins padding to a document.
Pure numpy (+ pandas for `pack_partitions`): runs inside Spark's `mapInPandas`, one buffer of
documents at a time.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from pipeline_core.handoffs import IGNORE_INDEX

# Reject reasons of this step (the manifest counts them under these names).
ANSWER_TOO_SHORT = "answer_too_short"
TOO_LONG = "too_long"
EXCEEDS_SEQ_LEN = "exceeds_seq_len"
PROMPT_EXCEEDS_SEQ_LEN = "prompt_exceeds_seq_len"


@dataclass(frozen=True)
class LengthLimits:
    seq_len: int
    max_tokens: int
    min_answer_tokens: int
    overflow: str  # "reject" | "truncate"


@dataclass(frozen=True)
class Document:
    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE_INDEX on the prompt
    n_prompt: int  # tokens without loss (prompt, system, tool results)
    n_answer: int  # trained tokens kept (labels != IGNORE_INDEX)
    truncated: bool


def make_document(
    input_ids: Sequence[int], targets: Sequence[bool], limits: LengthLimits, eos_id: int | None = None
) -> Document | tuple[str, str]:
    """A trainable document from a rendered conversation, or (reason, detail) when a length limit
    refuses it. `targets[i]`: the loss looks at token i."""
    ids = np.asarray(input_ids, dtype=np.int32)
    tgt = np.asarray(targets, dtype=bool)
    n = len(ids)
    eos_targets = int(np.count_nonzero(tgt & (ids == eos_id))) if eos_id is not None else 0
    answer_tokens = int(np.count_nonzero(tgt)) - eos_targets
    if answer_tokens < limits.min_answer_tokens:
        return ANSWER_TOO_SHORT, f"assistant turns have {answer_tokens} tokens < min_answer_tokens={limits.min_answer_tokens}"
    if n > limits.max_tokens:
        return TOO_LONG, f"{n} tokens > max_tokens={limits.max_tokens}"
    truncated = False
    if n > limits.seq_len:
        if limits.overflow == "reject":
            return EXCEEDS_SEQ_LEN, f"{n} tokens > seq_len={limits.seq_len} (overflow=reject)"
        kept = int(np.count_nonzero(tgt[: limits.seq_len]))
        if kept < max(1, limits.min_answer_tokens):
            first = int(np.argmax(tgt)) if tgt.any() else n
            return PROMPT_EXCEEDS_SEQ_LEN, (f"the first trained token is at {first}; seq_len={limits.seq_len} leaves "
                                            f"{kept} trained tokens")
        ids, tgt, truncated = ids[: limits.seq_len], tgt[: limits.seq_len], True
    labels = np.where(tgt, ids, IGNORE_INDEX).astype(np.int32)
    n_answer = int(np.count_nonzero(tgt))
    return Document(ids, labels, len(ids) - n_answer, n_answer, truncated)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of document indices (each bin's lengths sum to <= capacity), longest documents first,
    each into the fullest bin it fits. Deterministic: ties keep input order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin index)
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"document {i} has {n} tokens > capacity {capacity}; length limits must run first")
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            rem, b = free.pop(j)
        else:
            rem, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if rem - n > 0:
            bisect.insort(free, (rem - n, b))
    return bins


def pack(docs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Packed rows (input_ids, labels, position_ids), int32 arrays of length `seq_len`."""
    lengths = [len(ids) for ids, _ in docs]
    yield from pack_rows(([docs[i] for i in members] for members in best_fit_decreasing(lengths, seq_len)),
                         seq_len, pad_id)


def pack_rows(rows: Iterator[Sequence[tuple[np.ndarray, np.ndarray]]] | Sequence, seq_len: int,
              pad_id: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One row per group of documents, in the group's order (the caller checked they fit)."""
    for members in rows:
        input_ids = np.full(seq_len, pad_id, dtype=np.int32)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
        position_ids = np.zeros(seq_len, dtype=np.int32)
        at = 0
        for ids, lab in members:
            n = len(ids)
            input_ids[at:at + n] = ids
            labels[at:at + n] = lab
            position_ids[at:at + n] = np.arange(n, dtype=np.int32)
            at += n
        position_ids[at:] = np.arange(seq_len - at, dtype=np.int32)
        yield input_ids, labels, position_ids


def split_documents(position_ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each segment of a packed row (documents, then the padding segment if any)."""
    starts = [0] + [i for i in range(1, len(position_ids)) if position_ids[i] == 0]
    return list(zip(starts, starts[1:] + [len(position_ids)], strict=True))


ROW_SCHEMA = "input_ids array<int>, labels array<int>, position_ids array<int>"


def pack_partitions(batches: Iterator[pd.DataFrame], seq_len: int, pad_id: int, buffer_docs: int,
                    pairs: bool = False) -> Iterator[pd.DataFrame]:
    """mapInPandas body: documents (sorted by key) -> packed rows, `buffer_docs` documents at a time.
    `pairs` (objective dpo): each input row is a preference pair (`input_ids`/`labels` of chosen and
    rejected concatenated, `split_at` = chosen's length) and becomes one row of its own."""

    def flush(buf):
        rows = list(pack_rows(buf, seq_len, pad_id) if pairs else pack(buf, seq_len, pad_id))
        return pd.DataFrame({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows],
                             "position_ids": [r[2] for r in rows]})

    buf: list = []
    for pdf in batches:
        cuts = pdf["split_at"] if pairs else [None] * len(pdf)
        for ids, labels, cut in zip(pdf["input_ids"], pdf["labels"], cuts, strict=True):
            doc = (np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32))
            buf.append(doc if cut is None else [(doc[0][:cut], doc[1][:cut]), (doc[0][cut:], doc[1][cut:])])
            if len(buf) >= buffer_docs:
                yield flush(buf)
                buf = []
    if buf:
        yield flush(buf)
