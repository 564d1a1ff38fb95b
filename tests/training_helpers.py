"""Builders for the trainer tests: a tiny Mistral-architecture model with the real Mistral v1
tokenizer, and small train-ready artifacts in the DESIGN.md contract."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.tiny import TINY_CONFIG, make_tiny_model, mistral_v1_tokenizer_file  # noqa: F401


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
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.conversations.conversation import Conversation, Turn
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
    """A committed train-ready artifact of `conversation_corpus` (the product writer, train_ready.py)."""
    from pipeline_core import uris
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.filter.train_ready import write_train_ready

    tok = load_tokenizer("mistral-v1")
    pairs = conversation_corpus(n_train_docs + n_val_docs, seq_len)
    docs = [d for _, d in pairs]
    sample = [sample_document(tok, c, d, f"doc-{i}", "train" if i < n_train_docs else "val")
              for i, (c, d) in enumerate(pairs)]
    uri = uris.join(root_uri, "datasets", "test", "train", "cfg0")
    write_train_ready(uri, local_dir, {"train": docs[:n_train_docs], "val": docs[n_train_docs:]}, seq_len=seq_len,
                      tokenizer=tok.spec_for_manifest(), sample=sample, files={"train": files}, storage=storage,
                      **_options(tok))
    return uri


def _options(tok) -> dict:
    from pipeline_core.config import FilterSection

    return {"train_on": FilterSection().train_on, "prompt_context": FilterSection().prompt_context,
            "tokenizer_details": tok.identity()}


def sample_train_ready(root_uri: str, local_dir: Path, *, seq_len: int, storage=None, val_every: int = 10) -> str:
    """A train-ready artifact from the bundled Nemotron sample, made with the filter stage's own
    normalisation, conversation rendering (Mistral v1), length limits and the product writer
    (train_ready.py; without Spark or the similarity filter): every 10th kept record goes to val,
    over-long conversations are truncated, the records dropped are counted by reason."""
    import glob
    import json

    import pyarrow.parquet as pq

    from pipeline_core import uris
    from pipeline_core.config import PROJECT_ROOT, EnrichSection
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.conversations.conversation import ConversationOptions, RenderError, build_conversation
    from spark_jobs.enrich.job import normalise_raw
    from spark_jobs.filter.train_ready import write_train_ready
    from spark_jobs.packing import Document, LengthLimits, make_document

    tok = load_tokenizer("mistral-v1")
    limits = LengthLimits(seq_len=seq_len, max_tokens=1 << 20, min_answer_tokens=1, overflow="truncate")
    docs: dict[str, list] = {"train": [], "val": []}
    rejected: dict[str, int] = {}
    sample = []
    n = 0
    for f in sorted(glob.glob(str(PROJECT_ROOT / "sample_data" / "nemotron_v1" / "data" / "*.parquet"))):
        for rec in pq.read_table(f).to_pylist():
            msgs = None if rec["messages"] is None else json.dumps(rec["messages"])
            reason = normalise_raw(rec["uuid"], msgs, None, EnrichSection())["reason"]
            if reason is None:
                try:
                    conv = build_conversation(rec["messages"], rec["metadata"], rec["reasoning"], ConversationOptions())
                    r = tok.render(conv)
                except RenderError as e:
                    reason = e.reason
            if reason is None:
                doc = make_document(r.input_ids, r.targets, limits, tok.eos_id)
                reason = None if isinstance(doc, Document) else doc[0]
            if reason is not None:
                rejected[reason] = rejected.get(reason, 0) + 1
                continue
            split = "val" if n % val_every == 0 else "train"
            docs[split].append(doc)
            sample.append(sample_document(tok, conv, doc, rec["uuid"], split))  # every document: the
            n += 1  # trainer's export check renders them all
    uri = uris.join(root_uri, "datasets", "sample", "train", f"seq{seq_len}")
    write_train_ready(uri, local_dir, docs, seq_len=seq_len, tokenizer=tok.spec_for_manifest(), rejected=rejected,
                      sample=sample, storage=storage, split_rule=f"every {val_every}th kept record to val",
                      **_options(tok))
    return uri


def causal_lm_loss(logits, targets):
    """Mean cross-entropy over one micro-batch's targets: the reference the model and GPU checks compare
    with (the trainer's step loss is training.loss.TokenMeanLoss). A micro-batch without any target gives
    0, not NaN."""
    from pipeline_core.handoffs import IGNORE_INDEX
    from training.model import causal_lm_loss_sum

    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    return causal_lm_loss_sum(logits, targets) / count


def load_model_config(model_dir: Path):
    """The MistralConfig of a saved model directory (the tests' tiny models)."""
    from transformers import AutoConfig, MistralConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    if not isinstance(config, MistralConfig):
        raise ValueError(f"{model_dir} is a {type(config).__name__}, expected a MistralConfig")
    return config
