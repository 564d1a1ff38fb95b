"""The filter's row decisions in Spark: row checks, exact and near duplicates, train/val split.

`keyed(df, fcfg)` adds to every enriched row the keys computed from its conversation (one pandas
UDF): `_prompt_key` (sha256 of the canonical prompt, what the split hashes), `_text_hash` (of the
whole conversation, what exact dedup compares) and `_key` (a stable row key: id, text hash, and the
row's place in its input file, so two rows never share one). Identity (`filter.identity_patterns`: another model's self-identification in an answer or its
reasoning -> `identity_mismatch`, or kept and counted) and license (`filter.licenses` allowlist ->
`license_excluded`) are row checks too. `decisions(ctx, keyed, fcfg)` returns
the small frame of rows that are *not* plain kept-in-their-split: (`_key`, `reason`, `detail`,
`split`), from a lean persisted frame (keys, vectors, similarity; no messages). The caller joins
it back to the full rows, so messages are read once, when rendering, and never persisted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd  # module level: pandas_udf resolves its type hints in this module

from pipeline_core.config import FilterSection
from spark_jobs.conversations.conversation import (
    ConversationOptions,
    RenderError,
    build_conversation,
    dedup_text,
    prompt_text,
    seed_prompt_key,
    sha256_hex,
)
from spark_jobs.conversations.normalize import message_parts
from spark_jobs.near_dups.dedup_types import NearDupReport, SavedPair
from spark_jobs.near_dups.near_dup_guard import guard_column

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from spark_jobs.common import StageContext
    from spark_jobs.filter.decontaminate import Decontaminator

MISSING_FIELD = "missing_field"
LOW_QA_SIMILARITY = "low_qa_similarity"
IDENTITY_MISMATCH = "identity_mismatch"
LICENSE_EXCLUDED = "license_excluded"
KEYS_SCHEMA = "prompt_key string, text_hash string, error string, error_reason string, identity string"


def conversation_options(fcfg: FilterSection) -> ConversationOptions:
    return ConversationOptions(fcfg.train_on_reasoning, fcfg.reasoning_marker_on, fcfg.reasoning_marker_off,
                               use_flags=fcfg.train_on == "dataset_flags")


def identity_match(messages: Sequence, patterns: re.Pattern | None) -> str | None:
    """The first self-identification `patterns` finds in an assistant turn's text or reasoning."""
    if patterns is None:
        return None
    for m in messages:
        if isinstance(m, dict) and str(m.get("role") or "").strip().lower() == "assistant":
            visible, trace = message_parts(m)
            for text in (visible, trace):
                hit = patterns.search(text) if text else None
                if hit:
                    return hit.group(0)
    return None


def identity_regex(patterns: Sequence[str]) -> re.Pattern | None:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE) if patterns else None


def conversation_keys(messages_json: str | None, metadata: str | None, reasoning: str | None,
                      opts: ConversationOptions, identity: re.Pattern | None = None,
                      ) -> tuple[str | None, str | None, str | None, str | None, str | None]:
    """(prompt key, conversation hash, None, None, identity match) or (None, None, error, reason,
    None) for one record. Rows of one seed conversation share their prompt key (`seed_prompt_key`)."""
    try:
        messages = json.loads(messages_json) if messages_json else []
        conv = build_conversation(messages, metadata, reasoning, opts)
    except RenderError as e:
        return None, None, e.detail, e.reason, None
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        return None, None, f"{type(e).__name__}: {e}"[:300], "render_failed", None
    prompt = seed_prompt_key(metadata) or prompt_text(conv)
    return sha256_hex(prompt), sha256_hex(dedup_text(conv)), None, None, identity_match(messages, identity)


def _keys_udf(opts: ConversationOptions, patterns: Sequence[str]):
    from pyspark.sql.functions import pandas_udf

    @pandas_udf(KEYS_SCHEMA)
    def keys(messages_json: pd.Series, metadata: pd.Series, reasoning: pd.Series) -> pd.DataFrame:
        identity = identity_regex(patterns)
        rows = [conversation_keys(m, md, r, opts, identity)
                for m, md, r in zip(messages_json, metadata, reasoning, strict=True)]
        return pd.DataFrame(rows, columns=["prompt_key", "text_hash", "error", "error_reason", "identity"])

    return keys


def _opt(df: DataFrame, name: str) -> Column:
    from pyspark.sql import functions as F

    return F.col(name) if name in df.columns else F.lit(None).cast("string")


