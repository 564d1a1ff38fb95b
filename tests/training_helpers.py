"""Builders for the trainer tests: a tiny Mistral-architecture model with the real Mistral v1
tokenizer, and small train-ready artifacts in the DESIGN.md contract."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.tiny import TINY_CONFIG, make_tiny_model, mistral_v1_tokenizer_file  # noqa: F401


def pack_documents(docs: list, seq_len: int, pad_id: int) -> list[dict[str, list[int]]]:
    """Production packing (spark_jobs.packing.pack) of `Document`s into train-ready rows."""
    from spark_jobs.packing import pack

    return [{"input_ids": a.tolist(), "labels": b.tolist(), "position_ids": c.tolist()}
            for a, b, c in pack([(d.input_ids, d.labels) for d in docs], seq_len, pad_id)]


def write_rows(path: Path, rows: list[dict[str, list[int]]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({k: pa.array([r[k] for r in rows], type=pa.list_(pa.int32())) for k in
                      ("input_ids", "labels", "position_ids")})
    pq.write_table(table, path)


def tokenized_corpus(n_docs: int, seq_len: int, seed: int = 0) -> list:
    """Short question/answer conversations with learnable structure, rendered by the filter stage's
    own renderer (mistral-common v1) and length limits: a list of `Document`s."""
    return [doc for _, doc in conversation_corpus(n_docs, seq_len, seed)]


def sample_document(tok, conv, doc, doc_id: str, split: str):
    """The render-sample entry the filter keeps for a document (pipeline_core.render_sample)."""
    from pipeline_core.render_sample import SampleDocument

    messages, tools = tok.template_messages(conv)
    return SampleDocument(doc_id, split, messages, tools, doc.input_ids.tolist(), doc.labels.tolist(), doc.truncated)


def conversation_corpus(n_docs: int, seq_len: int, seed: int = 0) -> list:
    """`tokenized_corpus` with each document's conversation: (Conversation, Document) pairs."""
    from spark_jobs.chat_format import load_tokenizer
    from spark_jobs.conversation import Conversation, Turn
    from spark_jobs.packing import LengthLimits, make_document

    tok = load_tokenizer("mistral-v1")
    limits = LengthLimits(seq_len=seq_len, max_tokens=1 << 20, min_answer_tokens=1, overflow="truncate")
    rng = np.random.default_rng(seed)
    animals = ["cat", "dog", "owl", "fox", "bee", "cow"]
    colors = ["red", "blue", "green", "black"]
    docs = []
    for _ in range(n_docs):
        a, c = animals[rng.integers(len(animals))], colors[rng.integers(len(colors))]
        conv = Conversation(None, (Turn("user", f"What colour is the {a}?"),
                                   Turn("assistant", f"The {a} is {c}. The {c} {a} sleeps.")))
        r = tok.render(conv)
        docs.append((conv, make_document(r.input_ids, r.targets, limits, tok.eos_id)))
    return docs


