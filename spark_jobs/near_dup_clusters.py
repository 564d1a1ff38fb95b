"""Semantic near duplicates by clustering first (SemDeDup, as NeMo Curator's semantic dedup does it).

1. Spherical k-means on a deterministic sample: k = ceil(rows / `cluster_size`) centroids, so
   the work per row (the members of its cluster) stays fixed however many rows there are.
2. Every row joins its nearest centroid and, when the next ones are almost as near (cosine within
   `probe_margin`), up to `probes` clusters in all: a near-duplicate pair that straddles a
   cluster boundary still meets in one of them (NeMo Curator assigns one cluster per row and
   loses such pairs).
3. Inside each cluster: exact pairwise cosine, blocked matrix products (no approximation); each
   row's representative is the smallest-key member at cosine >= threshold with a smaller key.

The recall does not depend on bucket sizes: a pair is missed only when k-means puts its two rows
in different clusters and the probes do not bring them together, which does not get more likely
with more rows at the same density. It is measured per run on a sample (dedup_recall.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from spark_jobs.dedup_types import ClusterSettings

PAIR_SCHEMA = "_key long, _lkey long, _lid string, _sim double"
ASSIGN_SCHEMA = "_cluster int, _key long, _id string, _group long, _vec array<float>"
_BLOCK = 2048  # rows per block of the in-cluster similarity product (block x members floats in memory)
_SAMPLE_BUCKETS = 1 << 20
_SLACK = 1e-5  # float32 products can sit a hair under the float64 cosine


@dataclass(frozen=True)
class Clustering:
    centroids: np.ndarray  # (k, dim), unit rows
    sample_rows: int
    iterations: int


def unit_rows(m: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.where(n > 0, n, 1.0)


def spherical_kmeans(x: np.ndarray, k: int, iterations: int, seed: int) -> np.ndarray:
    """Unit-norm centroids of `x` (rows) by cosine k-means; deterministic for a given x and seed.
    Empty clusters are re-seeded from the rows farthest from their centroid."""
    x = unit_rows(x.astype(np.float32, copy=False))
    k = max(1, min(k, len(x)))
    rng = np.random.default_rng(seed)
    c = x[rng.choice(len(x), size=k, replace=False)].copy()
    for _ in range(iterations):
        sims = x @ c.T
        assign = sims.argmax(axis=1)
        best = sims[np.arange(len(x)), assign]
        sums = np.zeros_like(c)
        np.add.at(sums, assign, x)
        counts = np.bincount(assign, minlength=k)
        empty = np.nonzero(counts == 0)[0]
        if len(empty):
            far = np.argsort(best)[: len(empty)]
            sums[empty] = x[far]
        c = unit_rows(sums)
    return c


def fit_clusters(df, *, key: str, vec: str, rows: int, s: ClusterSettings) -> Clustering:
    """Centroids from a sample chosen by a hash of the key (the same rows whatever the partitioning)."""
    from pyspark.sql import functions as F

    k = max(1, math.ceil(rows / s.cluster_size))
    want = min(rows, k * s.sample_per_cluster)
    cut = max(1, math.ceil(_SAMPLE_BUCKETS * want / max(rows, 1)))
    sample = (df.select(key, vec)
              .where(F.pmod(F.xxhash64(F.col(key), F.lit(s.seed)), F.lit(_SAMPLE_BUCKETS)) < cut)
              .toPandas().sort_values(key))
    x = np.stack(sample[vec].to_numpy()).astype(np.float32) if len(sample) else np.zeros((0, 1), np.float32)
    if len(x) == 0:
        raise ValueError("near-duplicate clustering: the sample is empty")
    return Clustering(spherical_kmeans(x, k, s.kmeans_iterations, s.seed), len(x), s.kmeans_iterations)


def assign_batches(batches: Iterator[pd.DataFrame], centroids: np.ndarray, key: str, vec: str,
                   probes: int, margin: float) -> Iterator[pd.DataFrame]:
    """mapInPandas body: each row -> one row per cluster it joins (nearest, plus near-equal runners-up)."""
    probes = min(probes, len(centroids))
    for pdf in batches:
        if len(pdf) == 0:
            continue
        m = np.stack(pdf[vec].to_numpy()).astype(np.float32)
        sims = unit_rows(m) @ centroids.T
        top = np.argsort(-sims, axis=1)[:, :probes]
        top_sims = np.take_along_axis(sims, top, axis=1)
        keep = top_sims >= top_sims[:, :1] - margin
        rows, ranks = np.nonzero(keep)
        if len(rows) == 0:  # an empty list-of-arrays column has no Arrow type: yield nothing instead
            continue
        yield pd.DataFrame({"_cluster": top[rows, ranks].astype(np.int32), "_key": pdf[key].to_numpy()[rows],
                            "_id": pdf["id"].to_numpy()[rows], "_group": pdf["_group"].to_numpy()[rows],
                            "_vec": list(m[rows])})


def pairs_in_cluster(pdf: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """applyInPandas body: one cluster's members -> (key, smallest smaller-key member at sim >= threshold
    and the same `_group`). sim = dot([q;a], [q';a']) / 2 = the mean of question and answer cosine."""
    empty = pd.DataFrame({"_key": pd.Series([], dtype="int64"), "_lkey": pd.Series([], dtype="int64"),
                          "_lid": pd.Series([], dtype=object), "_sim": pd.Series([], dtype="float64")})
    if len(pdf) < 2:
        return empty
    pdf = pdf.sort_values("_key", kind="stable").drop_duplicates("_key")
    keys, ids, groups = pdf["_key"].to_numpy(), pdf["_id"].to_numpy(), pdf["_group"].to_numpy()
    m = np.stack(pdf["_vec"].to_numpy()).astype(np.float32)
    out_j, out_l = [], []
    for lo in range(1, len(m), _BLOCK):
        hi = min(len(m), lo + _BLOCK)
        sims = (m[lo:hi] @ m[:hi].T) / 2.0  # rows lo..hi against every member with a smaller key (sorted)
        sims[np.arange(hi - lo)[:, None] <= np.arange(hi)[None, :] - lo] = -np.inf  # only earlier (smaller) keys
        sims[groups[lo:hi, None] != groups[None, :hi]] = -np.inf  # only rows of the same group
        hit = sims >= threshold - _SLACK
        rows = np.nonzero(hit.any(axis=1))[0]
        if len(rows):
            out_j.append(lo + rows)
            out_l.append(hit[rows].argmax(axis=1))  # the smallest key wins, as in the LSH path
    if not out_j:
        return empty
    jidx, lidx = np.concatenate(out_j), np.concatenate(out_l)
    # the decision is the float64 cosine, as in the LSH path; float32 only finds the candidates
    sims64 = np.einsum("ij,ij->i", m[jidx].astype(np.float64), m[lidx].astype(np.float64)) / 2.0
    ok = sims64 >= threshold
    return pd.DataFrame({"_key": keys[jidx[ok]], "_lkey": keys[lidx[ok]], "_lid": ids[lidx[ok]], "_sim": sims64[ok]})


def find_near_duplicates_clustered(df, *, key: str, vec: str, threshold: float, rows: int, s: ClusterSettings,
                                   group: str | None = None):
    """(key, `_near_rep`, `_near_sim`) for every row with a smaller-key near duplicate of the same
    `group` (all rows one group when None), and the clustering. Groups only mask pairs inside a
    cluster: k-means runs on the vectors alone, so many small groups cost nothing extra."""
    from pyspark.sql import functions as F

    clustering = fit_clusters(df, key=key, vec=vec, rows=rows, s=s)
    centroids, probes, margin = clustering.centroids, s.probes, s.probe_margin
    from spark_jobs.dedup_recall import group_column

    assigned = df.select(key, "id", group_column(group).alias("_group"), vec).mapInPandas(
        lambda it: assign_batches(it, centroids, key, vec, probes, margin), ASSIGN_SCHEMA)
    pairs = assigned.groupBy("_cluster").applyInPandas(lambda pdf: pairs_in_cluster(pdf, threshold), PAIR_SCHEMA)
    best = pairs.groupBy("_key").agg(F.min(F.struct("_lkey", "_lid", "_sim")).alias("_m"))
    found = best.select(F.col("_key").alias(key), F.col("_m._lid").alias("_near_rep"), F.col("_m._sim").alias("_near_sim"))
    sizes = assigned.groupBy("_cluster").count()
    return found, clustering, sizes