def located(df: DataFrame) -> DataFrame:
    """Enriched rows (straight from Parquet) + `_file` (file name), `_row` (row in the file): a
    position that names the row on every re-read, and `_messages_json`."""
    from pyspark.sql import functions as F

    msgs = F.to_json("messages") if "messages" in df.columns else F.lit(None).cast("string")
    return (df.withColumn("_messages_json", msgs)
            .withColumn("_file", F.element_at(F.split(F.col("_metadata.file_path"), "/"), -1))
            .withColumn("_row", F.col("_metadata.row_index")))


def context_key(df: DataFrame) -> Column:
    """A long hash of everything in a record's prompt except its final question, as enrich split it:
    the context sentences (system prompt, earlier turns, context inside the last user turn,
    normalised) and the tool schemas. Near duplicates are searched only among records with equal
    context keys, so "same last question and answer" does not make a multi-turn, contextual or
    tool conversation a copy of a single-turn one (each is a different training example)."""
    from pyspark.sql import functions as F

    from spark_jobs.near_dups.dedup import normalised_text

    sentences = (F.concat_ws("\u0001", F.transform(F.col("context_sentences"), normalised_text))
                 if "context_sentences" in df.columns else F.lit(""))
    tools = F.coalesce(F.get_json_object(_opt(df, "metadata"), "$.tools"), F.lit(""))
    return F.xxhash64(F.coalesce(sentences, F.lit("")), tools)


def keyed(df: DataFrame, fcfg: FilterSection) -> DataFrame:
    """`located` rows + `_prompt_key`, `_text_hash`, `_key`, `_check` (first failed row check's reason
    or null) and `_check_detail`."""
    from pyspark.sql import functions as F

    df = (located(df)
          .withColumn("_k", _keys_udf(conversation_options(fcfg), fcfg.identity_patterns)(
              "_messages_json", _opt(df, "metadata"), _opt(df, "reasoning")))
          .withColumn("_identity", F.col("_k.identity"))
          .withColumn("_prompt_key", F.col("_k.prompt_key"))
          .withColumn("_text_hash", F.col("_k.text_hash"))
          .withColumn("_key", F.xxhash64(F.coalesce(F.col("id"), F.lit("")), F.coalesce("_text_hash", F.lit("")),
                                         "_file", "_row"))
          .withColumn("_context_key", context_key(df))
          .withColumn("_guard", guard_column(F.col("question"), F.col("answer"), fcfg.near_dup_guard)))
    blank = lambda c: F.col(c).isNull() | (F.length(F.trim(F.col(c))) == 0)  # noqa: E731
    emb_bad = lambda c: F.col(c).isNull() | (F.size(F.col(c)) == 0)  # noqa: E731
    checks = [
        (blank("id"), MISSING_FIELD, F.lit("id is null or empty")),
        (blank("question"), MISSING_FIELD, F.lit("question is null or empty")),
        (blank("answer"), MISSING_FIELD, F.lit("answer is null or empty")),
        (F.col("_k.error").isNotNull(), F.col("_k.error_reason"), F.concat(F.lit("conversation: "), F.col("_k.error"))),
        *([(F.col("_identity").isNotNull(), IDENTITY_MISMATCH,
            F.concat(F.lit("self-identification: "), F.col("_identity")))] if fcfg.identity_action == "reject" else []),
        *([(~F.coalesce(_opt(df, "license").isin(fcfg.licenses), F.lit(False)), LICENSE_EXCLUDED,
            F.concat(F.lit("license "), F.coalesce(_opt(df, "license"), F.lit("null")),
                     F.lit(f" is not in filter.licenses {fcfg.licenses}")))] if fcfg.licenses is not None else []),
        (emb_bad("question_embedding") | emb_bad("answer_embedding")
         | (F.size("question_embedding") != F.size("answer_embedding")), MISSING_FIELD,
         F.lit("question_embedding/answer_embedding missing or of different sizes")),
        (F.col("sim_question_answer").isNull(), MISSING_FIELD, F.lit("sim_question_answer is null")),
        (F.col("sim_question_answer") < fcfg.min_qa_similarity, LOW_QA_SIMILARITY,
         F.format_string(f"sim_question_answer %.4f < min_qa_similarity={fcfg.min_qa_similarity}",
                         F.col("sim_question_answer"))),
    ]
    if fcfg.objective == "dpo":  # preference pairs: prompt<->chosen is the sim_question_answer check above
        from spark_jobs.preference import LOW_PREFERENCE_MARGIN

        strength = _opt(df, "preference_strength").cast("int")
        checks += [
            (blank("rejected") if "rejected" in df.columns else F.lit(True), MISSING_FIELD,
             F.lit("rejected is null or empty (objective dpo needs an enriched artifact of preference records)")),
            (strength.isNotNull() & (strength < fcfg.min_preference_margin), LOW_PREFERENCE_MARGIN,
             F.format_string(f"|overall_preference| %d < min_preference_margin={fcfg.min_preference_margin}",
                             strength)),
        ]
    reason, detail = F.lit(None).cast("string"), F.lit(None).cast("string")
    for cond, r, d in reversed(checks):  # the first failing check wins
        reason = F.when(cond, r if not isinstance(r, str) else F.lit(r)).otherwise(reason)
        detail = F.when(cond, d).otherwise(detail)
    return df.withColumn("_check", reason).withColumn("_check_detail", detail).drop("_k")


