"""Filter stage: enriched artifact -> train-ready artifact (DESIGN.md "filter" and "Contracts").

    spark-submit spark_jobs/similarity_filter.py --input URI --output URI [--config FILE]

Reads a committed enriched artifact and, in Spark:
  1. row checks: required fields present, question<->answer cosine >= `min_qa_similarity`;
  2. exact duplicates (normalised text hash) and semantic near duplicates (LSH, see dedup.py);
  3. deterministic train/val split by a hash of the id (split.py);
  4. render with the base model's chat template, tokenize (tokenizer loaded once per executor),
     apply the token-length limits (chat_format.py, packing.py);
  5. pack each split into `seq_len` rows (best-fit decreasing), written as parquet.
Every dropped record goes to `rejects/` with its reason; the manifest counts in = out + rejected
by reason, and carries tokens per split, packing efficiency and the tokenizer/template identity.
Output files have deterministic names and content, and a committed output is never rewritten:
re-running with the same input and config is a no-op.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline_core import uris
from pipeline_core.artifacts import (
    ArtifactConflict,
    Manifest,
    fetch_artifact,
    publish_artifact,
    read_manifest,
    require_manifest,
)
from pipeline_core.config import Config, FilterSection, load_config, stable_hash

log = logging.getLogger("similarity_filter")

KIND = "train-ready"
INPUT_KIND = "enriched"
STAGE = "filter"
MISSING_FIELD = "missing_field"
LOW_QA_SIMILARITY = "low_qa_similarity"
ROW_SCHEMA = "input_ids array<int>, labels array<int>, position_ids array<int>"
DOC_SCHEMA = (
    "id string, key long, split string, input_ids array<int>, labels array<int>, n_prompt int, n_answer int, "
    "truncated boolean, reason string, raw string"
)


# ----------------------------------------------------------------------------- Spark steps
def annotate(df, fcfg: FilterSection):
    """Every input row once, with `_reason` (null = kept so far), after row checks and deduplication."""
    from pyspark.sql import functions as F

    from spark_jobs import dedup
    from spark_jobs.split import split_column

    relevant = F.transform(F.coalesce(F.col("relevant_sentences"), F.array()), lambda s: s["text"])
    text_cols = [F.array_join(relevant, "\n"), F.col("question"), F.col("answer")]
    if fcfg.train_on_reasoning:
        text_cols.append(F.col("reasoning_trace"))
    df = (
        df.withColumn("_relevant", relevant)
        .withColumn("_text_hash", dedup.text_hash(*text_cols))
        .withColumn("_key", F.xxhash64(F.coalesce(F.col("id"), F.lit("")), F.col("_text_hash")))
        .withColumn("_vec", F.concat(F.col("question_embedding"), F.col("answer_embedding")))
    )
    blank = lambda c: F.col(c).isNull() | (F.length(F.trim(F.col(c))) == 0)  # noqa: E731
    emb_bad = lambda c: F.col(c).isNull() | (F.size(F.col(c)) == 0)  # noqa: E731
    checks = [
        (blank("id"), MISSING_FIELD, "id is null or empty"),
        (blank("question"), MISSING_FIELD, "question is null or empty"),
        (blank("answer"), MISSING_FIELD, "answer is null or empty"),
        (emb_bad("question_embedding") | emb_bad("answer_embedding")
         | (F.size("question_embedding") != F.size("answer_embedding")), MISSING_FIELD,
         "question_embedding/answer_embedding missing or of different sizes"),
        (F.col("sim_question_answer").isNull(), MISSING_FIELD, "sim_question_answer is null"),
        (F.col("sim_question_answer") < fcfg.min_qa_similarity, LOW_QA_SIMILARITY,
         F.format_string(f"sim_question_answer %.4f < min_qa_similarity={fcfg.min_qa_similarity}", F.col("sim_question_answer"))),
    ]
    reason, detail = F.lit(None).cast("string"), F.lit(None).cast("string")
    for cond, r, d in reversed(checks):  # the first failing check wins
        reason = F.when(cond, F.lit(r)).otherwise(reason)
        detail = F.when(cond, d if not isinstance(d, str) else F.lit(d)).otherwise(detail)
    df = df.withColumn("_reason", reason).withColumn("_detail", detail)

    if fcfg.exact_dedup:
        df = dedup.mark_exact_duplicates(df, key="_key", hash_col="_text_hash", eligible=F.col("_reason").isNull())
        df = df.withColumn("_reason", F.coalesce("_reason", F.when(F.col("_exact_rep").isNotNull(), F.lit(dedup.EXACT_DUPLICATE))))
        df = df.withColumn("_detail", F.coalesce("_detail", F.concat(F.lit("duplicate of "), F.col("_exact_rep"))))

    if fcfg.near_dup_threshold is not None:
        from pyspark import StorageLevel

        df = df.persist(StorageLevel.MEMORY_AND_DISK)  # read by the LSH branch and by the join below
        near = dedup.find_near_duplicates(
            df.filter(F.col("_reason").isNull()), key="_key", vec="_vec", threshold=fcfg.near_dup_threshold,
            bands=fcfg.lsh_bands, rows_per_band=fcfg.lsh_rows_per_band, max_leaders=fcfg.lsh_max_leaders,
            seed=fcfg.lsh_seed,
        )
        df = df.join(near, "_key", "left")
        df = df.withColumn("_reason", F.coalesce("_reason", F.when(F.col("_near_rep").isNotNull(), F.lit(dedup.NEAR_DUPLICATE))))
        df = df.withColumn("_detail", F.coalesce(
            "_detail", F.format_string("near duplicate of %s (similarity %.4f)", F.col("_near_rep"), F.col("_near_sim"))))

    raw = F.to_json(F.struct(
        "id", "category", "question", "answer", "reasoning_trace", F.col("_relevant").alias("relevant"),
        "sim_question_answer", F.col("_detail").alias("detail"),
    ))
    return df.select(
        "id", F.col("_key").alias("key"), split_column("id", fcfg.seed, fcfg.val_fraction).alias("split"),
        F.col("_relevant").alias("relevant"), "question", "answer", "reasoning_trace",
        F.col("_reason").alias("reason"), raw.alias("raw"),
    )


def tokenize_partitions(batches: Iterator[pd.DataFrame], fcfg: FilterSection) -> Iterator[pd.DataFrame]:
    """mapInPandas body: kept rows -> documents (or a length reject); rejected rows pass through."""
    from spark_jobs.chat_format import load_tokenizer, render
    from spark_jobs.packing import LengthLimits, make_document

    tok = load_tokenizer(fcfg.tokenizer)
    limits = LengthLimits(fcfg.seq_len, fcfg.max_tokens, fcfg.min_answer_tokens, fcfg.overflow)
    for pdf in batches:
        out: dict[str, list[Any]] = {k: [] for k in
                                     ("id", "key", "split", "input_ids", "labels", "n_prompt", "n_answer", "truncated", "reason", "raw")}
        for rec in pdf.itertuples(index=False):
            reason, raw, doc = rec.reason, None, None
            if reason is None:
                prompt, completion = render(list(rec.relevant) if rec.relevant is not None else [], rec.question,
                                            rec.answer, rec.reasoning_trace, fcfg.train_on_reasoning)
                got = make_document(*tok.encode(prompt, completion), limits, tok.eos_id)
                if isinstance(got, tuple):
                    reason, detail = got
                    raw = json.dumps({**json.loads(rec.raw), "detail": detail}, ensure_ascii=False)
                else:
                    doc = got
            else:
                raw = rec.raw
            out["id"].append(rec.id)
            out["key"].append(rec.key)
            out["split"].append(rec.split)
            out["input_ids"].append(doc.input_ids if doc else None)
            out["labels"].append(doc.labels if doc else None)
            out["n_prompt"].append(doc.n_prompt if doc else None)
            out["n_answer"].append(doc.n_answer if doc else None)
            out["truncated"].append(doc.truncated if doc else None)
            out["reason"].append(reason)
            out["raw"].append(raw)
        yield pd.DataFrame(out)


def pack_partitions(batches: Iterator[pd.DataFrame], seq_len: int, pad_id: int, buffer_docs: int) -> Iterator[pd.DataFrame]:
    """mapInPandas body: documents (sorted by key) -> packed rows, `buffer_docs` documents at a time."""
    from spark_jobs.packing import pack

    def flush(buf):
        rows = list(pack(buf, seq_len, pad_id))
        return pd.DataFrame({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows],
                             "position_ids": [r[2] for r in rows]})

    buf: list = []
    for pdf in batches:
        for ids, labels in zip(pdf["input_ids"], pdf["labels"], strict=True):
            buf.append((ids, labels))
            if len(buf) >= buffer_docs:
                yield flush(buf)
                buf = []
    if buf:
        yield flush(buf)


# ----------------------------------------------------------------------------- driver
def spark_session(app_name: str = "similarity_filter"):
    """The session spark-submit configured, or a local one when run as a plain Python process."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        # Python workers must run this interpreter (the one with the project installed), not `python3`.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = builder.master(os.environ.get("MFT_SPARK_MASTER", "local[*]"))
    return (builder.config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .getOrCreate())


