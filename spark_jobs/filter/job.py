"""Filter stage: enriched artifact -> train-ready artifact (DESIGN.md "filter" and "Contracts").

    spark-submit spark_jobs/filter/job.py --input URI --output URI [--config FILE]

Reads a committed enriched artifact (its files verified against the manifest, local or remote)
and, in Spark, through the shared stage lifecycle (`common.run_stage`):
  1. filtering (filter_rows.py): row checks, question<->answer cosine >= `min_qa_similarity`;
  2. deduplication (dedup.py, called from filter_rows.py): exact duplicates of the whole
     conversation (NFKC, white space collapsed, case folded) and semantic near duplicates (k-means clusters);
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
from pipeline_core.handoffs import (
    DecontamInfo,
    EnrichedInfo,
    FileEntry,
    FilterReports,
    FilterSourceSplits,
    LengthFit,
    LengthFitCategory,
    SourceSplit,
    StageCounts,
)
from pipeline_core.names import Stage
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
from spark_jobs.filter.decontaminate import EvalSet, resolve_eval_sets
from spark_jobs.filter.render_docs import DOC_SCHEMA, render_partitions
from spark_jobs.filter.split import SPLIT_RULE, SPLITS
from spark_jobs.filter.train_ready import KIND, SplitStats, describe
from spark_jobs.near_dups.dedup_types import NearDupReport
from spark_jobs.packing import ROW_SCHEMA, pack_partitions
from spark_jobs.partitioning import FILTER_ROWS_PER_PARTITION, stage_partitions

log = logging.getLogger("spark_jobs.filter")

INPUT_KIND = "enriched"
STAGE = Stage.FILTER
SPEC = StageSpec(STAGE, KIND, "mft-filter")
# per kept record, beside the packed rows (`provenance/*.parquet`; the trainer reads data/ only)
PROVENANCE = (("license", "string"), ("generator", "string"), ("used_in", "array<string>"),
              ("seed_dataset", "string"), ("source_split", "string"))


def _input_paths(input_uri: str, manifest: Manifest, cfg: Config, ctx: StageContext) -> list[str]:
    """file:// URIs of the committed input's data files, each verified against the manifest (size,
    sha256): in place for a local artifact, fetched through the shared store client otherwise
    (Spark here has no object-store connector)."""
    files = [f for f in FileEntry.all_of(manifest, "data/") if f.path.endswith(".parquet")]
    if not files:
        raise ValueError(f"--input {input_uri}: the enriched artifact has no data/*.parquet files")
    if uris.is_local(input_uri):
        root = uris.to_local_path(input_uri)
        for f in files:  # under the payload prefix its manifest names (one writer per artifact)
            p = root / manifest.object_path(f.path)
            if not p.is_file():
                raise CorruptArtifact(f"{file_uri(input_uri, manifest, f.path)} is listed in the manifest but missing")
            if p.stat().st_size != f.size or sha256_file(p) != f.sha256:
                raise CorruptArtifact(f"{file_uri(input_uri, manifest, f.path)} does not match its manifest (size/sha256)")
        return [file_uri(input_uri, manifest, f.path) for f in files]
    local = download_dir(ctx.staging)
    fetch_artifact(input_uri, local, cfg.storage, prefix="data/")
    return [uris.qualify(local / f.path) for f in files]


def stage_config(cfg: Config, input_uri: str, input_manifest: Manifest,
                 eval_sets: Sequence[EvalSet] = ()) -> dict[str, Any]:
    """What determines the artifact's content: recorded in (and hashed into) the manifest. The eval
    sets' content hashes are part of it: a changed eval file never matches an artifact made with the old one."""
    out = {"stage": STAGE, "input": input_uri, "input_manifest_sha256": input_manifest.sha256,
           "filter": cfg.filter.content_settings()}
    if eval_sets:
        out["eval_sets"] = [es.as_config() for es in eval_sets]
    return out


def run(input_uri: str, output_uri: str, cfg: Config, spark=None) -> Manifest:
    """Filter `input_uri` (committed enriched artifact) into `output_uri` (train-ready artifact)."""
    from spark_jobs.conversations.chat_format import load_tokenizer

    input_uri = uris.require_uri(input_uri, "--input").rstrip("/")
    output_uri = uris.require_uri(output_uri, "--output").rstrip("/")
    in_manifest = require_manifest(input_uri, cfg.storage, kind=INPUT_KIND)
    made_for = EnrichedInfo.from_manifest(in_manifest).objective
    if made_for != cfg.filter.objective:
        raise ValueError(f"--input {input_uri}: the enriched artifact holds {made_for!r} records but filter.objective="
                         f"{cfg.filter.objective!r}; enrich the data with the same objective")
    eval_sets = resolve_eval_sets(cfg.filter.decontaminate, cfg.storage)  # listed and hashed before compute

    def check_tokenizer() -> None:  # invalid tokenizer settings fail here, before any compute
        try:
            load_tokenizer(cfg.filter.tokenizer)
        except Exception as e:
            raise ValueError(f"filter.tokenizer: cannot load {cfg.filter.tokenizer!r}: {e}") from e

    return run_stage(SPEC, cfg, cfg.filter, output_uri, stage_config(cfg, input_uri, in_manifest, eval_sets),
                     lambda ctx: _compute(ctx, input_uri, in_manifest, cfg, eval_sets), spark=spark,
                     before_compute=check_tokenizer)