CAP_RANGE_HEX = 3  # the val cap's running sum is computed per 16**3 = 4,096 ranges of the ordering hash


def prompts_past_cap(per_prompt: DataFrame, seed: int, cap: int) -> DataFrame:
    """`_prompt_key` of the prompts (`_prompt_key`, `_n` documents) past `cap` documents in the order
    of sha256(f"{seed}:{prompt_key}"): those whose running total, this prompt included, exceeds it.
    The running total is a window per range of the hash's first hex digits plus the documents of
    every earlier range (4,096 totals through the driver): the prompts a single global running sum
    would pick, without moving every val prompt into one partition (a window without partitionBy)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ordered = (per_prompt.withColumn("_h", F.sha2(F.concat(F.lit(f"{seed}:"), F.col("_prompt_key")), 256))
               .withColumn("_range", F.substring("_h", 1, CAP_RANGE_HEX)))
    totals = sorted((r["_range"], int(r["_docs"])) for r in
                    ordered.groupBy("_range").agg(F.sum("_n").alias("_docs")).collect())  # fixed-width hex: str order
    before, offsets = 0, []
    for rng, docs in totals:
        offsets.append((rng, before))
        before += docs
    spark = per_prompt.sparkSession
    if before <= cap:
        return spark.createDataFrame([], "_prompt_key string")
    w = Window.partitionBy("_range").orderBy("_h", "_prompt_key").rowsBetween(Window.unboundedPreceding, 0)
    return (ordered.join(F.broadcast(spark.createDataFrame(offsets, "_range string, _before long")), "_range")
            .withColumn("_cum", F.col("_before") + F.sum("_n").over(w))
            .filter(F.col("_cum") > cap).select("_prompt_key"))


SAVED_EXAMPLES = 5  # guard-saved pairs per split in the manifest (the data report shows them)


def saved_by_split(report: NearDupReport, saved: DataFrame, near: DataFrame, lean: DataFrame,
                   fcfg: FilterSection) -> NearDupReport:
    """The report with the guard-saved pairs counted by the split of their larger-key row's prompt
    (the filter's split rule) and a few examples per split, most similar first; the dropped near
    duplicates counted by the same rule (the data report shows both side by side)."""
    from dataclasses import replace

    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from spark_jobs.filter.split import split_column

    rows = saved.join(lean.select("_key", "id", "_prompt_key"), "_key").withColumn(
        "_split", split_column("_prompt_key", fcfg.seed, fcfg.val_fraction)).persist()
    counts = {r["_split"]: int(r["n"]) for r in rows.groupBy("_split").agg(F.sum("_saved").alias("n")).collect()}
    w = Window.partitionBy("_split").orderBy(F.desc("_sim"), "_key")
    top = (rows.withColumn("_rank", F.row_number().over(w)).where(F.col("_rank") <= SAVED_EXAMPLES)
           .orderBy("_split", "_rank").collect())
    rows.unpersist()
    dropped = {r["_split"]: int(r["n"]) for r in near.join(lean.select("_key", "_prompt_key"), "_key").groupBy(
        split_column("_prompt_key", fcfg.seed, fcfg.val_fraction).alias("_split")).agg(F.count(F.lit(1)).alias("n")).collect()}
    examples = tuple(SavedPair(r["_split"], r["id"], r["_lid"], round(float(r["_sim"]), 4)) for r in top)
    return replace(report, guard_saved_by_split=dict(sorted(counts.items())), guard_saved_examples=examples,
                   dropped_by_split=dict(sorted(dropped.items())))


def decisions(ctx: StageContext, rows: DataFrame, fcfg: FilterSection, reports: list | None = None,
              decon: Decontaminator | None = None, stats: dict | None = None) -> DataFrame:
    """(`_file`, `_row`, `_key`, `reason`, `detail`, `split`) for every row: `reason` null = kept, in
    `split`. Computed on a lean persisted frame (no messages; the conversation UDF runs once). The
    near-duplicate search's report (method, parameters, measured recall) and, with `decon`, the
    decontamination's (rows removed per eval set) are appended to `reports`."""
    from pyspark.sql import functions as F

    from spark_jobs.filter import decontaminate as dc
    from spark_jobs.filter.split import VAL, split_column
    from spark_jobs.near_dups import dedup

    grams = [dc.record_grams(F.col("_messages_json"), fcfg, decon.short_lengths).alias("_grams")] if decon else []
    lean = ctx.persist(rows.select(
        "id", "_file", "_row", "_key", "_prompt_key", "_text_hash", "_context_key", "_guard", "_check", "_check_detail",
        "_identity", F.concat(F.col("question_embedding"), F.col("answer_embedding")).alias("_vec"), *grams,
    ))
    ok = F.col("_check").isNull()
    if stats is not None:  # identity_action=keep: the kept rows that match are counted, not dropped
        stats["identity_matches_kept"] = lean.filter(ok & F.col("_identity").isNotNull()).count()
    marks = lean.filter(~ok).select("_key", F.col("_check").alias("reason"), F.col("_check_detail").alias("detail"))
    eligible = lean.filter(ok)
    if decon is not None:  # before dedup: every copy of a contaminated record is a contaminated reject
        hit = ctx.persist(dc.contaminated(eligible, decon.docs, fcfg, [es.spec.name for es in decon.sets]))
        if reports is not None:
            reports.append(decon.report(decon.removed_per_set(hit), fcfg))
        marks = marks.unionByName(hit.select("_key", F.lit(dc.CONTAMINATED).alias("reason"),
                                             dc.reject_detail().alias("detail")))
        eligible = eligible.join(hit.select("_key"), "_key", "left_anti").drop("_grams")
    if fcfg.exact_dedup:
        exact = (dedup.mark_exact_duplicates(eligible, key="_key", hash_col="_text_hash", eligible=F.lit(True))
                 .filter(F.col("_exact_rep").isNotNull()))
        marks = marks.unionByName(exact.select(
            "_key", F.lit(dedup.EXACT_DUPLICATE).alias("reason"),
            F.concat(F.lit("duplicate of "), F.col("_exact_rep")).alias("detail")))
        eligible = eligible.join(exact.select("_key"), "_key", "left_anti")
    if fcfg.near_dup_threshold is not None:
        found = dedup.near_duplicates(eligible, key="_key", vec="_vec", settings=dedup.settings_for(fcfg),
                                      group="_context_key", guard="_guard")
        near = found.frame
        if reports is not None:
            reports.append(saved_by_split(found.report, found.saved, near, lean, fcfg))
        found.saved.unpersist()
        marks = marks.unionByName(near.select(
            "_key", F.lit(dedup.NEAR_DUPLICATE).alias("reason"),
            F.format_string("near duplicate of %s (similarity %.4f)", F.col("_near_rep"), F.col("_near_sim")).alias("detail")))
        eligible = eligible.join(near.select("_key"), "_key", "left_anti")
    marks = marks.withColumn("split", F.lit(None).cast("string"))
    # Validation cap: val prompts in hash order; a prompt whose documents would pass the cap moves,
    # with every answer to it, to train (nothing is dropped, no prompt is on both sides).
    val = eligible.withColumn("_s", split_column("_prompt_key", fcfg.seed, fcfg.val_fraction)).filter(F.col("_s") == VAL)
    per_prompt = val.groupBy("_prompt_key").agg(F.count(F.lit(1)).alias("_n"))
    over = prompts_past_cap(per_prompt, fcfg.seed, fcfg.val_max_documents)
    moved = val.join(over, "_prompt_key").select(
        "_key", F.lit(None).cast("string").alias("reason"), F.lit(None).cast("string").alias("detail"),
        F.lit("train").alias("split"))
    marks = marks.unionByName(moved)
    reason = F.col("reason")
    return lean.select("_file", "_row", "_key", "_prompt_key").join(marks, "_key", "left").select(
        "_file", "_row", "_key", reason,
        F.col("detail"),
        F.when(reason.isNull(), F.coalesce("split", split_column("_prompt_key", fcfg.seed, fcfg.val_fraction))).alias("split"),
    )
