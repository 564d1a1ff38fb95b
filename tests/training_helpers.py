"""Builders for the trainer tests: a tiny Mistral-architecture model with the real Mistral v1
tokenizer, and small train-ready artifacts in the DESIGN.md contract."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.tiny import TINY_CONFIG, make_tiny_model, mistral_v1_tokenizer_file  # noqa: F401


def pack_documents(docs: list[list[int]], prompt_lens: list[int], seq_len: int) -> list[dict[str, list[int]]]:
    """Greedy packing into rows of seq_len: labels -100 on prompt and padding, positions restart per doc."""
    rows, cur = [], {"input_ids": [], "labels": [], "position_ids": []}

    def flush():
        pad = seq_len - len(cur["input_ids"])
        cur["input_ids"] += [0] * pad
        cur["labels"] += [-100] * pad
        cur["position_ids"] += list(range(pad))  # padding forms its own (masked) document
        rows.append({k: list(v) for k, v in cur.items()})
        for v in cur.values():
            v.clear()

    for doc, plen in zip(docs, prompt_lens, strict=True):
        doc = doc[:seq_len]
        if len(cur["input_ids"]) + len(doc) > seq_len:
            flush()
        cur["input_ids"] += doc
        cur["labels"] += [-100] * plen + doc[plen:]
        cur["position_ids"] += list(range(len(doc)))
    if cur["input_ids"]:
        flush()
    return rows


def write_rows(path: Path, rows: list[dict[str, list[int]]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({k: pa.array([r[k] for r in rows], type=pa.list_(pa.int32())) for k in
                      ("input_ids", "labels", "position_ids")})
    pq.write_table(table, path)


def tokenized_corpus(n_docs: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Short prompt/answer documents with learnable structure, tokenized with the real tokenizer."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(mistral_v1_tokenizer_file()))
    rng = np.random.default_rng(seed)
    animals = ["cat", "dog", "owl", "fox", "bee", "cow"]
    colors = ["red", "blue", "green", "black"]
    docs, plens = [], []
    for _ in range(n_docs):
        a, c = animals[rng.integers(len(animals))], colors[rng.integers(len(colors))]
        prompt = sp.encode(f"[INST] What colour is the {a}? [/INST]")
        answer = sp.encode(f" The {a} is {c}. The {c} {a} sleeps.") + [2]
        docs.append([1] + prompt + answer)
        plens.append(1 + len(prompt))
    return docs, plens


def build_train_ready(root_uri: str, local_dir: Path, *, seq_len: int, n_train_docs: int, n_val_docs: int,
                      storage=None, files: int = 2) -> str:
    """Write data/train/*.parquet + data/val/*.parquet and publish them as a train-ready artifact."""
    from pipeline_core import uris
    from pipeline_core.artifacts import publish_artifact

    docs, plens = tokenized_corpus(n_train_docs + n_val_docs)
    train = pack_documents(docs[:n_train_docs], plens[:n_train_docs], seq_len)
    val = pack_documents(docs[n_train_docs:], plens[n_train_docs:], seq_len)
    per = -(-len(train) // files)
    for i in range(files):
        write_rows(local_dir / "data" / "train" / f"part-{i:05d}.parquet", train[i * per:(i + 1) * per])
    write_rows(local_dir / "data" / "val" / "part-00000.parquet", val)
    uri = uris.join(root_uri, "datasets", "test", "train", "cfg0")
    publish_artifact(local_dir, uri, kind="train-ready", counts={"in": len(train) + len(val),
                     "out": len(train) + len(val)}, extra={"seq_len": seq_len, "tokenizer": "mistral-v1"},
                     storage=storage)
    return uri


def sample_train_ready(root_uri: str, local_dir: Path, *, seq_len: int, storage=None, val_every: int = 10) -> str:
    """A train-ready artifact from the bundled Nemotron sample, made with the filter stage's own
    normalisation, Mistral v1 chat template/tokenizer and packing (without Spark or the similarity
    filter): every 10th record goes to val, over-long answers are truncated."""
    import glob

    import pyarrow.parquet as pq

    from pipeline_core import uris
    from pipeline_core.artifacts import publish_artifact
    from pipeline_core.config import PROJECT_ROOT
    from spark_jobs.chat_format import MistralCommonTokenizer, render
    from spark_jobs.normalize import Rejected, normalise
    from spark_jobs.packing import Document, LengthLimits, make_document, pack

    tok = MistralCommonTokenizer("mistral-v1")
    limits = LengthLimits(seq_len=seq_len, max_tokens=1 << 20, min_answer_tokens=1, overflow="truncate")
    docs: dict[str, list] = {"train": [], "val": []}
    n = 0
    for f in sorted(glob.glob(str(PROJECT_ROOT / "sample_data" / "nemotron_v1" / "data" / "*.parquet"))):
        for rec in pq.read_table(f, columns=["messages"]).to_pylist():
            try:
                norm = normalise(rec["messages"])
            except Rejected:
                continue
            doc = make_document(*tok.encode(*render(None, norm.question, norm.answer)), limits, tok.eos_id)
            if isinstance(doc, Document):
                docs["val" if n % val_every == 0 else "train"].append((doc.input_ids, doc.labels))
                n += 1
    for split, items in docs.items():
        rows = [{"input_ids": a.tolist(), "labels": b.tolist(), "position_ids": c.tolist()}
                for a, b, c in pack(items, seq_len, tok.pad_id)]
        write_rows(local_dir / "data" / split / "part-00000.parquet", rows)
    uri = uris.join(root_uri, "datasets", "sample", "train", f"seq{seq_len}")
    total = sum(len(v) for v in docs.values())
    publish_artifact(local_dir, uri, kind="train-ready", counts={"in": total, "out": total},
                     extra={"seq_len": seq_len, **tok.identity()}, storage=storage)
    return uri
