"""What the data report shows, read from committed artifacts only (manifests, rejects, data).

`collect` turns a train-ready artifact and the enriched artifact it came from into `ReportFacts`:
plain numbers and small samples, no pictures. The charts and the page are drawn from these
(`charts.py`, `page.py`), and the approval gate's headline is `ReportFacts.headline`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from pipeline_core.artifacts import Manifest
from pipeline_core.handoffs import (
    IGNORE_INDEX,
    DecontamInfo,
    EnrichedInfo,
    FilterSourceSplits,
    Headline,
    LengthFit,
    NearDupSummary,
    PromptSourceOutcome,
    SplitAccount,
    TrainReadyInfo,
    TrainReadySplits,
)

SIM_COLUMNS = ("sim_question_answer", "sim_context_question", "sim_context_answer")
NEAR_DUPLICATE = "near_duplicate"
NO_SPLIT = "unsplit"  # rejects without an id cannot be placed in a split
# "near duplicate of <id> (similarity 0.9876)": the filter's detail text until rejects carry
# `duplicate_of` and `score` fields of their own (both are read first when present)
_NEAR_DETAIL = re.compile(r"near duplicate of (?P<of>\S+) \(similarity (?P<score>-?[0-9.]+)\)")


@dataclass(frozen=True)
class NearDuplicate:
    id: str
    question: str
    duplicate_of: str | None
    duplicate_question: str | None
    score: float | None


@dataclass(frozen=True)
class GuardSplit:
    """One split's near-duplicate decisions (issue 27): the pairs the guard kept apart (both rows
    stay: they differ in numbers, code or final answer) and the pairs dropped as the same example."""

    split: str
    saved_pairs: int
    dropped: int
    saved_examples: list[NearDuplicate]
    dropped_examples: list[NearDuplicate]


@dataclass(frozen=True)
class Span:
    text: str
    trained: bool


@dataclass
class ReportFacts:
    dataset_version: str
    train_ready_uri: str
    enriched_uri: str
    headline: Headline
    rejects_by_split: dict[str, dict[str, int]]  # "<stage>:<reason>" -> split -> count
    similarities: dict[str, np.ndarray]  # column -> values of the enriched rows (NaN dropped)
    similarity_kept: dict[str, np.ndarray]  # column -> values of the rows the filter kept
    thresholds: dict[str, float | None]
    near_duplicates: list[NearDuplicate]
    near_duplicate_scores: np.ndarray
    doc_lengths: dict[str, np.ndarray]  # split -> packed document lengths (tokens)
    doc_lengths_sampled_rows: dict[str, int]
    packing_by_split: dict[str, float | None]
    example: list[Span] = field(default_factory=list)
    example_split: str | None = None
    decontamination: DecontamInfo | None = None  # the eval sets the filter matched against, rows removed per set
    near_dup_guard: str | None = None  # the filter's near_dup_guard; None: manifest from before issue 27
    guard_by_split: list[GuardSplit] = field(default_factory=list)
    length_fit: LengthFit | None = None  # the manifest's length_fit (issue 29)
    # per input split (issue 28): enrich's rows in / rejects, the filter's rejects and seq_len fit
    source_splits: dict[str, SplitAccount] = field(default_factory=dict)
    prompt_sources: dict[str, PromptSourceOutcome] = field(default_factory=dict)  # enrich's restored / unrestorable
    withheld_without_key: int = 0  # enrich's prompt_withheld rejects: no seed key (v1 "-" / empty prompts)

    def to_extra(self) -> dict[str, Any]:
        return {"headline": self.headline.to_json_dict(), "dataset_version": self.dataset_version,
                "thresholds": self.thresholds, "near_duplicates_shown": len(self.near_duplicates),
                "decontamination": self.decontamination.model_dump(mode="json") if self.decontamination else None,
                "near_dup_guard": self.near_dup_guard,
                "guard_saved_pairs_by_split": {g.split: g.saved_pairs for g in self.guard_by_split},
                "source_splits": {k: v.to_json_dict() for k, v in self.source_splits.items()},
                "withheld_without_key": self.withheld_without_key,
                "prompt_sources": {k: {"restored": v.restored, "unrestorable": v.unrestorable}
                                   for k, v in self.prompt_sources.items()}}


def source_split_rows(enriched: Manifest, train_ready: Manifest) -> dict[str, SplitAccount]:
    """Per input split: rows in, rejects by "<stage>:<reason>", kept, and how many rendered
    conversations fit seq_len with and without reasoning (the filter's `extra.source_splits`)."""
    out: dict[str, SplitAccount] = {}
    for split, c in EnrichedInfo.from_manifest(enriched).splits.items():
        out[split or "(unnamed)"] = SplitAccount(rows_in=c.rows_in, rejected={f"enrich:{r}": n for r, n in c.rejected.items()})
    for split, f in FilterSourceSplits.from_manifest(train_ready).source_splits.items():
        row = out.get(split or "(unnamed)") or SplitAccount(rows_in=f.rows_in)
        out[split or "(unnamed)"] = SplitAccount(
            rows_in=row.rows_in, rejected={**row.rejected, **{f"filter:{r}": n for r, n in f.rejected.items()}},
            kept=f.rows_out, measured=f.measured, fit_with=f.fit_seq_len_with_reasoning,
            fit_without=f.fit_seq_len_without_reasoning)
    return dict(sorted(out.items()))



def split_tokens(manifest: Manifest, info: TrainReadyInfo | None) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(tokens, target tokens, documents) per split, from the typed hand-off or the older extra."""
    splits = TrainReadySplits.from_manifest(manifest).splits
    tokens = dict(info.tokens) if info and info.tokens else {s: v.doc_tokens for s, v in splits.items()}
    targets = dict(info.target_tokens) if info and info.target_tokens else {s: v.answer_tokens for s, v in splits.items()}
    docs = dict(info.documents) if info and info.documents else {s: v.documents for s, v in splits.items()}
    return tokens, targets, docs


def read_table(files: list[Path], columns: list[str]) -> dict[str, list]:
    out: dict[str, list] = {c: [] for c in columns}
    for f in files:
        names = set(pq.ParquetFile(f).schema_arrow.names)
        t = pq.read_table(f, columns=[c for c in columns if c in names])
        for c in columns:
            out[c].extend(t.column(c).to_pylist() if c in names else [None] * t.num_rows)
    return out


def reject_rows(files: list[Path]) -> list[dict[str, Any]]:
    t = read_table(files, ["id", "stage", "reason", "raw"])
    return [dict(zip(t, vals, strict=True)) for vals in zip(*t.values(), strict=True)]


def _raw(row: dict[str, Any]) -> dict[str, Any]:
    try:
        raw = json.loads(row["raw"] or "{}")
    except ValueError:
        return {}
    return raw if isinstance(raw, dict) else {}


def near_duplicate_of(row: dict[str, Any]) -> tuple[str | None, float | None]:
    """(partner id, cosine) of a near-duplicate reject: typed fields first, else the detail text."""
    raw = _raw(row)
    of, score = raw.get("duplicate_of"), raw.get("score")
    if of is None or score is None:
        m = _NEAR_DETAIL.search(str(raw.get("detail") or ""))
        if m:
            of, score = of or m["of"], score if score is not None else float(m["score"])
    return (None if of is None else str(of)), (None if score is None else float(score))


def split_of_id(record_id: str | None, seed: int, val_fraction: float) -> str:
    from spark_jobs.filter.split import split_of  # the filter's own rule (pure Python twin)

    return NO_SPLIT if not record_id else split_of(record_id, seed, val_fraction)


def document_lengths(position_ids: list[list[int]], labels: list[list[int]]) -> np.ndarray:
    """Lengths of the packed documents (the trailing padding segment, without targets, excluded)."""
    from spark_jobs.packing import split_documents

    out = []
    for pos, lab in zip(position_ids, labels, strict=True):
        lab_a = np.asarray(lab)
        for s, e in split_documents(np.asarray(pos)):
            if (lab_a[s:e] != IGNORE_INDEX).any():
                out.append(e - s)
    return np.asarray(out, dtype=np.int64)


def mask_spans(ids: list[int], labels: list[int], decode) -> list[Span]:
    """The document as text runs, each marked trained (labels != -100) or not. Each run is the
    difference of two prefix decodes, so SentencePiece spacing stays exact at run boundaries."""
    trained = [lab != IGNORE_INDEX for lab in labels]
    bounds = [0] + [i for i in range(1, len(ids)) if trained[i] != trained[i - 1]] + [len(ids)]
    spans, prev = [], ""
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        text = decode(ids[:e])
        spans.append(Span(text[len(prev):] if text.startswith(prev) else decode(ids[s:e]), trained[s]))
        prev = text
    return spans


def richest_document(input_ids: list[list[int]], labels: list[list[int]], position_ids: list[list[int]],
                     max_tokens: int = 768) -> tuple[list[int], list[int]] | None:
    """The document with the most separate trained spans (the most assistant turns), shortest first
    among equals, so the example shows a multi-turn loss mask whenever the data has one."""
    from spark_jobs.packing import split_documents

    best, best_key = None, None
    for ids, lab, pos in zip(input_ids, labels, position_ids, strict=True):
        lab_a = np.asarray(lab)
        for s, e in split_documents(np.asarray(pos)):
            seg = lab_a[s:e] != IGNORE_INDEX
            if not seg.any() or e - s > max_tokens:
                continue
            runs = int(seg[0]) + int(np.count_nonzero(seg[1:] & ~seg[:-1]))
            key = (-runs, e - s)
            if best_key is None or key < best_key:
                best, best_key = (list(ids[s:e]), list(lab[s:e])), key
    return best


def guard_by_split(near: NearDupSummary | None, dropped: list[NearDuplicate], split_of: dict[str, str],
                   question_of: dict[str, str], examples: int) -> list[GuardSplit]:
    """Per split: the guard-saved pair count and examples (the filter manifest's
    `extra.near_duplicates`) beside the dropped pairs (the near-duplicate rejects)."""
    counts = (near.guard_saved_by_split if near else None) or {}
    saved: dict[str, list[NearDuplicate]] = {}
    for e in near.guard_saved_examples if near else []:
        saved.setdefault(e.split, []).append(NearDuplicate(
            id=e.id, question=question_of.get(e.id) or "", duplicate_of=e.other_id,
            duplicate_question=question_of.get(e.other_id), score=e.similarity))
    gone: dict[str, list[NearDuplicate]] = {}
    for d in dropped:
        gone.setdefault(split_of.get(d.id, NO_SPLIT), []).append(d)
    # counts by the filter's own split rule (prompt key) when the manifest has them
    n_gone = (near.dropped_by_split if near else None) or {s: len(v) for s, v in gone.items()}
    return [GuardSplit(split=s, saved_pairs=int(counts.get(s, 0)), dropped=int(n_gone.get(s, 0)),
                       saved_examples=saved.get(s, [])[:examples], dropped_examples=gone.get(s, [])[:examples])
            for s in sorted(set(counts) | set(saved) | set(n_gone) | set(gone))]
