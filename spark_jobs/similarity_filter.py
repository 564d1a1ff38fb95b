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
Output files have deterministic names and rows (the same rows in the same files and order on a
re-run; the Parquet bytes can still differ, parquet-mr lists column encodings in hash order), and
a committed output is never rewritten: re-running with the same input and config is a no-op.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline_core import uris
from pipeline_core.artifacts import Manifest, fetch_artifact, file_uri, require_manifest
from pipeline_core.config import Config, FilterSection, load_config
from pipeline_core.layout import content_settings
from spark_jobs.common import (
    StageTimer,
    clean_staging,
    committed_output,
    parse_stage_args,
    publish,
    rejects_frame,
    setup_logging,
    spark_session,
    staging_for,
    write_parquet,
)
from spark_jobs.partitioning import FILTER_ROWS_PER_PARTITION, stage_partitions

log = logging.getLogger("spark_jobs.filter")

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
def annotate(df, fcfg: FilterSection, persisted: list | None = None, reports: list | None = None):
    """Every input row once, with `reason` (null = kept so far), after row checks and deduplication.
    DataFrames this persists are appended to `persisted` (the caller unpersists them)."""
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
        if persisted is not None:
            persisted.append(df)
        found = dedup.near_duplicates(df.filter(F.col("_reason").isNull()), key="_key", vec="_vec",
                                      settings=dedup.settings_for(fcfg))
        near = found.frame
        if persisted is not None:
            persisted.append(near)
        if reports is not None:
            reports.append(found.report)
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
def _rename_parts(directory: Path) -> list[Path]:
    """part-00003-<uuid>-c000.zstd.parquet -> part-00003.parquet: names that do not change between runs."""
    out = []
    for p in sorted(directory.glob("part-*.parquet")):
        dest = p.with_name(p.name[: len("part-00000")] + ".parquet")
        p.rename(dest)
        out.append(dest)
    for junk in list(directory.glob(".*.crc")) + list(directory.glob("_*")):
        junk.unlink()
    return out


def _input_paths(input_uri: str, manifest: Manifest, cfg: Config, staging: Path) -> list[str]:
    """file:// URIs of the committed input's data files (fetched and verified when remote: Spark
    here has no object-store connector, the shared store client does the transfer)."""
    files = [f for f in manifest.file_paths("data/") if f.endswith(".parquet")]
    if not files:
        raise ValueError(f"--input {input_uri}: the enriched artifact has no data/*.parquet files")
    if uris.is_local(input_uri):
        return [file_uri(input_uri, manifest, f) for f in files]
    local = staging / "_input"
    fetch_artifact(input_uri, local, cfg.storage, prefix="data/")
    return [uris.qualify(local / f) for f in files]


def stage_config(cfg: Config, input_uri: str, input_manifest: Manifest) -> dict[str, Any]:
    """What determines the artifact's content: recorded in (and hashed into) the manifest."""
    return {"stage": STAGE, "input": input_uri, "input_manifest_sha256": input_manifest.sha256,
            "filter": content_settings(cfg.filter)}


def run(input_uri: str, output_uri: str, cfg: Config, spark=None) -> Manifest:
    """Filter `input_uri` (committed enriched artifact) into `output_uri` (train-ready artifact)."""
    from spark_jobs.chat_format import load_tokenizer

    fcfg = cfg.filter
    input_uri = uris.require_uri(input_uri, "--input").rstrip("/")
    output_uri = uris.require_uri(output_uri, "--output").rstrip("/")
    in_manifest = require_manifest(input_uri, cfg.storage, kind=INPUT_KIND)
    config = stage_config(cfg, input_uri, in_manifest)
    done = committed_output(output_uri, config, cfg.storage)
    if done is not None:
        log.info("%s is already committed from this input and config; nothing to do", output_uri)
        return done
    try:  # invalid tokenizer settings fail here, before any compute
        tok = load_tokenizer(fcfg.tokenizer)
    except Exception as e:
        raise ValueError(f"filter.tokenizer: cannot load {fcfg.tokenizer!r}: {e}") from e

    timer = StageTimer(STAGE)
    staging_uri, staging = staging_for(cfg, STAGE, output_uri)
    own = spark is None
    if own:
        conf = {"spark.sql.execution.arrow.maxRecordsPerBatch": str(fcfg.arrow_batch_rows), **fcfg.spark_conf}
        spark = spark_session("mft-filter", fcfg.spark_master, fcfg.shuffle_partitions, conf)
    persisted: list = []
    try:
        manifest = _compute_and_publish(spark, input_uri, output_uri, cfg, config, in_manifest, tok, timer, staging,
                                        persisted)
    finally:
        for frame in persisted:
            frame.unpersist()
        if own:
            spark.stop()
    clean_staging(staging)
    return manifest


