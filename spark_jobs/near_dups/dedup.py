"""Exact and semantic near-duplicate detection that scales with the number of rows.

Exact duplicates: same hash of the normalised text (lower-cased, whitespace collapsed) of
prompt and answer; the record with the smallest key is kept.

Near duplicates: two records are near duplicates when the mean of their question cosine and
answer cosine (= the cosine of the concatenated, normalised [question; answer] embeddings, over 2)
is >= the threshold AND the near-duplicate guard agrees (near_dup_guard.py: same numbers in the
question, same code identifiers and literals, same final answer; setting `near_dup_guard`). No
all-pairs join: near_dup_clusters.py clusters the rows by k-means and compares exactly inside each
cluster (recall independent of the row count). Which rows go is decided over all such pairs by
keep_first.py (greedy keep-first in key order): a row is dropped only as a near duplicate of a row
that is kept, which its reject names; deterministic, independent of partitioning and order (a
chain a~b~c with a !~ c keeps a and c).

`near_duplicates` is the entry point the filter calls: the pairs, keep-first, and a `NearDupReport`
with the recall measured on the run's own rows (dedup_recall.py) for the manifest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from spark_jobs.near_dups.dedup_types import ClusterSettings, NearDupReport, NearDupSettings
from spark_jobs.near_dups.keep_first import keep_first

log = logging.getLogger(__name__)

EXACT_DUPLICATE = "exact_duplicate"
NEAR_DUPLICATE = "near_duplicate"


def normalised_text(col: Column) -> Column:
    return F.trim(F.regexp_replace(F.lower(F.coalesce(col, F.lit(""))), r"\s+", " "))


def text_hash(*cols: Column) -> Column:
    """sha256 of the normalised texts, \\u0001-separated (a field boundary cannot be faked by text)."""
    return F.sha2(F.concat_ws("\u0001", *[normalised_text(c) for c in cols]), 256)


def mark_exact_duplicates(df: DataFrame, *, key: str, hash_col: str, eligible: Column) -> DataFrame:
    """Adds `_exact_rep` (id of the kept record) to eligible rows that duplicate an eligible row with a
    smaller key; null elsewhere. Ineligible rows never act as representatives."""
    w = Window.partitionBy(hash_col).orderBy(F.when(eligible, 0).otherwise(1), F.col(key))
    first_id = F.first("id").over(w)
    first_ok = F.first(eligible).over(w)
    is_dup = eligible & first_ok & (F.row_number().over(w) > 1)
    return df.withColumn("_exact_rep", F.when(is_dup, first_id))


def cluster_warnings(largest: int, unsplit_oversized: int, s: ClusterSettings) -> tuple[str, ...]:
    """In-cluster work is quadratic in a cluster's size: say so when splitting did not bound it."""
    limit = s.max_cluster_factor * s.cluster_size
    if largest <= 2 * limit:  # the estimates that drive the splits are from a sample: allow their noise
        return ()
    return (f"largest near-duplicate cluster {largest:,} rows (limit {limit:,.0f} = max_cluster_factor x cluster_size; "
            f"{unsplit_oversized} still oversized after split_rounds={s.split_rounds}): its pairwise work grows with "
            f"the square of its size; raise near_dup_split_rounds or lower near_dup_max_cluster_factor",)


def settings_for(f) -> NearDupSettings:
    """NearDupSettings of a FilterSection (pipeline_core.config)."""
    return NearDupSettings(
        threshold=f.near_dup_threshold, method=f.near_dup_method, recall_sample=f.near_dup_recall_sample,
        guard=f.near_dup_guard,
        cluster=ClusterSettings(cluster_size=f.near_dup_cluster_size, probes=f.near_dup_probes,
                                probe_margin=f.near_dup_probe_margin, max_cluster_factor=f.near_dup_max_cluster_factor,
                                split_rounds=f.near_dup_split_rounds, coarse_probes=f.near_dup_coarse_probes,
                                seed=f.near_dup_seed))


@dataclass(frozen=True)
class NearDuplicates:
    frame: DataFrame  # key, _near_rep (id of the kept record), _near_sim
    saved: DataFrame  # _key, _saved (pairs the guard kept apart), _lkey, _lid, _sim (its most similar one)
    report: NearDupReport


def near_duplicates(df: DataFrame, *, key: str, vec: str, settings: NearDupSettings, rows: int | None = None,
                    group: str | None = None, guard: str | None = None) -> NearDuplicates:
    """Near duplicates of `df` (key, id, vec = concatenated unit question and answer vectors) by
    clustering (near_dup_clusters.py), with the recall measured on a sample of these rows. With `group` (a long
    column), two rows can be near duplicates only when their group values are equal: the filter
    passes a hash of the conversation's context, so a multi-turn or contextual conversation is never
    dropped as a copy of a single-turn one that ends in the same question and answer. With `guard`
    (a long column, near_dup_guard.guard_column), two rows can be near duplicates only when their
    guard keys are equal too; the pairs that differ only there are counted ("saved"). `df` is read
    several times: persist it first."""
    from spark_jobs.near_dups.dedup_recall import measure_recall
    from spark_jobs.near_dups.near_dup_clusters import find_near_duplicates_clustered

    rows = df.count() if rows is None else rows
    t, c = settings.threshold, settings.cluster
    got = find_near_duplicates_clustered(df, key=key, vec=vec, threshold=t, rows=rows, s=c, group=group, guard=guard)
    clustering = got.clustering
    frame, saved = keep_first(got.edges, key=key), got.saved.persist()
    saved.count()  # both materialised from the cached in-cluster output, which can then go
    size_stats = got.sizes.agg(F.count(F.lit(1)).alias("k"), F.max("count").alias("mx"),
                               F.avg("count").alias("avg")).first()
    got.cached.unpersist()
    largest = int(size_stats["mx"] or 0)
    warnings = cluster_warnings(largest, clustering.unsplit_oversized, c)
    for w in warnings:
        log.warning("near duplicates: %s", w)
    measured = None
    if settings.recall_sample > 0 and rows > 1:
        measured = measure_recall(df, frame, key=key, vec=vec, threshold=t, rows=rows, sample=settings.recall_sample,
                                  seed=settings.recall_seed, group=group, guard=guard)
        if measured.recall is not None:
            log.info("near duplicates (%s): measured recall %.4f [%.4f, %.4f] on %d sampled rows with a duplicate",
                     settings.method, measured.recall, measured.low_95, measured.high_95, measured.with_duplicate)
    agg = saved.agg(F.count(F.lit(1)).alias("rows"), F.sum("_saved").alias("pairs")).first()
    report = NearDupReport(method=settings.method, rows=rows, threshold=t,
                           parameters={**c.__dict__, "sample_rows": clustering.sample_rows}, measured=measured,
                           clusters=int(size_stats["k"] or 0), largest_cluster=largest,
                           mean_cluster=round(float(size_stats["avg"] or 0), 1),
                           split_clusters=clustering.split_clusters, assignment_agreement=clustering.agreement,
                           warnings=warnings, guard=settings.guard, guard_saved_pairs=int(agg["pairs"] or 0),
                           guard_saved_rows=int(agg["rows"] or 0))
    return NearDuplicates(frame, saved, report)
