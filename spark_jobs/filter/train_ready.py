"""The train-ready artifact (DESIGN.md "Contracts"): its description, and its writer outside Spark.

One definition of what a train-ready artifact is made of, for every writer:
- `describe`: the manifest's counts (in = out + rejected by reason) and `extra` (the
  `pipeline_core.handoffs.TrainReadyInfo` plus the per-split statistics and column contract). The
  filter stage (spark_jobs/filter/job.py) packs in Spark and calls it with what it measured;
- `write_train_ready`: rendered documents per split -> packed rows (packing.pack), Parquet in the
  contract, the render sample (pipeline_core.render_sample), `describe`, committed through
  pipeline_core.artifacts. Tests, benchmarks and small corpora use it instead of writing rows by hand.
`stage_train_ready` is its first half (files + description, no commit) for a directory that travels
before it is published (bench/parity_corpus.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline_core.handoffs import (
    IGNORE_INDEX,
    DecontamInfo,
    PackedSplit,
    StageCounts,
    TokenizerSpec,
    TrainReadyInfo,
    TrainReadySplits,
)
from pipeline_core.render_sample import SampleDocument, write_sample
from spark_jobs.packing import Document, pack

KIND = "train-ready"
ROW_COLUMNS = ("input_ids", "labels", "position_ids")
COLUMNS = {
    "input_ids": "int32[seq_len]",
    "labels": "int32[seq_len]: = input_ids on trained tokens (assistant turns incl. </s>; not shifted), "
              "-100 on system, user, tool results and padding",
    "position_ids": "int32[seq_len]: 0 at each document start; trailing padding is a segment of its own",
}


@dataclass(frozen=True)
class SplitStats:
    """What was packed into one split."""

    documents: int
    rows: int
    files: int
    doc_tokens: int
    answer_tokens: int
    truncated: int
    records: int | None = None  # kept records, when one record makes several documents (default: documents)

    @property
    def kept(self) -> int:
        return self.documents if self.records is None else self.records

    def as_manifest(self, seq_len: int) -> PackedSplit:
        slots = self.rows * seq_len
        return PackedSplit(records=self.kept, documents=self.documents, rows=self.rows, files=self.files,
                           doc_tokens=self.doc_tokens, answer_tokens=self.answer_tokens, truncated=self.truncated,
                           slots=slots, packing_efficiency=round(self.doc_tokens / slots, 4) if slots else None)


PAIRS_COLUMN = ("objective dpo: each row is one pair, document 1 the chosen side, document 2 the rejected side "
                "(labels on each final answer)")


def describe(*, seq_len: int, tokenizer: TokenizerSpec, splits: Mapping[str, SplitStats], n_in: int,
             rejected: Mapping[str, int], train_on: str | None, prompt_context: str | None,
             render_sample_documents: int, tokenizer_details: Mapping[str, Any] | None = None,
             split_rule: str | None = None, pad_id: int | None = None, objective: str = "sft",
             decontamination: DecontamInfo | None = None) -> tuple[StageCounts, dict[str, Any]]:
    """(counts, extra) of a train-ready manifest; refuses counts that lose records. `pad_id`: the
    rows' padding id when the tokenizer names none."""
    counts = StageCounts(rows_in=n_in, rows_out=sum(s.kept for s in splits.values()),
                         rejected=dict(sorted(rejected.items()))).require_balanced("[train-ready]")
    total_slots = sum(s.rows for s in splits.values()) * seq_len
    info = TrainReadyInfo(
        seq_len=seq_len,
        tokenizer=tokenizer,
        tokens={s: v.doc_tokens for s, v in splits.items()},
        target_tokens={s: v.answer_tokens for s, v in splits.items()},
        documents={s: v.documents for s, v in splits.items()},
        sequences={s: v.rows for s, v in splits.items()},
        packing_efficiency=round(sum(s.doc_tokens for s in splits.values()) / total_slots, 4) if total_slots else None,
        train_on=train_on,
        prompt_context=prompt_context,
        render_sample_documents=render_sample_documents,
        decontamination=decontamination,
        objective=objective,
    )
    extra = {
        **info.to_extra(),
        "schema": "train-ready",
        "tokenizer_details": dict(tokenizer_details or {}),
        "pad_token_id": tokenizer.pad_id if pad_id is None else pad_id,
        "label_ignore_index": IGNORE_INDEX,
        "columns": {**COLUMNS, **({"pairs": PAIRS_COLUMN} if objective == "dpo" else {})},
        **TrainReadySplits(splits={s: v.as_manifest(seq_len) for s, v in splits.items()}).to_extra(),
        "truncated": sum(s.truncated for s in splits.values()),
    }
    if split_rule is not None:
        extra["split_rule"] = split_rule
    return counts, extra


