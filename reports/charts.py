"""The data report's pictures (matplotlib, Agg backend, PNG files without timestamps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline_core.names import Split
from reports.facts import SIM_COLUMNS, ReportFacts

SIM_TITLES = {"sim_question_answer": "question ↔ answer", "sim_context_question": "context ↔ question",
              "sim_context_answer": "context ↔ answer"}
KEPT, ALL, LINE = "#2b7bba", "#c7c7c7", "#d62728"
_PNG_META = {"Software": None}  # byte-identical reruns: no version/timestamp chunks


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100, metadata=_PNG_META)
    _plt().close(fig)
    return path


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_xticks([])
    ax.set_yticks([])


def rejects(facts: ReportFacts, path: Path) -> Path:
    plt = _plt()
    reasons = sorted(facts.rejects_by_split)
    splits = sorted({s for v in facts.rejects_by_split.values() for s in v})
    fig, ax = plt.subplots(figsize=(8, 0.5 * max(3, len(reasons)) + 1))
    if not reasons:
        _empty(ax, "no rejects")
    left = np.zeros(len(reasons))
    for split, colour in zip(splits, ("#2b7bba", "#ff7f0e", "#8c8c8c", "#2ca02c"), strict=False):
        vals = np.array([facts.rejects_by_split[r].get(split, 0) for r in reasons], dtype=float)
        ax.barh(reasons, vals, left=left, label=split, color=colour)
        left += vals
    for y, total in enumerate(left):
        ax.text(total, y, f" {int(total)}", va="center")
    ax.set_xlabel("records rejected")
    ax.set_title("Reject reasons per split (stage:reason)")
    if splits:
        ax.legend(title="split", loc="lower right")
    return _save(fig, path)


def similarities(facts: ReportFacts, path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    bins = np.linspace(-0.2, 1.0, 49)
    for ax, col in zip(axes, SIM_COLUMNS, strict=True):
        values, kept = facts.similarities.get(col, np.array([])), facts.similarity_kept.get(col, np.array([]))
        if values.size == 0:
            _empty(ax, "no values (no context?)")
        else:
            ax.hist(values, bins=bins, color=ALL, label=f"enriched ({values.size})")
            ax.hist(kept, bins=bins, color=KEPT, label=f"kept by the filter ({kept.size})")
        threshold = facts.thresholds.get(col)
        if threshold is not None:
            ax.axvline(threshold, color=LINE, linestyle="--", label=f"threshold {threshold:g}")
        ax.set_title(SIM_TITLES[col])
        ax.set_xlabel("cosine similarity")
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("records")
    return _save(fig, path)


def near_duplicates(facts: ReportFacts, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    scores = facts.near_duplicate_scores
    if scores.size == 0:
        _empty(ax, "no near-duplicate rejects")
    else:
        ax.hist(scores, bins=np.linspace(min(scores.min(), 0.9), 1.0, 26), color=KEPT)
    t = facts.thresholds.get("near_dup_threshold")
    if t is not None:
        ax.axvline(t, color=LINE, linestyle="--", label=f"near_dup_threshold {t:g}")
        ax.legend(loc="upper left")
    ax.set_title("Dropped near-duplicates: cosine to the kept record")
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("records")
    return _save(fig, path)


def document_lengths(facts: ReportFacts, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    seq_len = facts.headline.seq_len
    bins = np.linspace(0, seq_len, 33)
    drawn = False
    for split, colour in ((Split.TRAIN, KEPT), (Split.VAL, "#ff7f0e")):
        lengths = facts.doc_lengths.get(split, np.array([]))
        if lengths.size:
            ax.hist(lengths, bins=bins, alpha=0.75, color=colour, label=f"{split} ({lengths.size} docs)")
            drawn = True
    if not drawn:
        _empty(ax, "no packed documents")
    ax.axvline(seq_len, color=LINE, linestyle="--", label=f"seq_len {seq_len}")
    eff = facts.headline.packing_efficiency
    ax.set_title(f"Document lengths (packing efficiency {eff:.1%})" if eff is not None else "Document lengths")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    ax.legend(loc="upper right")
    return _save(fig, path)


def tokens(facts: ReportFacts, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    splits = sorted(facts.headline.tokens)
    x = np.arange(len(splits))
    tok = [facts.headline.tokens[s] for s in splits]
    tgt = [facts.headline.target_tokens.get(s, 0) for s in splits]
    ax.bar(x - 0.2, tok, 0.4, label="tokens", color=ALL)
    ax.bar(x + 0.2, tgt, 0.4, label="trained (loss) tokens", color=KEPT)
    for xi, (a, b) in enumerate(zip(tok, tgt, strict=True)):
        ax.text(xi - 0.2, a, f"{a:,}", ha="center", va="bottom", fontsize=8)
        ax.text(xi + 0.2, b, f"{b:,}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, splits)
    ax.set_title("Tokens per split")
    ax.legend()
    return _save(fig, path)


ALL_CHARTS = {"rejects": rejects, "similarity": similarities, "near_duplicates": near_duplicates,
              "document_lengths": document_lengths, "tokens": tokens}


def draw_all(facts: ReportFacts, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return {name: draw(facts, out_dir / f"{name}.png") for name, draw in ALL_CHARTS.items()}
