"""Filter-stage benchmark: render(tokenize)+pack throughput and packing efficiency.

    .venv/bin/python bench/filter_bench.py [--scale 100] [--seq-len 1024] [--master local[2]]

The bundled sample's generator scaled up (`samples.nemotron_v1.generate`, 300 x scale
records), the records enrich's own normalisation keeps (pure Python; no embeddings needed), with
their `messages` as the filter gets them. Then the stage's own `render_docs.render_partitions` (the
whole conversation in the Mistral v1 chat template via `ChatTokenizer.render`, the length limits of
`packing.make_document`; tokenizer loaded once per Python worker) and `packing.pack_partitions`
through Spark `mapInPandas`, each step written to Parquet like the stage does. Reports
documents/s and tokens/s of each step and the packing efficiency (non-pad share). Near-duplicate
scaling is `bench/dedup_bench.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def sample_rows(scale: int) -> list[dict]:
    """The generated sample x scale as the filter's render input: the records enrich keeps, with
    their messages, metadata and context units (no embeddings, so no context scores)."""
    from pipeline_core.config import EnrichSection
    from samples.nemotron_v1 import generate
    from spark_jobs.enrich.job import normalise_raw
    from spark_jobs.filter.split import split_of

    e = EnrichSection()
    rows = []
    for _split, recs in generate(rows=300 * scale, seed=7).items():
        for r in recs:
            messages_json = json.dumps(r["messages"], ensure_ascii=False) if r["messages"] is not None else None
            n = normalise_raw(r["uuid"], messages_json, None, e)
            if n["reason"] is None:
                rows.append({"id": r["uuid"], "category": r["category"], "split": split_of(r["uuid"], 1234, 0.05),
                             "messages_json": messages_json, "metadata": r.get("metadata"),
                             "reasoning": r.get("reasoning"), "context_sentences": n["context_sentences"],
                             "context_turns": n["context_turns"]})
    return rows


RENDER_INPUT_SCHEMA = (
    "id string, category string, key long, split string, reason string, raw string, messages_json string, "
    "metadata string, reasoning string, context_sentences array<string>, context_turns array<int>, "
    "context_question_scores array<double>, rejected string"
)


def bench_render_pack(spark, rows: list[dict], seq_len: int, work: Path) -> dict:
    from pyspark.sql import functions as F

    from pipeline_core.config import FilterSection
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.filter.render_docs import DOC_SCHEMA, RENDER_COLUMNS, render_partitions
    from spark_jobs.packing import ROW_SCHEMA, pack_partitions

    fcfg = FilterSection(seq_len=seq_len, max_tokens=max(4096, seq_len), overflow="truncate")
    pad_id = load_tokenizer(fcfg.tokenizer).pad_id
    df = spark.createDataFrame(
        [(r["id"], r["category"], i, r["split"], None, None, r["messages_json"], r["metadata"], r["reasoning"],
          r["context_sentences"], r["context_turns"], None, None) for i, r in enumerate(rows)],
        RENDER_INPUT_SCHEMA,
    ).repartition(2).persist()
    assert tuple(df.columns) == RENDER_COLUMNS, df.columns  # what the stage feeds render_partitions
    df.count()
    t0 = time.perf_counter()
    df.mapInPandas(lambda it: render_partitions(it, fcfg), DOC_SCHEMA).write.mode("overwrite").parquet(
        f"file://{work}/docs")
    t_tok = time.perf_counter() - t0
    all_docs = spark.read.parquet(f"file://{work}/docs")
    rejected = {r["reason"]: r["count"] for r in all_docs.filter(F.col("reason").isNotNull()).groupBy("reason").count()
                .collect()}
    docs = all_docs.filter(F.col("reason").isNull())
    agg = docs.agg(F.count(F.lit(1)).alias("n"), F.sum(F.size("input_ids")).alias("t"),
                   F.sum(F.col("truncated").cast("int")).alias("tr")).first()
    n_docs, tokens = int(agg["n"]), int(agg["t"])
    t0 = time.perf_counter()
    (docs.select("key", "input_ids", "labels").repartition(2, "key").sortWithinPartitions("key")
     .mapInPandas(lambda it: pack_partitions(it, seq_len, pad_id, fcfg.pack_buffer_docs), ROW_SCHEMA)
     .write.mode("overwrite").parquet(f"file://{work}/rows"))
    t_pack = time.perf_counter() - t0
    n_rows = spark.read.parquet(f"file://{work}/rows").count()
    df.unpersist()
    return {
        "records": len(rows), "documents": n_docs, "rejected": rejected, "truncated": int(agg["tr"] or 0),
        "doc_tokens": tokens, "seq_len": seq_len, "packed_rows": n_rows,
        "packing_efficiency": round(tokens / (n_rows * seq_len), 4),
        "render_s": round(t_tok, 2), "render_tokens_per_s": round(tokens / t_tok),
        "render_docs_per_s": round(n_docs / t_tok), "pack_s": round(t_pack, 2),
        "pack_tokens_per_s": round(tokens / t_pack), "render_pack_tokens_per_s": round(tokens / (t_tok + t_pack)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)

    from spark_jobs.common import spark_session

    spark = spark_session("filter-bench", args.master, 4, {"spark.ui.enabled": "false",
                                                           "spark.sql.execution.arrow.maxRecordsPerBatch": "2048"})
    out: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": f"{platform.node()} "
                 f"{os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}", "master": args.master,
                 "command": "bench/filter_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    with tempfile.TemporaryDirectory(prefix="filter-bench-") as tmp:
        t0 = time.perf_counter()
        rows = sample_rows(args.scale)
        out["generate_normalise_s"] = round(time.perf_counter() - t0, 2)
        out["render_pack"] = bench_render_pack(spark, rows, args.seq_len, Path(tmp))
        print(json.dumps(out["render_pack"]), flush=True)
    spark.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