def _rename_parts(directory: Path) -> list[Path]:
    """part-00003-<uuid>-c000.snappy.parquet -> part-00003.parquet: names that do not change between runs."""
    out = []
    for p in sorted(directory.glob("part-*.parquet")):
        dest = p.with_name(p.name[: len("part-00000")] + ".parquet")
        p.rename(dest)
        out.append(dest)
    for junk in list(directory.glob(".*.crc")) + list(directory.glob("_*")):
        junk.unlink()
    return out


def _input_paths(input_uri: str, manifest: Manifest, cfg: Config, work: Path) -> list[str]:
    """file:// URIs of the committed input's data files (fetched and verified when remote)."""
    files = [f for f in manifest.file_paths("data/") if f.endswith(".parquet")]
    if not files:
        raise ValueError(f"--input {input_uri}: the enriched artifact has no data/*.parquet files")
    if uris.is_local(input_uri):
        return [uris.join(input_uri, f) for f in files]
    local = work / "input"
    fetch_artifact(input_uri, local, cfg.storage, prefix="data/")
    return [uris.qualify(local / f) for f in files]


def run(input_uri: str, output_uri: str, cfg: Config, spark=None) -> Manifest:
    """Filter `input_uri` (committed enriched artifact) into `output_uri` (train-ready artifact)."""
    from pyspark.sql import functions as F

    from spark_jobs.chat_format import load_tokenizer

    t_start = time.time()
    fcfg = cfg.filter
    input_uri = uris.require_uri(input_uri, "--input").rstrip("/")
    output_uri = uris.require_uri(output_uri, "--output").rstrip("/")
    in_manifest = require_manifest(input_uri, cfg.storage, kind=INPUT_KIND)
    config = {"filter": fcfg.model_dump(mode="json")}
    existing = read_manifest(output_uri, cfg.storage)
    if existing is not None:
        same_input = [i["manifest_sha256"] for i in existing.inputs] == [in_manifest.sha256]
        if existing.config_hash == stable_hash(config)[:12] and same_input:
            log.info("%s is already committed from the same input and config; nothing to do", output_uri)
            return existing
        raise ArtifactConflict(f"--output {output_uri} is already committed from a different input or config; "
                               "artifacts are immutable: choose a new output URI")
    try:  # invalid tokenizer settings fail here, before any compute
        tok = load_tokenizer(fcfg.tokenizer)
    except Exception as e:
        raise ValueError(f"filter.tokenizer: cannot load {fcfg.tokenizer!r}: {e}") from e

    staging = uris.to_local_path(uris.join(cfg.pipeline.staging_uri, "filter",
                                           f"{stable_hash(output_uri)[:16]}-{uuid.uuid4().hex[:8]}"))
    out_dir, work = staging / "out", staging / "work"
    spark = spark or spark_session()
    timings: dict[str, float] = {}
    try:
        t0 = time.time()
        df = spark.read.parquet(*_input_paths(input_uri, in_manifest, cfg, work))
        n_in = df.count()
        docs_uri = uris.qualify(work / "docs")
        annotated = annotate(df, fcfg)
        (annotated.mapInPandas(lambda it: tokenize_partitions(it, fcfg), DOC_SCHEMA)
         .write.mode("overwrite").parquet(docs_uri))
        timings["filter_tokenize_s"] = round(time.time() - t0, 3)

        t0 = time.time()
        docs = spark.read.parquet(docs_uri)
        stats = (docs.groupBy("split", "reason")
                 .agg(F.count(F.lit(1)).alias("n"), F.sum(F.size("input_ids")).alias("tokens"),
                      F.sum("n_answer").alias("answer_tokens"), F.sum(F.col("truncated").cast("int")).alias("truncated"))
                 .collect())
        n_all = sum(r["n"] for r in stats)
        if n_all != n_in:
            raise RuntimeError(f"internal error: {n_in} rows in but {n_all} annotated; refusing to publish")
        rejected: dict[str, int] = {}
        for r in stats:
            if r["reason"] is not None:
                rejected[r["reason"]] = rejected.get(r["reason"], 0) + r["n"]
        kept = {s: next((r for r in stats if r["reason"] is None and r["split"] == s), None) for s in ("train", "val")}

        rejects = docs.filter(F.col("reason").isNotNull()).select("id", F.lit(STAGE).alias("stage"), "reason", "raw")
        n_rej = sum(rejected.values())
        if n_rej:
            (rejects.repartition(max(1, math.ceil(n_rej / 1_000_000)), "id").sortWithinPartitions("id", "reason", "raw")
             .write.mode("overwrite").parquet(uris.qualify(out_dir / "rejects")))
            _rename_parts(out_dir / "rejects")

        splits: dict[str, dict[str, Any]] = {}
        seq_len, pad_id, buffer_docs = fcfg.seq_len, tok.pad_id, fcfg.pack_buffer_docs  # plain values for the closure
        for split, row in kept.items():
            n_docs = row["n"] if row else 0
            doc_tokens = int(row["tokens"]) if row else 0
            n_parts = max(1, math.ceil(doc_tokens / fcfg.shard_tokens))
            part = (docs.filter((F.col("split") == split) & F.col("reason").isNull()).select("key", "input_ids", "labels")
                    .repartition(n_parts, "key").sortWithinPartitions("key"))
            dest = out_dir / "data" / split
            (part.mapInPandas(lambda it: pack_partitions(it, seq_len, pad_id, buffer_docs), ROW_SCHEMA)
             .write.mode("overwrite").parquet(uris.qualify(dest)))
            files = _rename_parts(dest)
            n_rows = spark.read.parquet(uris.qualify(dest)).count()
            slots = n_rows * fcfg.seq_len
            splits[split] = {
                "documents": n_docs, "rows": n_rows, "files": len(files), "doc_tokens": doc_tokens,
                "answer_tokens": int(row["answer_tokens"]) if row else 0, "truncated": int(row["truncated"] or 0) if row else 0,
                "slots": slots, "packing_efficiency": round(doc_tokens / slots, 4) if slots else None,
            }
        timings["pack_s"] = round(time.time() - t0, 3)

        n_out = sum(s["documents"] for s in splits.values())
        total_slots = sum(s["slots"] for s in splits.values())
        extra = {
            **tok.identity(),
            "seq_len": fcfg.seq_len,
            "pad_token_id": tok.pad_id,
            "label_ignore_index": -100,
            "columns": {"input_ids": "int32[seq_len]", "labels": "int32[seq_len], = input_ids on answer tokens (not shifted), "
                        "-100 on prompt and padding", "position_ids": "int32[seq_len], 0 at each document start; padding "
                        "is a last segment of its own"},
            "splits": splits,
            "tokens": {s: v["doc_tokens"] for s, v in splits.items()},
            "packing_efficiency": round(sum(s["doc_tokens"] for s in splits.values()) / total_slots, 4) if total_slots else None,
            "truncated": sum(s["truncated"] for s in splits.values()),
            "split_rule": f"sha256(f'{{seed}}:{{id}}') first 13 hex digits / 2**52 < val_fraction (seed={fcfg.seed})",
        }
        timings["total_s"] = round(time.time() - t_start, 3)
        manifest = publish_artifact(
            out_dir, output_uri, kind=KIND, config=config, inputs=[input_uri],
            counts={"in": n_in, "out": n_out, "rejected": dict(sorted(rejected.items()))},
            extra=extra, timings=timings, storage=cfg.storage,
        )
        log.info("filter: %d in, %d kept, rejected %s, packing efficiency %s", n_in, n_out, rejected, extra["packing_efficiency"])
        return manifest
    finally:
        spark.catalog.clearCache()
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Similarity filter, dedup, split, tokenize and pack (enriched -> train-ready)")
    p.add_argument("--input", required=True, help="committed enriched artifact URI (file://, s3://)")
    p.add_argument("--output", required=True, help="train-ready artifact URI to commit")
    p.add_argument("--config", default=None, help="resolved config file (YAML/JSON); defaults + MFT__ env otherwise")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)  # invalid config fails here, before Spark starts
    manifest = run(args.input, args.output, cfg)
    print(json.dumps({"uri": manifest.uri, "counts": manifest.counts,
                      "packing_efficiency": manifest.extra.get("packing_efficiency")}))
    return 0


if __name__ == "__main__":
    # Import by module name so Spark pickles the UDF bodies by reference, not as __main__ copies.
    from spark_jobs.similarity_filter import main as _main

    sys.exit(_main())