def _compute(ctx: StageContext, input_uri: str, in_manifest: Manifest, cfg: Config,
             eval_sets: Sequence[EvalSet] = ()) -> StageOutput:
    from pyspark.sql import functions as F

    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.filter import decontaminate, filter_rows

    fcfg, spark, timer, staging = cfg.filter, ctx.spark, ctx.timer, ctx.staging
    tok = load_tokenizer(fcfg.tokenizer)
    docs_uri = uris.qualify(staging.with_name(staging.name + "-docs"))  # beside staging: never published
    with timer.step("filter+dedup+render") as info:
        df = spark.read.parquet(*_input_paths(input_uri, in_manifest, cfg, ctx))
        n_in = df.count()
        stage_partitions(spark, fcfg.shuffle_partitions, n_in, FILTER_ROWS_PER_PARTITION)
        decon = (decontaminate.prepare(spark, list(eval_sets), fcfg, download_dir(staging), cfg.storage, ctx.persist)
                 if eval_sets else None)
        reports: list = []
        row_stats: dict = {}
        decided = filter_rows.decisions(ctx, filter_rows.keyed(df, fcfg), fcfg, reports, decon, row_stats)
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
            opt("rejected", "string").alias("rejected"),  # objective dpo: the rejected answer
            opt("source_split", "string").alias("source_split"),
        )
        sample_below = key_threshold(fcfg.render_sample_documents, n_in)
        write_parquet(render_in.mapInPandas(lambda it: render_partitions(it, fcfg, sample_below), DOC_SCHEMA), docs_uri)
        info["rows"] = n_in
        provenance = j.select(F.col("_key").alias("key"), *[opt(c, t).alias(c) for c, t in PROVENANCE])

    try:
        decon_info = next((r for r in reports if isinstance(r, DecontamInfo)), None)
        counts, extra = _pack_and_describe(ctx, docs_uri, n_in, cfg, tok, decon_info, provenance)
        if "identity_matches_kept" in row_stats:
            extra["identity_matches_kept"] = row_stats["identity_matches_kept"]
        # method, parameters and the recall measured on this data (spark_jobs/near_dups/dedup.py)
        near = [r for r in reports if isinstance(r, NearDupReport)]
        extra.update(FilterReports(near_duplicates=near[0].as_manifest() if near else None).to_extra())
        return StageOutput(counts, extra, inputs=(input_uri,))
    finally:
        clean_staging(uris.to_local_path(docs_uri))


def split_fit(docs, fcfg) -> tuple[LengthFit, FilterSourceSplits]:
    """The per-split length fit, counted once (one aggregation over each record's first document)
    and shown two ways: `length_fit` per record category (issue 29: rendered, fit as rendered, fit
    without reasoning, earlier reasoning dropped, kept) and `source_splits` per input split (issue
    28: records in, rejected by reason, kept, measured, fit `seq_len` with and without reasoning)."""
    from pyspark.sql import functions as F

    n, seq_len = F.col("n_tokens"), fcfg.seq_len
    fits = lambda c: F.sum((F.col(c) <= seq_len).cast("int"))  # noqa: E731
    rows = (docs.filter(F.col("doc") == 0).groupBy("category", "source_split", "reason")
            .agg(F.count(F.lit(1)).alias("n"), F.count(n).alias("rendered"), fits("n_tokens").alias("fit"),
                 fits("len_with_reasoning").alias("fit_with"), fits("len_without_reasoning").alias("fit_without"),
                 F.sum(F.col("reasoning_dropped").cast("int")).alias("reasoning_dropped"))
            .collect())
    per_category: dict[str, dict[str, int]] = {}  # -> LengthFitCategory
    per_source: dict[str, dict[str, Any]] = {}
    for r in rows:
        v = {k: int(r[k] or 0) for k in ("n", "rendered", "fit", "fit_with", "fit_without", "reasoning_dropped")}
        if v["rendered"]:
            c = per_category.setdefault(str(r["category"] or "unknown"), dict.fromkeys(
                ("rendered", "fit", "fit_without_reasoning", "reasoning_dropped", "kept"), 0))
            c["rendered"] += v["rendered"]
            c["fit"] += v["fit"]
            c["fit_without_reasoning"] += v["fit_without"]
            c["reasoning_dropped"] += v["reasoning_dropped"]
            c["kept"] += v["rendered"] if r["reason"] is None else 0
        s = per_source.setdefault(r["source_split"] or "", {"rows_in": 0, "rows_out": 0, "rejected": {}, "measured": 0,
                                                             "fit_seq_len_with_reasoning": 0,
                                                             "fit_seq_len_without_reasoning": 0})
        s["rows_in"] += v["n"]
        if r["reason"] is None:
            s["rows_out"] += v["n"]
        else:
            s["rejected"][r["reason"]] = s["rejected"].get(r["reason"], 0) + v["n"]
        s["measured"] += v["rendered"]
        s["fit_seq_len_with_reasoning"] += v["fit_with"]
        s["fit_seq_len_without_reasoning"] += v["fit_without"]
    length_fit = LengthFit(seq_len=seq_len, overflow=fcfg.overflow, with_reasoning=fcfg.train_on_reasoning,
                           splits={k: LengthFitCategory(**v) for k, v in sorted(per_category.items())})
    return length_fit, FilterSourceSplits(source_splits={k: SourceSplit(**v) for k, v in sorted(per_source.items())})


