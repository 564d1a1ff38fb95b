"""The bundled sample through the real enrich and filter stages (Spark local[2]) into a store, and
small real models for the promotion tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline_core import layout, uris
from pipeline_core.config import Config, load_config
from pipeline_core.handoffs import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "nemotron_v1"


@dataclass(frozen=True)
class SampleArtifacts:
    cfg: Config
    enriched_uri: str
    train_ready_uri: str


def sample_config(store_uri: str, staging: Path, **overrides) -> Config:
    return load_config(env={}, overrides={
        "pipeline.store_uri": store_uri, "pipeline.staging_uri": uris.qualify(staging),
        "pipeline.source_uri": uris.qualify(SAMPLE), "pipeline.dataset_version": "sample",
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2},
        "filter": {"spark_master": "local[2]", "shuffle_partitions": 2, "seq_len": 256, "val_fraction": 0.2},
        "train": {"seq_len": 256},
        **overrides,
    })


def build_sample(store_uri: str, staging: Path, spark=None) -> SampleArtifacts:
    """enrich + filter of the bundled sample (a committed output is reused: both are idempotent)."""
    from spark_jobs.common import spark_session
    from spark_jobs.enrich import job as enrich
    from spark_jobs.filter import job as similarity_filter

    cfg = sample_config(store_uri, staging)
    own = spark is None
    if own:
        spark = spark_session("test-report", "local[2]", 2, {"spark.ui.enabled": "false",
                                                             "spark.sql.execution.arrow.maxRecordsPerBatch": "512"})
    try:
        enriched, train_ready = layout.enriched_uri(cfg), layout.train_ready_uri(cfg)
        enrich.run(cfg.pipeline.source_uri, enriched, cfg, spark=spark)
        similarity_filter.run(enriched, train_ready, cfg, spark=spark)
    finally:
        if own:
            spark.stop()
    return SampleArtifacts(cfg, enriched, train_ready)


SEQ = 48


def row_documents(n_rows: int, seed: int = 0) -> list:
    """Two documents per SEQ-token row (prompt half masked, answer trained), in row order."""
    import numpy as np

    from spark_jobs.filter.train_ready import document

    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_rows):
        for n in (20, 18):
            doc = [1, *rng.integers(3, 32000, n - 1).tolist()]
            docs.append(document(doc, [IGNORE_INDEX] * (n // 2) + doc[n // 2:]))
    return docs


def packed_rows(n_rows: int, seed: int = 0):
    """A pyarrow table of SEQ-token rows, two documents each (`row_documents`) + padding, packed
    by the product (each row's pair is one packing buffer: the longer document first)."""
    import pyarrow as pa

    from spark_jobs.filter.train_ready import ROW_COLUMNS, pack_rows

    rows = pack_rows(row_documents(n_rows, seed), SEQ, 0, [2] * n_rows)
    return pa.table({k: pa.array([r[k] for r in rows], pa.list_(pa.int32())) for k in ROW_COLUMNS})


def val_artifact(local_dir: Path, uri: str, storage=None, inputs=()) -> str:
    """A committed train-ready artifact holding only a val split of `packed_rows(4)` (the product writer)."""
    from pipeline_core.handoffs import TokenizerSpec
    from spark_jobs.filter.train_ready import write_train_ready

    write_train_ready(uri, local_dir, {"val": row_documents(4)}, seq_len=SEQ, pad_id=0, buffers=2,
                      tokenizer=TokenizerSpec(name="mistral-v1", vocab_size=32000, bos_id=1, eos_id=2),
                      storage=storage, inputs=inputs)
    return uri


def tiny_models(root: Path) -> dict[str, Path]:
    """Model artifact directories (`<dir>/data/` = save_pretrained): 'good' is a seeded random tiny
    Mistral; 'bad' the same with a sharpened LM head (confidently wrong, a higher val loss)."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.tiny import make_tiny_model

    good = make_tiny_model(root / "good" / "data", max_shard_size=None)
    m = AutoModelForCausalLM.from_pretrained(str(good))
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    bad = root / "bad" / "data"
    m.save_pretrained(str(bad))
    for f in good.iterdir():
        if f.name.startswith("tokenizer"):
            (bad / f.name).write_bytes(f.read_bytes())
    return {"good": good.parent, "bad": bad.parent}


if __name__ == "__main__":  # a development store: python -m tests.report_helpers /tmp/store
    import sys

    root = Path(sys.argv[1]).resolve()
    art = build_sample(uris.qualify(root / "store"), root / "staging")
    print(art.enriched_uri, art.train_ready_uri)
