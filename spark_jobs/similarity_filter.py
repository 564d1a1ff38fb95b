"""Filter stage: enriched artifact -> train-ready artifact (DESIGN.md "filter" and "Contracts").

    spark-submit spark_jobs/similarity_filter.py --input URI --output URI [--config FILE]

Reads a committed enriched artifact (its files verified against the manifest, local or remote)
and, in Spark, through the shared stage lifecycle (`common.run_stage`):
  1. filtering (filter_rows.py): row checks, question<->answer cosine >= `min_qa_similarity`;
  2. deduplication (dedup.py, called from filter_rows.py): exact duplicates of the whole
     conversation (NFKC, white space collapsed, case folded) and semantic near duplicates (LSH);
  3. split (split.py): train/val by a hash of the prompt, every answer to one prompt on one side,
     validation capped at `val_max_documents`;
  4. rendering (render_docs.py, chat_format.py): the whole conversation in the base model's chat
     template, loss on the assistant turns, then the token-length limits (packing.py);
  5. packing (packing.py): each split into `seq_len` rows (best-fit decreasing), as Parquet;
  6. render sample (pipeline_core/render_sample.py): up to `render_sample_documents` kept documents
     with the conversations they were rendered from, for the trainer's export check.
Every dropped record goes to `rejects/` with its reason; the manifest counts in = out + rejected
by reason, and its `extra` is a `pipeline_core.handoffs.TrainReadyInfo` (tokenizer spec with the
chat template, tokens / target tokens / documents / sequences per split, packing efficiency).
Output files have deterministic names and rows (the same rows in the same files and order on a
re-run), and a committed output is never rewritten: re-running with the same input and config is a no-op.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any

from pipeline_core import uris
from pipeline_core.artifacts import (
    CorruptArtifact,
    Manifest,
    fetch_artifact,
    file_uri,
    require_manifest,
    sha256_file,
)
from pipeline_core.config import Config, load_config
from pipeline_core.render_sample import SAMPLE_DIR, SAMPLE_SCHEMA, key_threshold
from spark_jobs.common import (
    StageContext,
    StageOutput,
    StageSpec,
    clean_staging,
    download_dir,
    parquet_rows,
    parse_stage_args,
    rejects_frame,
    run_stage,
    setup_logging,
    write_parquet,
)
from spark_jobs.packing import ROW_SCHEMA, pack_partitions
from spark_jobs.partitioning import FILTER_ROWS_PER_PARTITION, stage_partitions
from spark_jobs.render_docs import DOC_SCHEMA, render_partitions
from spark_jobs.split import SPLIT_RULE, SPLITS
from spark_jobs.train_ready import KIND, SplitStats, describe

log = logging.getLogger("spark_jobs.filter")

INPUT_KIND = "enriched"
STAGE = "filter"
SPEC = StageSpec(STAGE, KIND, "mft-filter")


def _input_paths(input_uri: str, manifest: Manifest, cfg: Config, ctx: StageContext) -> list[str]:
    """file:// URIs of the committed input's data files, each verified against the manifest (size,
    sha256): in place for a local artifact, fetched through the shared store client otherwise
    (Spark here has no object-store connector)."""
    files = [f for f in manifest.files if f["path"].startswith("data/") and f["path"].endswith(".parquet")]
    if not files:
        raise ValueError(f"--input {input_uri}: the enriched artifact has no data/*.parquet files")
    if uris.is_local(input_uri):
        root = uris.to_local_path(input_uri)
        for f in files:  # under the payload prefix its manifest names (one writer per artifact)
            p = root / manifest.object_path(f["path"])
            if not p.is_file():
                raise CorruptArtifact(f"{file_uri(input_uri, manifest, f['path'])} is listed in the manifest but missing")
            if p.stat().st_size != f["size"] or sha256_file(p) != f["sha256"]:
                raise CorruptArtifact(f"{file_uri(input_uri, manifest, f['path'])} does not match its manifest (size/sha256)")
        return [file_uri(input_uri, manifest, f["path"]) for f in files]
    local = download_dir(ctx.staging)
    fetch_artifact(input_uri, local, cfg.storage, prefix="data/")
    return [uris.qualify(local / f["path"]) for f in files]


def stage_config(cfg: Config, input_uri: str, input_manifest: Manifest) -> dict[str, Any]:
    """What determines the artifact's content: recorded in (and hashed into) the manifest."""
    return {"stage": STAGE, "input": input_uri, "input_manifest_sha256": input_manifest.sha256,
            "filter": cfg.filter.content_settings()}