def _pack_and_describe(ctx: StageContext, docs_uri: str, n_in: int, cfg: Config, tok,
                       decon: DecontamInfo | None = None, provenance=None) -> tuple[StageCounts, dict]:
    from pyspark.sql import functions as F

    fcfg, spark, timer, staging = cfg.filter, ctx.spark, ctx.timer, ctx.staging
    with timer.step("count+rejects") as info:
        docs = spark.read.parquet(docs_uri)
        first = F.col("doc") == 0  # a record's first row carries its accounting; later rows are its prefix documents
        stats = (docs.groupBy("split", "reason")
                 .agg(F.sum(first.cast("int")).alias("n"), F.count(F.lit(1)).alias("docs"),
                      F.sum(F.size("input_ids")).alias("tokens"),
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

    length_fit, source_splits = split_fit(docs, fcfg)
    splits: dict[str, SplitStats] = {}
    seq_len, pad_id, buffer_docs = fcfg.seq_len, tok.pad_id, fcfg.pack_buffer_docs  # plain values for the closure
    pairs = fcfg.objective == "dpo"  # one preference pair per row (chosen, rejected), never packed together
    for split in SPLITS:
        row = next((r for r in stats if r["reason"] is None and r["split"] == split), None)
        n_docs, doc_tokens = (row["docs"], int(row["tokens"])) if row else (0, 0)
        with timer.step(f"pack {split}") as info:
            n_parts = max(1, math.ceil(doc_tokens / fcfg.shard_tokens))
            part = (docs.filter((F.col("split") == split) & F.col("reason").isNull())
                    .select("key", "doc", "input_ids", "labels", "split_at")
                    .repartition(n_parts, "key").sortWithinPartitions("key", "doc"))
            files = write_parquet(part.mapInPandas(lambda it: pack_partitions(it, seq_len, pad_id, buffer_docs, pairs),
                                                   ROW_SCHEMA),
                                  uris.qualify(staging / "data" / split))
            n_rows = parquet_rows(files)
            info["tokens"] = doc_tokens
        splits[split] = SplitStats(documents=n_docs, rows=n_rows, files=len(files), doc_tokens=doc_tokens,
                                   answer_tokens=int(row["answer_tokens"]) if row else 0,
                                   truncated=int(row["truncated"] or 0) if row else 0,
                                   records=int(row["n"]) if row else 0)
    with timer.step("render sample") as info:
        sample = (docs.filter(F.col("reason").isNull() & F.col("chat").isNotNull()).orderBy("key")
                  .limit(fcfg.render_sample_documents).selectExpr(*[c.split(" ")[0] for c in SAMPLE_SCHEMA.split(", ")])
                  .coalesce(1))
        n_sample = parquet_rows(write_parquet(sample, uris.qualify(staging / SAMPLE_DIR)))
        info["rows"] = n_sample
    counts, extra = describe(  # the same description as every in-process writer's (train_ready.py)
        seq_len=seq_len, tokenizer=tok.spec_for_manifest(), splits=splits, n_in=n_in, rejected=rejected,
        train_on=fcfg.train_on, prompt_context=fcfg.prompt_context, render_sample_documents=n_sample,
        tokenizer_details=tok.identity(), objective=fcfg.objective, decontamination=decon,
        split_rule=f"{SPLIT_RULE} (seed={fcfg.seed}, val_fraction={fcfg.val_fraction}, "
                   f"val_max_documents={fcfg.val_max_documents})")
    extra.update(FilterReports(length_fit=length_fit).to_extra())
    extra.update(source_splits.to_extra())
    if provenance is not None:
        with timer.step("provenance") as info:
            kept = docs.filter(F.col("reason").isNull() & first).select("key", "id", "split")
            per = docs.filter(F.col("reason").isNull()).groupBy("key").agg(F.count(F.lit(1)).alias("documents"))
            prov = kept.join(per, "key").join(provenance, "key").drop("key").repartition(1).sortWithinPartitions("id")
            write_parquet(prov, uris.qualify(staging / "provenance"))
        extra["licenses"] = {(r[0] if r[0] is not None else ""): int(r[1]) for r in
                             spark.read.parquet(uris.qualify(staging / "provenance")).groupBy("license").count().collect()}
    log.info("[filter] %d in, %d kept, rejected %s; tokens %s; packing efficiency %s",
             n_in, counts.rows_out, counts.rejected, extra["tokens"], extra["packing_efficiency"])
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
    from spark_jobs.filter.job import main as _main

    sys.exit(_main())
