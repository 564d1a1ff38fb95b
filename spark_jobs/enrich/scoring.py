"""Cosine similarities and relevant-sentence selection on normalised embeddings (pure numpy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScoringParams:
    top_k: int = 5
    threshold: float = 0.2
    question_weight: float = 0.5
    answer_weight: float = 0.5


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


def score_record(q: np.ndarray, a: np.ndarray, sentences: np.ndarray, p: ScoringParams) -> dict:
    """`q`, `a`: unit vectors (d,); `sentences`: unit vectors (n, d), n may be 0.

    The context's vector is the re-normalised mean of its sentence vectors. Each sentence scores
    the weighted mean of its cosine to the question and to the answer; the top-k sentences whose
    score reaches the threshold are kept, in context order."""
    out = {"sim_question_answer": float(q @ a), "sim_context_question": None, "sim_context_answer": None,
           "relevant_sentences": []}
    if len(sentences) == 0:
        return out
    ctx = _unit(sentences.mean(axis=0))
    out["sim_context_question"] = float(ctx @ q)
    out["sim_context_answer"] = float(ctx @ a)
    scores = (p.question_weight * (sentences @ q) + p.answer_weight * (sentences @ a)) / (
        p.question_weight + p.answer_weight
    )
    order = np.argsort(-scores, kind="stable")[: p.top_k]
    keep = sorted(int(i) for i in order if scores[i] >= p.threshold)
    out["relevant_sentences"] = [(i, float(scores[i])) for i in keep]
    return out
