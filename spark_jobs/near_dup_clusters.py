"""Semantic near duplicates by clustering first (SemDeDup, as NeMo Curator's semantic dedup does it).

1. Spherical k-means on a deterministic sample: k = ceil(rows / `cluster_size`) centroids, so
   the work per row (the members of its cluster) stays fixed however many rows there are.
   Seeding is k-means++ (D^2 sampling, in doubling rounds as k-means|| batches it; NeMo Curator
   uses cuML's k-means||), then Lloyd iterations until no sample row moves.
2. Oversized clusters are split. On anisotropic embeddings (every vector near one common
   direction, as MiniLM's are) k-means leaves a few clusters far above the target (one held 34%
   of 250 k rows), and in-cluster work is quadratic in a cluster's size. A second half of the
   sample, not used to fit, counts each cluster as the assignment below will fill it (probes
   included); a cluster estimated above `max_cluster_factor` x `cluster_size` is replaced by the
   centroids of a k-means on its own sample members, and this repeats for at most `split_rounds`
   rounds. Counting on held-out rows matters: a cluster's size on the rows it was fitted to
   underestimates it (measured 5.5 k estimated vs 13.7 k real).
3. Every row joins its nearest centroid and, when the next ones are almost as near (cosine within
   `probe_margin`), up to `probes` clusters in all: a near-duplicate pair that straddles a
   cluster boundary still meets in one of them (NeMo Curator assigns one cluster per row and
   loses such pairs).
4. Inside each cluster: exact pairwise cosine, blocked matrix products (no approximation); each
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
_ASSIGN_BLOCK = 8192  # rows per block of a rows x centroids product (k-means, assignment)
_SAMPLE_BUCKETS = 1 << 20
_SLACK = 1e-5  # float32 products can sit a hair under the float64 cosine


@dataclass(frozen=True)
class Clustering:
    centroids: np.ndarray  # (clusters, dim), unit rows: k from k-means, more after splits
    sample_rows: int  # rows the centroids were fitted on (as many again counted the clusters)
    iterations: int
    split_clusters: int  # clusters replaced by a k-means of their own members
    unsplit_oversized: int  # clusters still estimated above the limit after the last round


def unit_rows(m: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.where(n > 0, n, 1.0)


def top_clusters(x: np.ndarray, centroids: np.ndarray, probes: int, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """(clusters, joined): each unit row's `probes` nearest centroids, nearest first, and which of
    them it joins (the nearest always; a further one when its cosine is within `margin`)."""
    probes = min(probes, len(centroids))
    top = np.empty((len(x), probes), np.int64)
    top_sims = np.empty((len(x), probes), np.float32)
    for lo in range(0, len(x), _ASSIGN_BLOCK):
        sims = x[lo:lo + _ASSIGN_BLOCK] @ centroids.T
        part = (np.argpartition(-sims, probes - 1, axis=1)[:, :probes] if probes < sims.shape[1]
                else np.broadcast_to(np.arange(sims.shape[1]), sims.shape))
        ps = np.take_along_axis(sims, part, axis=1)
        order = np.argsort(-ps, axis=1, kind="stable")
        top[lo:lo + len(sims)] = np.take_along_axis(part, order, axis=1)
        top_sims[lo:lo + len(sims)] = np.take_along_axis(ps, order, axis=1)
    return top, top_sims >= top_sims[:, :1] - margin


def nearest(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, cosine) of each unit row's nearest centroid."""
    idx = np.empty(len(x), np.int64)
    best = np.empty(len(x), np.float32)
    for lo in range(0, len(x), _ASSIGN_BLOCK):
        sims = x[lo:lo + _ASSIGN_BLOCK] @ centroids.T
        idx[lo:lo + len(sims)] = sims.argmax(axis=1)
        best[lo:lo + len(sims)] = sims[np.arange(len(sims)), idx[lo:lo + len(sims)]]
    return idx, best


