"""Exact and semantic near-duplicate detection that scales with the number of rows.

Exact duplicates: same hash of the normalised text (lower-cased, whitespace collapsed) of
prompt and answer; the record with the smallest key is kept.

Near duplicates: two records are near duplicates when the mean of their question cosine and
answer cosine (= the cosine of the concatenated, normalised [question; answer] embeddings, over 2)
is >= the threshold AND the near-duplicate guard agrees (near_dup_guard.py: same numbers in the
question, same code identifiers and literals, same final answer; setting `near_dup_guard`). No
all-pairs join: random-hyperplane LSH (SimHash) puts each record in
`bands` buckets of `rows_per_band` sign bits. Records sharing at least `min_band_matches` buckets
are candidates (only key pairs are shuffled for this), and only candidates are compared with the
exact cosine. Inside a bucket every member is paired with at most the bucket's `max_leaders`
smallest keys, so work per record is bounded even when a bucket is huge. Which rows go is decided
over all such pairs by keep_first.py (greedy keep-first in key order): a row is dropped only as a
near duplicate of a row that is kept, which its reject names; deterministic, independent of
partitioning and order (a chain a~b~c with a !~ c keeps a and c).

A pair of cosine c collides in one band with p = (1 - arccos(c)/pi) ** rows_per_band; the number
of shared bands is Binomial(bands, p). Defaults (48 bands x 16 bits, >= 2 shared bands): a pair
is a candidate with probability 0.92 at cosine 0.9, 0.975 at 0.92, > 0.999 at 0.95, but only
~0.001 at 0.45 (related topics), which keeps the candidate set, and the time, linear in the rows.
Those numbers hold only while buckets stay under `max_leaders`: the mean bucket holds
rows / 2**rows_per_band records (more on anisotropic embeddings), and beyond the cap pairs of
non-leaders are never compared. `plan_lsh` sizes the bands from the row count, and
`near_duplicates` warns when the mean bucket exceeds the cap.

`near_duplicates` is the entry point the filter calls: method "cluster" (default,
near_dup_clusters.py: k-means first, exact cosine inside clusters, recall independent of bucket
sizes) or "lsh" (this module), and a `NearDupReport` with the recall measured on the run's own
rows (dedup_recall.py) for the manifest.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DoubleType, LongType

from spark_jobs.near_dups.dedup_types import ClusterSettings, LshSettings, NearDupReport, NearDupSettings
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


@functools.lru_cache(maxsize=4)
def _hyperplanes(dim: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((dim, n)).astype(np.float32)


def _signature_udf(bands: int, rows_per_band: int, seed: int):
    weights = (np.int64(1) << np.arange(rows_per_band, dtype=np.int64)).astype(np.int64)

    @F.pandas_udf(ArrayType(LongType()))
    def signature(vecs: pd.Series) -> pd.Series:
        if len(vecs) == 0:
            return pd.Series([], dtype=object)
        m = np.stack([np.asarray(v, dtype=np.float32) for v in vecs])
        bits = (m @ _hyperplanes(m.shape[1], bands * rows_per_band, seed)) > 0
        codes = bits.reshape(len(m), bands, rows_per_band).astype(np.int64) @ weights
        return pd.Series(list(codes))

    return signature


@F.pandas_udf(DoubleType())
def _half_dot(a: pd.Series, b: pd.Series) -> pd.Series:
    """Row-wise dot product / 2 (numpy, vectorised per Arrow batch): mean of question and answer cosine."""
    if len(a) == 0:
        return pd.Series([], dtype="float64")
    return pd.Series(np.einsum("ij,ij->i", np.stack(a.to_numpy()).astype(np.float64),
                               np.stack(b.to_numpy()).astype(np.float64)) / 2.0)


def lsh_pairs(
    df: DataFrame,
    *,
    key: str,
    vec: str,
    threshold: float,
    bands: int,
    rows_per_band: int,
    max_leaders: int,
    seed: int,
    min_band_matches: int = 1,
    group: str | None = None,
    guard: str | None = None,
) -> tuple[DataFrame, DataFrame]:
    """(edges, saved) as near_dup_clusters returns them: edges (_key, _lkey, _lid, _sim) are the
    candidate pairs at sim >= threshold whose `guard` keys agree, saved (_key, _saved, _lkey, _lid,
    _sim) counts per row those whose keys differ. `vec` holds the concatenated unit-norm question
    and answer embeddings; with `group`, only rows of the same group value can be near duplicates (a
    bucket is (band, code, group))."""
    from spark_jobs.near_dups.dedup_recall import group_column
    from spark_jobs.near_dups.near_dup_clusters import saved_per_row

    sig = _signature_udf(bands, rows_per_band, seed)
    buckets = df.select(F.col(key), group_column(group).alias("_group"), F.posexplode(sig(F.col(vec))).alias("_band", "_code"))
    w = Window.partitionBy("_band", "_code", "_group")
    buckets = (
        buckets.withColumn("_n", F.count(F.lit(1)).over(w))
        .filter(F.col("_n") > 1)
        .withColumn("_rank", F.row_number().over(w.orderBy(key)))
    )
    leaders = buckets.filter(F.col("_rank") <= max_leaders).select(
        "_band", "_code", "_group", F.col(key).alias("_lkey"), F.col("_rank").alias("_lrank")
    )
    # Candidate = shares at least `min_band_matches` buckets: only (key, key) pairs travel here; the
    # vectors are joined to the (far fewer) candidates that pass.
    pairs = (
        buckets.join(leaders, ["_band", "_code", "_group"])
        .filter((F.col("_lrank") < F.col("_rank")) & (F.col("_lkey") != F.col(key)))  # equal keys: same record twice
        .groupBy("_lkey", key)
        .agg(F.count(F.lit(1)).alias("_matches"))
        .filter(F.col("_matches") >= min_band_matches)
        .select("_lkey", key)
    )
    left = df.select(F.col(key).alias("_lkey"), F.col("id").alias("_lid"), F.col(vec).alias("_lvec"),
                     group_column(guard).alias("_lguard"))
    right = df.select(key, vec, group_column(guard).alias("_guard"))
    sims = (
        pairs.join(left, "_lkey")
        .join(right, key)
        .select(F.col(key).alias("_key"), "_lkey", "_lid", (F.col("_lguard") == F.col("_guard")).alias("_agree"),
                _half_dot(F.col("_lvec"), F.col(vec)).alias("_sim"))
        .filter(F.col("_sim") >= threshold)
        .persist()
    )
    edges = sims.where("_agree").select("_key", "_lkey", "_lid", "_sim")
    saved = saved_per_row(sims.where(~F.col("_agree")).select("_key", F.lit(1).cast("long").alias("_saved"),
                                                                "_lkey", "_lid", "_sim"))
    return edges, saved


def find_near_duplicates(df: DataFrame, *, key: str, vec: str, **lsh) -> DataFrame:
    """(key, `_near_rep` id of a kept record, `_near_sim`) for every record the LSH method drops
    (`lsh_pairs`' arguments; keep_first.py decides)."""
    edges, _ = lsh_pairs(df, key=key, vec=vec, **lsh)
    return keep_first(edges, key=key)


def lsh_candidate_probability(cosine: float, bands: int, rows_per_band: int, min_band_matches: int) -> float:
    """P(a pair of this cosine shares >= min_band_matches of `bands` buckets) with random-hyperplane
    bits, assuming no bucket exceeds the leader cap: Binomial(bands, (1 - arccos(c)/pi) ** r)."""
    p = (1.0 - math.acos(max(-1.0, min(1.0, cosine))) / math.pi) ** rows_per_band
    miss = sum(math.comb(bands, i) * p**i * (1 - p) ** (bands - i) for i in range(min_band_matches))
    return 1.0 - miss


def plan_lsh(rows: int, threshold: float, *, max_leaders: int, min_band_matches: int, target_recall: float = 0.95,
             min_rows_per_band: int = 16, max_bands: int = 512) -> LshSettings:
    """Bits per band so that the mean bucket (rows / 2**r) stays under the leader cap, then the fewest
    bands that reach `target_recall` at the threshold. The bands grow with log(rows): LSH's work is
    not linear in the rows at a fixed recall, which is why "cluster" is the default method."""
    r = max(min_rows_per_band, math.ceil(math.log2(max(rows, 2) / max_leaders)))
    for b in range(max(min_band_matches, 1), max_bands + 1):
        if lsh_candidate_probability(threshold, b, r, min_band_matches) >= target_recall:
            return LshSettings(bands=b, rows_per_band=r, min_band_matches=min_band_matches, max_leaders=max_leaders)
    return LshSettings(bands=max_bands, rows_per_band=r, min_band_matches=min_band_matches, max_leaders=max_leaders)


def lsh_warnings(rows: int, s: LshSettings) -> tuple[str, ...]:
    mean_bucket = rows / 2**s.rows_per_band
    if mean_bucket > s.max_leaders:
        return (f"mean LSH bucket {mean_bucket:,.0f} rows > max_leaders={s.max_leaders}: pairs beyond the cap are "
                f"never compared and recall falls under the stated value; raise lsh_rows_per_band to "
                f">= {math.ceil(math.log2(rows / s.max_leaders))} (with more bands) or use method 'cluster'",)
    return ()


def cluster_warnings(largest: int, unsplit_oversized: int, s: ClusterSettings) -> tuple[str, ...]:
    """In-cluster work is quadratic in a cluster's size: say so when splitting did not bound it."""
    limit = s.max_cluster_factor * s.cluster_size
    if largest <= 2 * limit:  # the estimates that drive the splits are from a sample: allow their noise
        return ()
    return (f"largest near-duplicate cluster {largest:,} rows (limit {limit:,.0f} = max_cluster_factor x cluster_size; "
            f"{unsplit_oversized} still oversized after split_rounds={s.split_rounds}): its pairwise work grows with "
            f"the square of its size; raise near_dup_split_rounds or lower near_dup_max_cluster_factor",)


def settings_for(f) -> NearDupSettings:
    """NearDupSettings of a FilterSection (pipeline_core.config); LSH settings are used as given
    (`plan_lsh` says what a row count needs, `near_duplicates` warns when they fall short)."""
    return NearDupSettings(
        threshold=f.near_dup_threshold, method=f.near_dup_method, recall_sample=f.near_dup_recall_sample,
        guard=f.near_dup_guard,
        cluster=ClusterSettings(cluster_size=f.near_dup_cluster_size, probes=f.near_dup_probes,
                                probe_margin=f.near_dup_probe_margin, max_cluster_factor=f.near_dup_max_cluster_factor,
                                split_rounds=f.near_dup_split_rounds, coarse_probes=f.near_dup_coarse_probes,
                                seed=f.lsh_seed),
        lsh=LshSettings(bands=f.lsh_bands, rows_per_band=f.lsh_rows_per_band, min_band_matches=f.lsh_min_band_matches,
                        max_leaders=f.lsh_max_leaders, seed=f.lsh_seed))


@dataclass(frozen=True)
class NearDuplicates:
    frame: DataFrame  # key, _near_rep (id of the kept record), _near_sim
    saved: DataFrame  # _key, _saved (pairs the guard kept apart), _lkey, _lid, _sim (its most similar one)
    report: NearDupReport


def near_duplicates(df: DataFrame, *, key: str, vec: str, settings: NearDupSettings, rows: int | None = None,
                    group: str | None = None, guard: str | None = None) -> NearDuplicates:
    """Near duplicates of `df` (key, id, vec = concatenated unit question and answer vectors) by the
    configured method, with the recall measured on a sample of these rows. With `group` (a long
    column), two rows can be near duplicates only when their group values are equal: the filter
    passes a hash of the conversation's context, so a multi-turn or contextual conversation is never
    dropped as a copy of a single-turn one that ends in the same question and answer. With `guard`
    (a long column, near_dup_guard.guard_column), two rows can be near duplicates only when their
    guard keys are equal too; the pairs that differ only there are counted ("saved"). `df` is read
    several times: persist it first."""
    from spark_jobs.near_dups.dedup_recall import measure_recall
    from spark_jobs.near_dups.near_dup_clusters import find_near_duplicates_clustered

    rows = df.count() if rows is None else rows
    t = settings.threshold
    extra: dict = {}
    if settings.method == "cluster":
        c = settings.cluster
        got = find_near_duplicates_clustered(df, key=key, vec=vec, threshold=t, rows=rows, s=c, group=group,
                                             guard=guard)
        clustering = got.clustering
        frame, saved = keep_first(got.edges, key=key), got.saved.persist()
        saved.count()  # both materialised from the cached in-cluster output, which can then go
        size_stats = got.sizes.agg(F.count(F.lit(1)).alias("k"), F.max("count").alias("mx"),
                                   F.avg("count").alias("avg")).first()
        got.cached.unpersist()
        extra = {"clusters": int(size_stats["k"] or 0), "largest_cluster": int(size_stats["mx"] or 0),
                 "mean_cluster": round(float(size_stats["avg"] or 0), 1), "split_clusters": clustering.split_clusters,
                 "assignment_agreement": clustering.agreement}
        params = {**c.__dict__, "sample_rows": clustering.sample_rows}
        expected, warnings = None, cluster_warnings(extra["largest_cluster"], clustering.unsplit_oversized, c)
    else:
        s = settings.lsh
        edges, saved = lsh_pairs(df, key=key, vec=vec, threshold=t, bands=s.bands, rows_per_band=s.rows_per_band,
                                 max_leaders=s.max_leaders, seed=s.seed, min_band_matches=s.min_band_matches,
                                 group=group, guard=guard)
        frame, saved = keep_first(edges, key=key), saved.persist()
        params = dict(s.__dict__)
        expected = round(lsh_candidate_probability(t, s.bands, s.rows_per_band, s.min_band_matches), 4)
        warnings = lsh_warnings(rows, s)
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
    report = NearDupReport(method=settings.method, rows=rows, threshold=t, parameters=params,
                           expected_recall_at_threshold=expected, measured=measured, warnings=warnings,
                           guard=settings.guard, guard_saved_pairs=int(agg["pairs"] or 0),
                           guard_saved_rows=int(agg["rows"] or 0), **extra)
    return NearDuplicates(frame, saved, report)