def document(input_ids: Sequence[int] | np.ndarray, labels: Sequence[int] | np.ndarray, truncated: bool = False) -> Document:
    """A rendered document from its ids and labels (IGNORE_INDEX off the trained tokens)."""
    ids, lab = np.asarray(input_ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)
    n_answer = int(np.count_nonzero(lab != IGNORE_INDEX))
    return Document(ids, lab, len(ids) - n_answer, n_answer, truncated)


def pack_rows(docs: Sequence[Document], seq_len: int, pad_id: int,
              buffers: int | Sequence[int] | None = None) -> list[dict[str, list[int]]]:
    """Production packing (packing.pack) of documents into train-ready rows, one buffer of
    consecutive documents at a time: `buffers` documents each (the filter stage's
    `pack_buffer_docs`), the given buffer sizes in order, or (None) all at once."""
    if buffers is None or isinstance(buffers, int):
        step = buffers or max(1, len(docs))
        buffers = [min(step, len(docs) - at) for at in range(0, len(docs), step)]
    if sum(buffers) != len(docs):
        raise ValueError(f"buffer sizes sum to {sum(buffers)}, not the {len(docs)} documents")
    rows, at = [], 0
    for n in buffers:
        rows += [{"input_ids": a.tolist(), "labels": b.tolist(), "position_ids": c.tolist()}
                 for a, b, c in pack([(d.input_ids, d.labels) for d in docs[at:at + n]], seq_len, pad_id)]
        at += n
    return rows


def write_rows(path: Path, rows: Sequence[Mapping[str, Sequence[int]]]) -> None:
    """Train-ready rows as one Parquet file (list<int32> columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({k: pa.array([list(r[k]) for r in rows], type=pa.list_(pa.int32())) for k in ROW_COLUMNS}),
                   path, compression="zstd")


def stage_train_ready(local_dir: Path, documents: Mapping[str, Sequence[Document]], *, seq_len: int,
                      tokenizer: TokenizerSpec, rejected: Mapping[str, int] | None = None,
                      sample: Sequence[SampleDocument] = (), files: Mapping[str, int] | None = None,
                      train_on: str | None = None, prompt_context: str | None = None,
                      tokenizer_details: Mapping[str, Any] | None = None,
                      split_rule: str | None = None, pad_id: int | None = None,
                      buffers: int | Mapping[str, Sequence[int]] | None = None,
                      objective: str = "sft") -> tuple[dict[str, Any], dict[str, Any]]:
    """Pack each split's documents into `local_dir/data/<split>/part-NNNNN.parquet` (`files[split]`
    files, default one), write the render sample, and return the manifest's (counts, extra).
    `pad_id` overrides the tokenizer's (one that names none: random-token benchmarks); `buffers`
    as `pack_rows` (per split when a mapping: documents made to fill rows exactly stay one row each)."""
    pad_id = tokenizer.pad_id if pad_id is None else pad_id
    if pad_id is None:
        raise ValueError(f"tokenizer {tokenizer.name!r} names no pad_id: pass pad_id, packing needs one")
    stats: dict[str, SplitStats] = {}
    for split, docs in documents.items():
        rows = pack_rows(docs, seq_len, pad_id, buffers.get(split) if isinstance(buffers, Mapping) else buffers)
        n_files = max(1, min((files or {}).get(split, 1), len(rows)))
        per = -(-len(rows) // n_files) if rows else 0
        for i in range(n_files):
            write_rows(local_dir / "data" / split / f"part-{i:05d}.parquet", rows[i * per:(i + 1) * per])
        stats[split] = SplitStats(documents=len(docs), rows=len(rows), files=n_files,
                                  doc_tokens=sum(len(d.input_ids) for d in docs),
                                  answer_tokens=sum(d.n_answer for d in docs), truncated=sum(d.truncated for d in docs))
    if sample:
        write_sample(local_dir, sample)
    rejected = dict(rejected or {})
    n_in = sum(s.documents for s in stats.values()) + sum(rejected.values())
    return describe(seq_len=seq_len, tokenizer=tokenizer, splits=stats, n_in=n_in, rejected=rejected,
                    train_on=train_on, prompt_context=prompt_context, render_sample_documents=len(sample),
                    tokenizer_details=tokenizer_details, split_rule=split_rule, pad_id=pad_id, objective=objective)


def write_train_ready(uri: str, local_dir: Path, documents: Mapping[str, Sequence[Document]], *, seq_len: int,
                      tokenizer: TokenizerSpec, storage=None, inputs: Sequence[str] = (), **options: Any):
    """Rendered documents per split -> a committed train-ready artifact at `uri` (staged in
    `local_dir`); `options` as `stage_train_ready`. Returns the manifest; a committed `uri` with
    the same content is a no-op."""
    from pipeline_core.artifacts import publish_artifact

    counts, extra = stage_train_ready(local_dir, documents, seq_len=seq_len, tokenizer=tokenizer, **options)
    return publish_artifact(local_dir, uri, kind=KIND, counts=counts, extra=extra, storage=storage,
                            inputs=list(inputs))