def seed_centroids(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding for cosine (D^2 = 1 - cos, up to a factor): each round draws as many new
    seeds as there are so far (1, 1, 2, 4, ...), so log2(k) passes over x instead of k."""
    chosen = np.zeros(len(x), bool)
    picked = [int(rng.integers(len(x)))]
    chosen[picked] = True
    best = x @ x[picked[0]]
    while len(picked) < k:
        d = np.maximum(0.0, 1.0 - best.astype(np.float64))
        d[chosen] = 0.0
        take = min(k - len(picked), len(picked))
        if not d.any():  # every row is already a seed's copy: the rest at random (k-means re-seeds empties)
            new = rng.choice(np.nonzero(~chosen)[0], size=take, replace=False)
        else:
            new = rng.choice(len(x), size=min(take, int(np.count_nonzero(d))), replace=False, p=d / d.sum())
        chosen[new] = True
        picked.extend(int(i) for i in new)
        best = np.maximum(best, (x @ x[new].T).max(axis=1))
    return x[np.asarray(picked)].copy()


def spherical_kmeans(x: np.ndarray, k: int, iterations: int, seed: int) -> np.ndarray:
    """Unit-norm centroids of `x` (rows) by cosine k-means: k-means++ seeds, at most `iterations`
    Lloyd steps (fewer when no row moves); deterministic for a given x and seed. Empty clusters
    are re-seeded from the rows farthest from their centroid."""
    x = unit_rows(x.astype(np.float32, copy=False))
    k = max(1, min(k, len(x)))
    c = seed_centroids(x, k, np.random.default_rng(seed))
    before = None
    for _ in range(iterations):
        assign, best = nearest(x, c)
        if before is not None and np.array_equal(assign, before):
            break
        before = assign
        order = np.argsort(assign, kind="stable")
        used, starts = np.unique(assign[order], return_index=True)
        sums = np.zeros_like(c)
        sums[used] = np.add.reduceat(x[order], starts, axis=0)
        empty = np.setdiff1d(np.arange(k), used)
        if len(empty):
            sums[empty] = x[np.argsort(best, kind="stable")[: len(empty)]]
        c = unit_rows(sums)
    return c


def split_oversized(fit: np.ndarray, count: np.ndarray, centroids: np.ndarray, rows: int,
                    s: ClusterSettings) -> tuple[np.ndarray, int, int]:
    """(centroids, clusters split, clusters still oversized). `fit` and `count` are two disjoint
    samples of unit rows; `count` (a 1 / (rows / len(count)) sample) estimates each cluster's
    size under the real assignment, probes included; `fit` gives an oversized cluster's members."""
    limit = s.max_cluster_factor * s.cluster_size
    per_count_row = rows / max(1, len(count))
    split = 0
    big = np.zeros(0, np.int64)
    for rnd in range(s.split_rounds + 1):
        top, joined = top_clusters(count, centroids, s.probes, s.probe_margin)
        est = np.bincount(top[joined], minlength=len(centroids)) * per_count_row
        big = np.nonzero(est > limit)[0]
        if len(big) == 0 or rnd == s.split_rounds:
            break
        ftop, fjoined = top_clusters(fit, centroids, s.probes, s.probe_margin)
        keep, parts, unsplit = np.ones(len(centroids), bool), [], []
        for j in big:
            members = fit[((ftop == j) & fjoined).any(axis=1)]
            sub_k = math.ceil(est[j] / s.cluster_size)
            if len(members) < 2 * sub_k:  # too few rows to place sub-centroids: leave it
                unsplit.append(j)
                continue
            keep[j] = False
            parts.append(spherical_kmeans(members, sub_k, s.kmeans_iterations, s.seed + 7919 * (rnd + 1) + int(j)))
            split += 1
        if not parts:
            break
        centroids = np.concatenate([centroids[keep], *parts])
    return centroids, split, len(big)


def fit_clusters(df, *, key: str, vec: str, rows: int, s: ClusterSettings) -> Clustering:
    """Centroids from a sample chosen by a hash of the key (the same rows whatever the partitioning):
    half fits k-means, the other half counts the clusters for `split_oversized`."""
    from pyspark.sql import functions as F

    k = max(1, math.ceil(rows / s.cluster_size))
    want = min(rows, 2 * k * s.sample_per_cluster)
    cut = max(1, math.ceil(_SAMPLE_BUCKETS * want / max(rows, 1)))
    sample = (df.select(key, vec, F.pmod(F.xxhash64(F.col(key), F.lit(s.seed + 1)), F.lit(2)).alias("_half"))
              .where(F.pmod(F.xxhash64(F.col(key), F.lit(s.seed)), F.lit(_SAMPLE_BUCKETS)) < cut)
              .toPandas().sort_values(key))
    if len(sample) == 0:
        raise ValueError("near-duplicate clustering: the sample is empty")
    x = unit_rows(np.stack(sample[vec].to_numpy()).astype(np.float32))
    half = sample["_half"].to_numpy()
    fit, count = (x[half == 0], x[half == 1]) if (half == 0).any() and (half == 1).any() else (x, x)
    centroids = spherical_kmeans(fit, k, s.kmeans_iterations, s.seed)
    centroids, split, unsplit = split_oversized(fit, count, centroids, rows, s)
    return Clustering(centroids, len(fit), s.kmeans_iterations, split, unsplit)


def assign_batches(batches: Iterator[pd.DataFrame], centroids: np.ndarray, key: str, vec: str,
                   probes: int, margin: float) -> Iterator[pd.DataFrame]:
    """mapInPandas body: each row -> one row per cluster it joins (nearest, plus near-equal runners-up)."""
    for pdf in batches:
        if len(pdf) == 0:
            continue
        m = np.stack(pdf[vec].to_numpy()).astype(np.float32)
        top, keep = top_clusters(unit_rows(m), centroids, probes, margin)
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
