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
   loses such pairs). The nearest centroids are found through a two-level index
   (centroid_index.py: coarse k-means over the centroids, `coarse_probes` coarse lists scored per
   row), so assignment costs ~sqrt(clusters) products per row instead of one per cluster; the
   Lloyd steps and the split's size estimates use the same index.
4. Inside each cluster: exact pairwise cosine, blocked matrix products (no approximation). A pair
   at cosine >= threshold of the same group is an edge when the near-duplicate guard agrees
   (near_dup_guard.py: equal guard keys) and a "saved" pair when it does not; each pair is
   reported by one cluster only, the lowest-numbered one both rows joined. Which rows go is then
   decided over all edges at once (keep_first.py: greedy keep-first by key, every dropped row
   names a kept one), not per cluster: a row that joined two clusters has one decision.

The recall does not depend on bucket sizes: a pair is missed only when k-means puts its two rows
in different clusters and the probes do not bring them together, which does not get more likely
with more rows at the same density. It is measured per run on a sample (dedup_recall.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from spark_jobs.near_dups.arrow_vectors import vector_array, vector_matrix
from spark_jobs.near_dups.centroid_index import CentroidIndex, indexed_assign
from spark_jobs.near_dups.dedup_types import FLOAT32_SLACK, ClusterSettings
from spark_jobs.near_dups.spherical_kmeans import spherical_kmeans, unit_rows

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# one size row per cluster (`_members` set, `_key` null); one row per edge (`_saved` null); one row
# per row with guard-saved pairs (`_saved` = how many, `_lkey`/`_lid`/`_sim` its most similar one)
PAIR_SCHEMA = "_cluster int, _members long, _key long, _lkey long, _lid string, _sim double, _saved long"
ASSIGN_SCHEMA = "_cluster int, _key long, _id string, _group long, _guard long, _joined array<int>, _vec array<float>"
_BLOCK = 2048  # rows per block of the in-cluster similarity product (block x members floats in memory)
_AGREEMENT_ROWS = 4096  # held-out sample rows on which the index is compared with exhaustive search
_SAMPLE_BUCKETS = 1 << 20


@dataclass(frozen=True)
class Clustering:
    index: CentroidIndex  # its leaves: (clusters, dim) unit rows, k from k-means, more after splits
    sample_rows: int  # rows the centroids were fitted on (as many again counted the clusters)
    iterations: int
    split_clusters: int  # clusters replaced by a k-means of their own members
    unsplit_oversized: int  # clusters still estimated above the limit after the last round
    agreement: float  # share of held-out sample rows the index assigns as exhaustive search does

    @property
    def centroids(self) -> np.ndarray:
        return self.index.leaves


def _index(centroids: np.ndarray, s: ClusterSettings) -> CentroidIndex:
    return CentroidIndex.build(centroids, s.coarse_probes, s.seed)


def _kmeans(x: np.ndarray, k: int, s: ClusterSettings, seed: int) -> np.ndarray:
    """Lloyd steps assign through a centroid index too (exhaustive while k is small)."""
    return spherical_kmeans(x, k, s.kmeans_iterations, seed, assign=indexed_assign(s.coarse_probes, s.seed))


def split_oversized(fit: np.ndarray, count: np.ndarray, centroids: np.ndarray, rows: int,
                    s: ClusterSettings) -> tuple[np.ndarray, int, int]:
    """(centroids, clusters split, clusters still oversized). `fit` and `count` are two disjoint
    samples of unit rows; `count` (a 1 / (rows / len(count)) sample) estimates each cluster's
    size under the real assignment (through the centroid index, probes included); `fit` gives an
    oversized cluster's members."""
    limit = s.max_cluster_factor * s.cluster_size
    per_count_row = rows / max(1, len(count))
    split = 0
    big = np.zeros(0, np.int64)
    for rnd in range(s.split_rounds + 1):
        index = _index(centroids, s)
        top, joined = index.top(count, s.probes, s.probe_margin)
        est = np.bincount(top[joined], minlength=len(centroids)) * per_count_row
        big = np.nonzero(est > limit)[0]
        if len(big) == 0 or rnd == s.split_rounds:
            break
        ftop, fjoined = index.top(fit, s.probes, s.probe_margin)
        keep, parts, unsplit = np.ones(len(centroids), bool), [], []
        for j in big:
            members = fit[((ftop == j) & fjoined).any(axis=1)]
            sub_k = math.ceil(est[j] / s.cluster_size)
            if len(members) < 2 * sub_k:  # too few rows to place sub-centroids: leave it
                unsplit.append(j)
                continue
            keep[j] = False
            parts.append(_kmeans(members, sub_k, s, s.seed + 7919 * (rnd + 1) + int(j)))
            split += 1
        if not parts:
            break
        centroids = np.concatenate([centroids[keep], *parts])
    return centroids, split, len(big)


def fit_clusters(df, *, key: str, vec: str, rows: int, s: ClusterSettings) -> Clustering:
    """Centroids from a sample chosen by a hash of the key (the same rows whatever the partitioning):
    half fits k-means, the other half counts the clusters for `split_oversized` and measures the
    index's agreement with exhaustive search."""
    from pyspark.sql import functions as F

    k = max(1, math.ceil(rows / s.cluster_size))
    want = min(rows, 2 * k * s.sample_per_cluster)
    cut = max(1, math.ceil(_SAMPLE_BUCKETS * want / max(rows, 1)))
    sample = (df.select(key, vec, F.pmod(F.xxhash64(F.col(key), F.lit(s.seed + 1)), F.lit(2)).alias("_half"))
              .where(F.pmod(F.xxhash64(F.col(key), F.lit(s.seed)), F.lit(_SAMPLE_BUCKETS)) < cut)
              .toArrow().sort_by(key))
    if sample.num_rows == 0:
        raise ValueError("near-duplicate clustering: the sample is empty")
    x = unit_rows(vector_matrix(sample.column(vec), vec))
    half = sample.column("_half").to_numpy()
    fit, count = (x[half == 0], x[half == 1]) if (half == 0).any() and (half == 1).any() else (x, x)
    centroids = _kmeans(fit, k, s, s.seed)
    centroids, split, unsplit = split_oversized(fit, count, centroids, rows, s)
    index = _index(centroids, s)
    return Clustering(index, len(fit), s.kmeans_iterations, split, unsplit,
                      round(index.agreement(count[:_AGREEMENT_ROWS], s.probes, s.probe_margin), 4))


def assign_batches(batches, index: CentroidIndex, key: str, vec: str, probes: int, margin: float):
    """mapInArrow body: each row -> one row per cluster it joins (nearest, plus near-equal runners-up)."""
    import pyarrow as pa

    for b in batches:
        if b.num_rows == 0:
            continue
        m = vector_matrix(b.column(vec), vec)
        top, keep = index.top(unit_rows(m), probes, margin)
        rows, ranks = np.nonzero(keep)
        take = pa.array(rows)
        joined = np.where(keep, top, -1).astype(np.int32)[rows]  # every cluster the row joined (-1: none)
        offsets = pa.array(np.arange(len(rows) + 1, dtype=np.int32) * np.int32(joined.shape[1]))
        yield pa.RecordBatch.from_arrays(
            [pa.array(top[rows, ranks].astype(np.int32)), b.column(key).take(take), b.column("id").take(take),
             b.column("_group").take(take), b.column("_guard").take(take),
             pa.ListArray.from_arrays(offsets, pa.array(joined.ravel())), vector_array(m[rows])],
            names=["_cluster", "_key", "_id", "_group", "_guard", "_joined", "_vec"])


def _owned(joined: np.ndarray, j: np.ndarray, lo: np.ndarray, cluster: int) -> np.ndarray:
    """Pairs (j, lo) this cluster reports: no cluster numbered below it holds both rows."""
    a, b = joined[j][:, :, None], joined[lo][:, None, :]
    return ~((a == b) & (a >= 0) & (a < cluster)).any(axis=(1, 2))


def pairs_in_cluster(t, threshold: float):
    """applyInArrow body: one cluster's members -> its size row (`_members`, `_key` null), every edge
    (a smaller-key member at sim >= threshold, same `_group`, same `_guard`) and, per member with
    any, its guard-saved pairs (same but the guard keys differ): count and most similar partner.
    sim = dot([q;a], [q';a']) / 2 = the mean of question and answer cosine."""
    import pyarrow as pa

    keys_all = t.column("_key").to_numpy()
    order = np.argsort(keys_all, kind="stable")
    first = np.ones(len(order), bool)
    first[1:] = keys_all[order][1:] != keys_all[order][:-1]  # a row that joined twice (never here) counts once
    order = order[first]
    keys, groups = keys_all[order], t.column("_group").to_numpy()[order]
    guards = t.column("_guard").to_numpy()[order]
    ids = t.column("_id").combine_chunks().take(pa.array(order))
    jl = t.column("_joined").combine_chunks()
    joined = (np.asarray(jl.flatten().to_numpy(zero_copy_only=False), np.int32).reshape(len(jl), -1)[order]
              if len(order) else np.zeros((0, 1), np.int32))
    m = vector_matrix(t.column("_vec"), "_vec")[order] if len(order) else np.zeros((0, 0), np.float32)
    cluster = t.column("_cluster")[0].as_py() if t.num_rows else None
    out_j, out_l = [], []
    for lo in range(1, len(m), _BLOCK):
        hi = min(len(m), lo + _BLOCK)
        sims = (m[lo:hi] @ m[:hi].T) / 2.0  # rows lo..hi against every member with a smaller key (sorted)
        sims[np.arange(hi - lo)[:, None] <= np.arange(hi)[None, :] - lo] = -np.inf  # only earlier (smaller) keys
        sims[groups[lo:hi, None] != groups[None, :hi]] = -np.inf  # only rows of the same group
        r, c = np.nonzero(sims >= threshold - FLOAT32_SLACK)
        out_j.append(lo + r)
        out_l.append(c)
    jidx = np.concatenate(out_j) if out_j else np.zeros(0, np.int64)
    lidx = np.concatenate(out_l) if out_l else np.zeros(0, np.int64)
    # the decision is the float64 cosine (as in the recall check); float32 only finds the candidates
    sims64 = np.einsum("ij,ij->i", m[jidx].astype(np.float64), m[lidx].astype(np.float64)) / 2.0
    ok = (sims64 >= threshold) & _owned(joined, jidx, lidx, cluster if cluster is not None else 0)
    agree = guards[jidx] == guards[lidx]
    edge, saved = ok & agree, ok & ~agree
    # saved pairs: one row per larger-key member, its most similar saved partner as the example
    sj, sl, ss = jidx[saved], lidx[saved], sims64[saved]
    pick = np.lexsort((-ss, sj))  # by member, most similar first
    sj, sl, ss = sj[pick], sl[pick], ss[pick]
    heads = np.ones(len(sj), bool)
    heads[1:] = sj[1:] != sj[:-1]
    counts = np.diff(np.append(np.nonzero(heads)[0], len(sj)))
    sj, sl, ss = sj[heads], sl[heads], ss[heads]
    n_e, n_s = int(edge.sum()), len(sj)
    none = lambda n, t: pa.nulls(n, t)  # noqa: E731
    return pa.table({
        "_cluster": pa.array([cluster] * (1 + n_e + n_s), pa.int32()),
        "_members": pa.concat_arrays([pa.array([len(keys)], pa.int64()), none(n_e + n_s, pa.int64())]),
        "_key": pa.array([None, *keys[jidx[edge]].tolist(), *keys[sj].tolist()], pa.int64()),
        "_lkey": pa.array([None, *keys[lidx[edge]].tolist(), *keys[sl].tolist()], pa.int64()),
        "_lid": pa.concat_arrays([none(1, pa.string()), ids.take(pa.array(lidx[edge])).cast(pa.string()),
                                  ids.take(pa.array(sl)).cast(pa.string())]),
        "_sim": pa.array([None, *sims64[edge].tolist(), *ss.tolist()], pa.float64()),
        "_saved": pa.concat_arrays([none(1 + n_e, pa.int64()), pa.array(counts, pa.int64())]),
    })


def find_near_duplicates_clustered(df, *, key: str, vec: str, threshold: float, rows: int, s: ClusterSettings,
                                   group: str | None = None, guard: str | None = None) -> ClusteredNearDuplicates:
    """The near-duplicate edges (smaller-key pairs at sim >= threshold of the same `group` and the
    same `guard` key; all rows one group / one guard key when None), the guard-saved pairs per row,
    and the clustering. Groups and guard keys only mask pairs inside a cluster: k-means runs on the
    vectors alone, so they cost nothing extra. The in-cluster output (edges, saved rows and one size
    row per cluster, small) is persisted: all three come from it, so the rows are assigned and
    shuffled once."""
    from pyspark.sql import functions as F

    from spark_jobs.near_dups.dedup_recall import group_column

    clustering = fit_clusters(df, key=key, vec=vec, rows=rows, s=s)
    index, probes, margin = clustering.index, s.probes, s.probe_margin
    assigned = df.select(key, "id", group_column(group).alias("_group"), group_column(guard).alias("_guard"),
                         vec).mapInArrow(lambda it: assign_batches(it, index, key, vec, probes, margin), ASSIGN_SCHEMA)
    out = assigned.groupBy("_cluster").applyInArrow(lambda t: pairs_in_cluster(t, threshold), PAIR_SCHEMA).persist()
    pairs = out.where(F.col("_key").isNotNull())
    edges = pairs.where(F.col("_saved").isNull()).select("_key", "_lkey", "_lid", "_sim")
    saved = saved_per_row(pairs.where(F.col("_saved").isNotNull()).select("_key", "_saved", "_lkey", "_lid", "_sim"))
    sizes = out.where(F.col("_key").isNull()).select("_cluster", F.col("_members").alias("count"))
    return ClusteredNearDuplicates(edges, saved, clustering, sizes, out)


def saved_per_row(saved):
    """(_key, _saved, _lkey, _lid, _sim) rows, several per row possible -> one per row: the pairs
    summed (each pair is reported once) and the most similar partner."""
    from pyspark.sql import functions as F

    return (saved.groupBy("_key").agg(F.sum("_saved").alias("_saved"),
                                      F.min(F.struct((-F.col("_sim")).alias("_neg"), "_lkey", "_lid", "_sim")).alias("_m"))
            .select("_key", "_saved", "_m._lkey", "_m._lid", "_m._sim"))


@dataclass(frozen=True)
class ClusteredNearDuplicates:
    edges: DataFrame  # _key, _lkey, _lid, _sim: near-duplicate pairs the guard agrees on (keep_first.py)
    saved: DataFrame  # _key, _saved (pairs the guard kept apart), _lkey, _lid, _sim (the most similar one)
    clustering: Clustering
    sizes: DataFrame  # _cluster, count (rows that joined it)
    cached: DataFrame  # persisted here: unpersist once the results are materialised