def run(input_uri: str, output_uri: str, cfg: Config, spark=None) -> Manifest:
    """Filter `input_uri` (committed enriched artifact) into `output_uri` (train-ready artifact)."""
    from spark_jobs.chat_format import load_tokenizer

    input_uri = uris.require_uri(input_uri, "--input").rstrip("/")
    output_uri = uris.require_uri(output_uri, "--output").rstrip("/")
    in_manifest = require_manifest(input_uri, cfg.storage, kind=INPUT_KIND)

    def check_tokenizer() -> None:  # invalid tokenizer settings fail here, before any compute
        try:
            load_tokenizer(cfg.filter.tokenizer)
        except Exception as e:
            raise ValueError(f"filter.tokenizer: cannot load {cfg.filter.tokenizer!r}: {e}") from e

    return run_stage(SPEC, cfg, cfg.filter, output_uri, stage_config(cfg, input_uri, in_manifest),
                     lambda ctx: _compute(ctx, input_uri, in_manifest, cfg), spark=spark,
                     before_compute=check_tokenizer)


def _compute(ctx: StageContext, input_uri: str, in_manifest: Manifest, cfg: Config) -> StageOutput:
    from pyspark.sql import functions as F

    from spark_jobs import filter_rows
    from spark_jobs.chat_format import load_tokenizer

    fcfg, spark, timer, staging = cfg.filter, ctx.spark, ctx.timer, ctx.staging
    tok = load_tokenizer(fcfg.tokenizer)
    docs_uri = uris.qualify(staging.with_name(staging.name + "-docs"))  # beside staging: never published
    with timer.step("filter+dedup+render") as info:
        df = spark.read.parquet(*_input_paths(input_uri, in_manifest, cfg, ctx))
        n_in = df.count()
        stage_partitions(spark, fcfg.shuffle_partitions, n_in, FILTER_ROWS_PER_PARTITION)
        reports: list = []
        decided = filter_rows.decisions(ctx, filter_rows.keyed(df, fcfg), fcfg, reports)
        j = filter_rows.located(df).join(decided, ["_file", "_row"])  # one row each side: a 1:1 join
        reason, split = F.col("reason"), F.col("split")
        raw = F.when(reason.isNotNull(), F.to_json(F.struct(
            "id", "category", "question", "answer", "reasoning_trace", F.col("_messages_json").alias("messages"),
            "sim_question_answer", F.col("detail"))))
        opt = lambda c, t: F.col(c) if c in df.columns else F.lit(None).cast(t)  # noqa: E731
        render_in = j.select(
            "id", opt("category", "string").alias("category"), F.col("_key").alias("key"), split.alias("split"),
            reason.alias("reason"), raw.alias("raw"),
            F.when(reason.isNull(), F.col("_messages_json")).alias("messages_json"),
            opt("metadata", "string").alias("metadata"), opt("reasoning", "string").alias("reasoning"),
            opt("context_sentences", "array<string>").alias("context_sentences"),
            opt("context_turns", "array<int>").alias("context_turns"),
            opt("context_question_scores", "array<double>").alias("context_question_scores"),
        )
        sample_below = key_threshold(fcfg.render_sample_documents, n_in)
        write_parquet(render_in.mapInPandas(lambda it: render_partitions(it, fcfg, sample_below), DOC_SCHEMA), docs_uri)
        info["rows"] = n_in

    try:
        counts, extra = _pack_and_describe(ctx, docs_uri, n_in, cfg, tok)
        # method, parameters and the recall measured on this data (spark_jobs/dedup.py)
        extra["near_duplicates"] = reports[0].as_manifest() if reports else None
        return StageOutput(counts, extra, inputs=(input_uri,))
    finally:
        clean_staging(uris.to_local_path(docs_uri))


