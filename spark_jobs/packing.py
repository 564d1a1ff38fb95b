"""Length limits per document and packing of documents into fixed-length training rows.

A document is one record's prompt + completion tokens with labels (-100 on the prompt). Packing
never splits a document across rows: a document longer than `seq_len` is rejected or (by
configuration) has its answer's tail cut off, and the cut is counted. Rows follow the
train-ready contract (DESIGN.md): `input_ids`, `labels` (-100 on prompt and padding),
`position_ids` restarting at 0 at each document. Padding fills the end of a row as one more
segment whose positions also restart at 0, so attention never joins padding to a document.
Pure numpy: runs inside Spark's `mapInPandas`, one buffer of documents at a time.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100

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
    n_prompt: int
    n_answer: int  # completion tokens kept (labels != IGNORE_INDEX)
    truncated: bool


def make_document(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], limits: LengthLimits, eos_id: int | None = None
) -> Document | tuple[str, str]:
    """A trainable document, or (reason, detail) when a length limit refuses it."""
    n_p, n_c = len(prompt_ids), len(completion_ids)
    answer_tokens = n_c - (1 if eos_id is not None and n_c and completion_ids[-1] == eos_id else 0)
    total = n_p + n_c
    if answer_tokens < limits.min_answer_tokens:
        return ANSWER_TOO_SHORT, f"answer has {answer_tokens} tokens < min_answer_tokens={limits.min_answer_tokens}"
    if total > limits.max_tokens:
        return TOO_LONG, f"{total} tokens > max_tokens={limits.max_tokens}"
    truncated = False
    if total > limits.seq_len:
        room = limits.seq_len - n_p
        if limits.overflow == "reject":
            return EXCEEDS_SEQ_LEN, f"{total} tokens > seq_len={limits.seq_len} (overflow=reject)"
        if room < max(1, limits.min_answer_tokens):
            return PROMPT_EXCEEDS_SEQ_LEN, f"prompt has {n_p} tokens; seq_len={limits.seq_len} leaves {room} for the answer"
        completion_ids, n_c, truncated = completion_ids[:room], room, True
    ids = np.fromiter((*prompt_ids, *completion_ids), dtype=np.int32, count=n_p + n_c)
    labels = ids.copy()
    labels[:n_p] = IGNORE_INDEX
    return Document(ids, labels, n_p, n_c, truncated)


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
    for members in best_fit_decreasing(lengths, seq_len):
        input_ids = np.full(seq_len, pad_id, dtype=np.int32)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
        position_ids = np.zeros(seq_len, dtype=np.int32)
        at = 0
        for i in members:
            ids, lab = docs[i]
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
