"""A sample of a train-ready artifact's documents with the conversations they were rendered from.

The filter keeps, for up to `filter.render_sample_documents` kept documents (the smallest keys:
a deterministic, partitioning-independent pseudo-random sample), the (messages, tools) whose
`apply_chat_template` must give the document's ids (`ChatTokenizer.template_messages`), beside the
ids and labels it packed. The trainer renders them with the exported tokenizer and refuses to
publish a model whose tokenizer does not reproduce them (`training.render_check`). The sample lives
under `data/render_sample/` of the artifact, so it is listed, hashed and verified with the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLE_DIR = "data/render_sample"
SAMPLE_SCHEMA = "id string, split string, chat string, input_ids array<int>, labels array<int>, truncated boolean"


@dataclass(frozen=True)
class SampleDocument:
    id: str
    split: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    input_ids: list[int]  # the packed document (cut at seq_len when `truncated`)
    labels: list[int]  # IGNORE_INDEX off the trained tokens
    truncated: bool


def chat_json(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps({"messages": list(messages), "tools": list(tools) if tools else None}, ensure_ascii=False)


def key_threshold(wanted: int, rows: int) -> int:
    """Keys (uniform signed 64-bit hashes) below this are sample candidates: about 8x `wanted` of
    `rows` (the smallest `wanted` kept keys are almost surely among them), or every key."""
    if rows <= 0 or 8 * wanted >= rows:
        return 2 ** 63
    return -(2 ** 63) + (2 ** 64 * 8 * wanted) // rows


def read_sample(artifact_root: Path) -> Iterator[SampleDocument]:
    """The sample of a fetched (verified) train-ready artifact, in key order; nothing when it has none."""
    import pyarrow.parquet as pq

    for f in sorted((artifact_root / SAMPLE_DIR).glob("*.parquet")):
        for r in pq.read_table(f).to_pylist():
            chat = json.loads(r["chat"])
            yield SampleDocument(r["id"], r["split"], chat["messages"], chat["tools"], r["input_ids"], r["labels"],
                                 bool(r["truncated"]))


def write_sample(artifact_root: Path, docs: Sequence[SampleDocument]) -> None:
    """The sample as one Parquet file (artifacts built outside Spark: tests, benchmarks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = pa.list_(pa.int32())
    table = pa.table({
        "id": pa.array([d.id for d in docs], pa.string()), "split": pa.array([d.split for d in docs], pa.string()),
        "chat": pa.array([chat_json(d.messages, d.tools) for d in docs], pa.string()),
        "input_ids": pa.array([list(d.input_ids) for d in docs], ids),
        "labels": pa.array([list(d.labels) for d in docs], ids),
        "truncated": pa.array([d.truncated for d in docs], pa.bool_()),
    })
    (artifact_root / SAMPLE_DIR).mkdir(parents=True, exist_ok=True)
    pq.write_table(table, artifact_root / SAMPLE_DIR / "part-00000.parquet")