def build_train_ready(root_uri: str, local_dir: Path, *, seq_len: int, n_train_docs: int, n_val_docs: int,
                      storage=None, files: int = 2) -> str:
    """Write data/train/*.parquet + data/val/*.parquet and publish them as a train-ready artifact."""
    from pipeline_core import uris
    from pipeline_core.artifacts import publish_artifact
    from pipeline_core.render_sample import write_sample
    from spark_jobs.chat_format import load_tokenizer

    tok = load_tokenizer("mistral-v1")
    pairs = conversation_corpus(n_train_docs + n_val_docs, seq_len)
    docs = [d for _, d in pairs]
    train = pack_documents(docs[:n_train_docs], seq_len, tok.pad_id)
    val = pack_documents(docs[n_train_docs:], seq_len, tok.pad_id)
    per = -(-len(train) // files)
    for i in range(files):
        write_rows(local_dir / "data" / "train" / f"part-{i:05d}.parquet", train[i * per:(i + 1) * per])
    write_rows(local_dir / "data" / "val" / "part-00000.parquet", val)
    sample = [sample_document(tok, c, d, f"doc-{i}", "train" if i < n_train_docs else "val")
              for i, (c, d) in enumerate(pairs)]
    write_sample(local_dir, sample)
    uri = uris.join(root_uri, "datasets", "test", "train", "cfg0")
    publish_artifact(local_dir, uri, kind="train-ready", counts={"in": len(train) + len(val),
                     "out": len(train) + len(val)}, extra=_info(tok, seq_len, len(sample)),
                     storage=storage)
    return uri


def _info(tok, seq_len: int, sample_documents: int = 0) -> dict:
    from pipeline_core.handoffs import TrainReadyInfo

    return TrainReadyInfo(seq_len=seq_len, tokenizer=tok.spec_for_manifest(), train_on="all_assistant_turns",
                          prompt_context="conversation", render_sample_documents=sample_documents).to_extra()


def sample_train_ready(root_uri: str, local_dir: Path, *, seq_len: int, storage=None, val_every: int = 10) -> str:
    """A train-ready artifact from the bundled Nemotron sample, made with the filter stage's own
    normalisation, conversation rendering (Mistral v1), length limits and packing (without Spark or
    the similarity filter): every 10th record goes to val, over-long conversations are truncated."""
    import glob
    import json

    import pyarrow.parquet as pq

    from pipeline_core import uris
    from pipeline_core.artifacts import publish_artifact
    from pipeline_core.config import PROJECT_ROOT, EnrichSection
    from pipeline_core.render_sample import write_sample
    from spark_jobs.chat_format import load_tokenizer
    from spark_jobs.conversation import ConversationOptions, RenderError, build_conversation
    from spark_jobs.enrich import normalise_raw
    from spark_jobs.packing import Document, LengthLimits, make_document

    tok = load_tokenizer("mistral-v1")
    limits = LengthLimits(seq_len=seq_len, max_tokens=1 << 20, min_answer_tokens=1, overflow="truncate")
    docs: dict[str, list] = {"train": [], "val": []}
    sample = []
    n = 0
    for f in sorted(glob.glob(str(PROJECT_ROOT / "sample_data" / "nemotron_v1" / "data" / "*.parquet"))):
        for rec in pq.read_table(f).to_pylist():
            msgs = None if rec["messages"] is None else json.dumps(rec["messages"])
            if normalise_raw(rec["uuid"], msgs, None, EnrichSection())["reason"] is not None:
                continue
            try:
                conv = build_conversation(rec["messages"], rec["metadata"], rec["reasoning"], ConversationOptions())
                r = tok.render(conv)
            except RenderError:
                continue
            doc = make_document(r.input_ids, r.targets, limits, tok.eos_id)
            if isinstance(doc, Document):
                split = "val" if n % val_every == 0 else "train"
                docs[split].append(doc)
                sample.append(sample_document(tok, conv, doc, rec["uuid"], split))
                n += 1
    for split, items in docs.items():
        write_rows(local_dir / "data" / split / "part-00000.parquet", pack_documents(items, seq_len, tok.pad_id))
    write_sample(local_dir, sample)  # every document: the trainer's export check renders them all
    uri = uris.join(root_uri, "datasets", "sample", "train", f"seq{seq_len}")
    total = sum(len(v) for v in docs.values())
    publish_artifact(local_dir, uri, kind="train-ready", counts={"in": total, "out": total},
                     extra=_info(tok, seq_len, len(sample)), storage=storage)
    return uri


# ----------------------------------------------------------------------------- launching train.py
# One launcher for the e2e test (2 CPU processes) and bench/trainer_gpu_run.py (1 GPU).
REPO = Path(__file__).resolve().parents[1]


def train_env(extra: dict[str, str] | None = None, *, cpu: bool) -> dict[str, str]:
    """The environment train.py runs under: the caller's, unbuffered, no hub; on CPU DeepSpeed's
    CPU accelerator with one thread and the fixed extension cache."""
    import os

    env = {**os.environ, **(extra or {}), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if cpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"))
    return env


def train_cmd(input_uri: str, run_uri: str, cfg_path: Path, nproc: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(REPO / "training" / "train.py"), "--input", input_uri, "--output", run_uri, "--config", str(cfg_path)]


def kill_tree(proc) -> None:
    """SIGKILL torchrun and its workers (they run in their own sessions), like a lost node."""
    import signal

    import psutil

    procs = [psutil.Process(proc.pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(procs, timeout=30)
