"""Filter-stage benchmark: render(tokenize)+pack throughput and packing efficiency; LSH near-duplicate scaling.

    .venv/bin/python bench/filter_bench.py [--scale 100] [--seq-len 1024] [--lsh-rows 20000] [--master local[2]]

1. render+pack: the bundled sample's generator scaled up (`samples.nemotron_v1.generate`,
   300 x scale records), the records enrich's own normalisation keeps (pure Python; no
   embeddings needed for this part), with their `messages` as the filter gets them. Then the
   stage's own `render_docs.render_partitions` (the whole conversation in the Mistral v1 chat
   template via `ChatTokenizer.render`, the length limits of `packing.make_document`; tokenizer
   loaded once per Python worker) and `packing.pack_partitions` through Spark `mapInPandas`, each
   step written to Parquet like the stage does. Reports documents/s and tokens/s of each step
   and the packing efficiency (non-pad share).
2. near-duplicate scaling: `dedup.find_near_duplicates` (the stage's LSH) on N and 4N rows, timed
   end to end (signatures, buckets, candidate pairs, exact cosine). Rows are semi-synthetic: real
   all-MiniLM-L6-v2 embeddings of the sample's questions and answers are topic centres; each row
   is a centre plus noise (rows of one topic have cosine ~0.7, like same-topic questions), and 10%
   of rows get a planted paraphrase-level twin (cosine ~0.95). Reports time ratio (target <= 4.5)
   and the recall of the planted twins.
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

import numpy as np  # noqa: E402

from bench.proc_cpu import cpu_seconds  # noqa: E402


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
    "context_question_scores array<double>"
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
          r["context_sentences"], r["context_turns"], None) for i, r in enumerate(rows)],
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


def semi_synthetic(n: int, centres: np.ndarray, seed: int, rows_per_topic: int = 20,
                   topics: int | None = None) -> tuple[np.ndarray, int]:
    """n rows of [q;a] (each half unit-norm). Topics: n / rows_per_topic sub-topics around the real
    embedding centres (sub-topics of one centre have cosine ~0.55: related, not the same); rows of one
    topic have cosine ~0.7 (same topic, different question); 10% of rows are planted near-duplicate
    twins of the row before them (cosine ~0.95). More rows = more topics at the same density, as in
    a larger real corpus. Returns (vectors, number of planted twins)."""
    rng = np.random.default_rng(seed)
    dim = centres.shape[1] // 2

    def unit_halves(v):
        v = v.reshape(len(v), 2, dim)
        return (v / np.linalg.norm(v, axis=2, keepdims=True)).reshape(len(v), 2 * dim)

    centres = unit_halves(np.unique(np.round(centres, 4), axis=0))
    n_topics = topics or max(1, n // rows_per_topic)  # fixed `topics`: density grows with n (worst case)
    topics = unit_halves(centres[rng.integers(0, len(centres), n_topics)] + rng.normal(0, 0.046, (n_topics, 2 * dim)))
    base = unit_halves(topics[rng.integers(0, n_topics, n)] + rng.normal(0, 0.0335, (n, 2 * dim)))
    twins = rng.random(n) < 0.1
    twins[0] = False
    idx = np.nonzero(twins)[0]
    base[idx] = unit_halves(base[idx - 1] + rng.normal(0, 0.0165, (len(idx), 2 * dim)))
    return base.astype(np.float32), len(idx)


def bench_lsh(spark, n: int, centres: np.ndarray, work: Path, rows_per_topic: int = 20, topics: int | None = None) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    from pipeline_core.config import FilterSection
    from spark_jobs.near_dups.dedup import find_near_duplicates

    vecs, planted = semi_synthetic(n, centres, seed=n, rows_per_topic=rows_per_topic, topics=topics)
    path = work / f"vec-{n}.parquet"
    pq.write_table(pa.table({"id": [f"r{i:09d}" for i in range(n)], "_vec": list(vecs)}), path)
    df = spark.read.parquet(f"file://{path}").withColumn("_key", F.xxhash64("id"))
    f = FilterSection()
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    found = find_near_duplicates(df, key="_key", vec="_vec", threshold=f.near_dup_threshold, bands=f.lsh_bands,
                                 rows_per_band=f.lsh_rows_per_band, max_leaders=f.lsh_max_leaders, seed=f.lsh_seed,
                                 min_band_matches=f.lsh_min_band_matches)
    found.write.mode("overwrite").parquet(f"file://{work}/dups-{n}")
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    dropped = {int(r["_key"]) for r in spark.read.parquet(f"file://{work}/dups-{n}").select("_key").collect()}
    # Exact truth for a sample of rows (brute force): does a row with a smaller key have cosine >= 0.9?
    keys = df.select("id", "_key").toPandas().sort_values("id")["_key"].to_numpy()
    sample = np.random.default_rng(1).choice(n, size=min(n, 2000), replace=False)
    sims = (vecs[sample].astype(np.float64) @ vecs.T.astype(np.float64)) / 2.0
    truth = [(sims[i] >= 0.9) & (keys < keys[j]) for i, j in enumerate(sample)]
    truth = np.array([t.any() for t in truth])
    found = np.array([int(keys[j]) in dropped for j in sample])
    return {"rows": n, "seconds": round(dt, 2), "cpu_seconds": round(cpu, 2), "rows_per_s": round(n / dt),
            "dropped": len(dropped),
            "planted_twins": planted, "rows_per_topic": n / topics if topics else rows_per_topic,
            "sample_recall": round(float((found & truth).sum() / max(1, truth.sum())), 4),
            "sample_false_drops": int((found & ~truth).sum()), "sample_size": len(sample)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lsh-rows", type=int, default=20_000)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--skip", choices=["pack", "lsh"], default=None)
    ap.add_argument("--topics", type=int, default=None,
                    help="fixed number of topics for both sizes (denser topics at 4N: the worst case)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)

    from spark_jobs.common import spark_session

    spark = spark_session("filter-bench", args.master, 4, {"spark.ui.enabled": "false",
                                                           "spark.sql.execution.arrow.maxRecordsPerBatch": "2048"})
    out: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": f"{platform.node()} "
                 f"{os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}", "master": args.master,
                 "command": "bench/filter_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    with tempfile.TemporaryDirectory(prefix="filter-bench-") as tmp:
        work = Path(tmp)
        if args.skip != "pack":
            t0 = time.perf_counter()
            rows = sample_rows(args.scale)
            out["generate_normalise_s"] = round(time.perf_counter() - t0, 2)
            out["render_pack"] = bench_render_pack(spark, rows, args.seq_len, work)
            print(json.dumps(out["render_pack"]), flush=True)
        if args.skip != "lsh":
            from pipeline_core.config import EnrichSection
            from samples.nemotron_v1 import generate
            from spark_jobs.enrich.embeddings import encode
            from spark_jobs.enrich.job import normalise_raw

            qa = []
            for recs in generate(rows=300, seed=0).values():
                for r in recs:
                    n = normalise_raw(r["uuid"], json.dumps(r["messages"]) if r["messages"] is not None else None,
                                      None, EnrichSection())
                    if n["reason"] is None:
                        qa.append((n["question"], n["answer"]))
            model = EnrichSection().embedding_model  # the product's encoder and default model (bundled MiniLM)
            centres = np.concatenate([encode([q for q, _ in qa], model), encode([a for _, a in qa], model)], axis=1)
            bench_lsh(spark, 2000, centres, work)  # warm-up: JVM, Python workers
            small = bench_lsh(spark, args.lsh_rows, centres, work, topics=args.topics)
            print(json.dumps(small), flush=True)
            large = bench_lsh(spark, 4 * args.lsh_rows, centres, work, topics=args.topics)
            print(json.dumps(large), flush=True)
            out["lsh"] = {"N": small, "4N": large, "time_ratio": round(large["seconds"] / small["seconds"], 2),
                          "cpu_ratio": round(large["cpu_seconds"] / small["cpu_seconds"], 2), "centres": len(centres)}
    spark.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