def _pack_and_describe(ctx: StageContext, docs_uri: str, n_in: int, cfg: Config, tok) -> tuple[dict, dict]:
    from pyspark.sql import functions as F

    fcfg, spark, timer, staging = cfg.filter, ctx.spark, ctx.timer, ctx.staging
    with timer.step("count+rejects") as info:
        docs = spark.read.parquet(docs_uri)
        stats = (docs.groupBy("split", "reason")
                 .agg(F.count(F.lit(1)).alias("n"), F.sum(F.size("input_ids")).alias("tokens"),
                      F.sum("n_answer").alias("answer_tokens"), F.sum(F.col("truncated").cast("int")).alias("truncated"))
                 .collect())
        if sum(r["n"] for r in stats) != n_in:
            raise RuntimeError(f"row counts do not add up: {n_in} rows in, {sum(r['n'] for r in stats)} rendered")
        rejected: dict[str, int] = {}
        for r in stats:
            if r["reason"] is not None:
                rejected[r["reason"]] = rejected.get(r["reason"], 0) + r["n"]
        n_rej = sum(rejected.values())
        if n_rej:
            rejects = (rejects_frame(docs.filter(F.col("reason").isNotNull()), STAGE)
                       .repartition(max(1, math.ceil(n_rej / 1_000_000)), "id").sortWithinPartitions("id", "reason", "raw"))
            write_parquet(rejects, uris.qualify(staging / "rejects"))
        info["rows"] = n_rej

    splits: dict[str, SplitStats] = {}
    seq_len, pad_id, buffer_docs = fcfg.seq_len, tok.pad_id, fcfg.pack_buffer_docs  # plain values for the closure
    for split in SPLITS:
        row = next((r for r in stats if r["reason"] is None and r["split"] == split), None)
        n_docs, doc_tokens = (row["n"], int(row["tokens"])) if row else (0, 0)
        with timer.step(f"pack {split}") as info:
            n_parts = max(1, math.ceil(doc_tokens / fcfg.shard_tokens))
            part = (docs.filter((F.col("split") == split) & F.col("reason").isNull()).select("key", "input_ids", "labels")
                    .repartition(n_parts, "key").sortWithinPartitions("key"))
            files = write_parquet(part.mapInPandas(lambda it: pack_partitions(it, seq_len, pad_id, buffer_docs), ROW_SCHEMA),
                                  uris.qualify(staging / "data" / split))
            n_rows = parquet_rows(files)
            info["tokens"] = doc_tokens
        splits[split] = SplitStats(documents=n_docs, rows=n_rows, files=len(files), doc_tokens=doc_tokens,
                                   answer_tokens=int(row["answer_tokens"]) if row else 0,
                                   truncated=int(row["truncated"] or 0) if row else 0)
    with timer.step("render sample") as info:
        sample = (docs.filter(F.col("reason").isNull() & F.col("chat").isNotNull()).orderBy("key")
                  .limit(fcfg.render_sample_documents).selectExpr(*[c.split(" ")[0] for c in SAMPLE_SCHEMA.split(", ")])
                  .coalesce(1))
        n_sample = parquet_rows(write_parquet(sample, uris.qualify(staging / SAMPLE_DIR)))
        info["rows"] = n_sample
    counts, extra = describe(  # the same description as every in-process writer's (train_ready.py)
        seq_len=seq_len, tokenizer=tok.spec_for_manifest(), splits=splits, n_in=n_in, rejected=rejected,
        train_on=fcfg.train_on, prompt_context=fcfg.prompt_context, render_sample_documents=n_sample,
        tokenizer_details=tok.identity(),
        split_rule=f"{SPLIT_RULE} (seed={fcfg.seed}, val_fraction={fcfg.val_fraction}, "
                   f"val_max_documents={fcfg.val_max_documents})")
    log.info("[filter] %d in, %d kept, rejected %s; tokens %s; packing efficiency %s",
             n_in, counts["out"], counts["rejected"], extra["tokens"], extra["packing_efficiency"])
    return counts, extra


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