def _compute_and_publish(spark, input_uri, output_uri, cfg, config, in_manifest, tok, timer, staging: Path,
                         persisted: list) -> Manifest:
    from pyspark.sql import functions as F

    fcfg = cfg.filter
    docs_uri = uris.qualify(staging / "_docs")
    with timer.step("filter+dedup+tokenize") as info:
        df = spark.read.parquet(*_input_paths(input_uri, in_manifest, cfg, staging))
        n_in = df.count()
        stage_partitions(spark, fcfg.shuffle_partitions, n_in, FILTER_ROWS_PER_PARTITION)
        reports: list = []
        annotated = annotate(df, fcfg, persisted, reports)
        write_parquet(annotated.mapInPandas(lambda it: tokenize_partitions(it, fcfg), DOC_SCHEMA), docs_uri)
        info["rows"] = n_in

    with timer.step("count+rejects") as info:
        docs = spark.read.parquet(docs_uri)
        stats = (docs.groupBy("split", "reason")
                 .agg(F.count(F.lit(1)).alias("n"), F.sum(F.size("input_ids")).alias("tokens"),
                      F.sum("n_answer").alias("answer_tokens"), F.sum(F.col("truncated").cast("int")).alias("truncated"))
                 .collect())
        if sum(r["n"] for r in stats) != n_in:
            raise RuntimeError(f"row counts do not add up: {n_in} rows in, {sum(r['n'] for r in stats)} annotated")
        rejected: dict[str, int] = {}
        for r in stats:
            if r["reason"] is not None:
                rejected[r["reason"]] = rejected.get(r["reason"], 0) + r["n"]
        n_rej = sum(rejected.values())
        if n_rej:
            rejects = (rejects_frame(docs.filter(F.col("reason").isNotNull()), STAGE)
                       .repartition(max(1, math.ceil(n_rej / 1_000_000)), "id").sortWithinPartitions("id", "reason", "raw"))
            write_parquet(rejects, uris.qualify(staging / "rejects"))
            _rename_parts(staging / "rejects")
        info["rows"] = n_rej

    splits: dict[str, dict[str, Any]] = {}
    seq_len, pad_id, buffer_docs = fcfg.seq_len, tok.pad_id, fcfg.pack_buffer_docs  # plain values for the closure
    for split in ("train", "val"):
        row = next((r for r in stats if r["reason"] is None and r["split"] == split), None)
        n_docs, doc_tokens = (row["n"], int(row["tokens"])) if row else (0, 0)
        with timer.step(f"pack {split}") as info:
            n_parts = max(1, math.ceil(doc_tokens / fcfg.shard_tokens))
            part = (docs.filter((F.col("split") == split) & F.col("reason").isNull()).select("key", "input_ids", "labels")
                    .repartition(n_parts, "key").sortWithinPartitions("key"))
            dest = staging / "data" / split
            write_parquet(part.mapInPandas(lambda it: pack_partitions(it, seq_len, pad_id, buffer_docs), ROW_SCHEMA),
                          uris.qualify(dest))
            files = _rename_parts(dest)
            n_rows = parquet_rows(files)
            info["tokens"] = doc_tokens
        slots = n_rows * seq_len
        splits[split] = {
            "documents": n_docs, "rows": n_rows, "files": len(files), "doc_tokens": doc_tokens,
            "answer_tokens": int(row["answer_tokens"]) if row else 0,
            "truncated": int(row["truncated"] or 0) if row else 0,
            "slots": slots, "packing_efficiency": round(doc_tokens / slots, 4) if slots else None,
        }
    clean_staging(staging / "_docs")
    clean_staging(staging / "_input")

    n_out = sum(s["documents"] for s in splits.values())
    total_slots = sum(s["slots"] for s in splits.values())
    extra = {
        **tok.identity(),
        "schema": "train-ready",
        "seq_len": seq_len,
        "pad_token_id": pad_id,
        "label_ignore_index": -100,
        "columns": {
            "input_ids": "int32[seq_len]",
            "labels": "int32[seq_len]: = input_ids on answer tokens (not shifted), -100 on prompt and padding",
            "position_ids": "int32[seq_len]: 0 at each document start; trailing padding is a segment of its own",
        },
        "splits": splits,
        "tokens": {s: v["doc_tokens"] for s, v in splits.items()},
        "packing_efficiency": round(sum(s["doc_tokens"] for s in splits.values()) / total_slots, 4) if total_slots else None,
        "truncated": sum(s["truncated"] for s in splits.values()),
        "near_duplicates": reports[0].as_manifest() if reports else None,
        "split_rule": f"val iff int(sha256(f'{{seed}}:{{id}}')[:13], 16) / 2**52 < {fcfg.val_fraction} (seed={fcfg.seed})",
    }
    counts = {"in": n_in, "out": n_out, "rejected": dict(sorted(rejected.items()))}
    timer.total()
    with timer.step("publish"):
        manifest = publish(staging, output_uri, kind=KIND, config=config, counts=counts, storage=cfg.storage,
                           timings=timer.timings, extra=extra, inputs=[input_uri])
    log.info("[filter] %d in, %d kept, rejected %s; tokens %s; packing efficiency %s",
             n_in, n_out, counts["rejected"], extra["tokens"], extra["packing_efficiency"])
    return manifest


def parquet_rows(files: Sequence[Path]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    args = parse_stage_args(__doc__.strip().splitlines()[0], argv)
    cfg = load_config(args.config)  # invalid settings fail here, before Spark starts
    manifest = run(args.input, args.output, cfg)
    print(json.dumps({"uri": manifest.uri, "counts": manifest.counts, "tokens": manifest.extra.get("tokens"),
                      "packing_efficiency": manifest.extra.get("packing_efficiency")}))
    return 0


if __name__ == "__main__":
    # Import by module name so Spark pickles the UDF bodies by reference, not as __main__ copies.
    from spark_jobs.similarity_filter import main as _main

    sys.exit(_main())
