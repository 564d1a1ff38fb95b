"""A two-level index over the near-duplicate clustering's leaf centroids, so that assigning a row
costs about sqrt(leaves) products instead of one per leaf.

FAISS's IVF idea applied to the centroids themselves: a coarse spherical k-means over the leaf
centroids (ceil(sqrt(leaves)) coarse centroids), every leaf filed under its nearest coarse
centroid (an inverted list). A row scores the coarse centroids, then only the leaves filed under
its `coarse_probes` nearest coarse centroids (FAISS's `nprobe`), and takes its `probes` nearest
leaves among those, with the same margin rule as the exhaustive `top_clusters`. Work per row:
sqrt(L) + coarse_probes x sqrt(L) products for L leaves, against L (at 25.7 M rows, ~24 k leaves:
~1.4 k instead of 24 k).

The index is approximate only where a row's nearest leaves sit under coarse centroids it did not
probe; `agreement` measures how often the joined leaves equal the exhaustive ones, and the stage
reports it (NearDupReport.assignment_agreement). With coarse_probes >= the number of coarse
centroids the index is the exhaustive search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from spark_jobs.near_dups.spherical_kmeans import blocked_top, nearest, spherical_kmeans, top_clusters, top_k

_COARSE_ITERATIONS = 20


@dataclass(frozen=True)
class CentroidIndex:
    leaves: np.ndarray  # (L, dim) unit rows: the clusters rows join
    coarse: np.ndarray  # (G, dim) unit rows; empty = exhaustive search
    lists: np.ndarray  # leaf ids ordered by coarse centroid: lists[offsets[g]:offsets[g + 1]] are g's leaves
    offsets: np.ndarray  # (G + 1,)
    coarse_probes: int

    @property
    def exhaustive(self) -> bool:
        return len(self.coarse) == 0

    @staticmethod
    def build(leaves: np.ndarray, coarse_probes: int, seed: int) -> CentroidIndex:
        """`coarse_probes` 0, or >= the coarse centroids there would be: exhaustive search. Each leaf
        is filed under one coarse centroid: filing it also under the lists of sample rows that join
        it (spilling, as ScaNN's SOAR does) was tried and dropped: on anisotropic vectors with the
        0.05 probe margin the lists grew to hold most leaves (2,166 products per row for 2,000
        leaves, against 223)."""
        leaves = np.ascontiguousarray(leaves, dtype=np.float32)
        groups = math.ceil(math.sqrt(len(leaves)))
        if coarse_probes <= 0 or coarse_probes >= groups:
            return CentroidIndex._exhaustive(leaves, coarse_probes)
        coarse = spherical_kmeans(leaves, groups, _COARSE_ITERATIONS, seed)
        owner, _ = nearest(leaves, coarse)
        used = np.unique(owner)  # a coarse centroid no leaf is filed under would be probed for nothing
        coarse, owner = np.ascontiguousarray(coarse[used]), np.searchsorted(used, owner)
        if coarse_probes >= len(coarse):
            return CentroidIndex._exhaustive(leaves, coarse_probes)
        lists = np.argsort(owner, kind="stable").astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(coarse)))]).astype(np.int64)
        return CentroidIndex(leaves, coarse, lists, offsets, coarse_probes)

    @staticmethod
    def _exhaustive(leaves: np.ndarray, coarse_probes: int) -> CentroidIndex:
        return CentroidIndex(leaves, leaves[:0], np.zeros(0, np.int64), np.zeros(1, np.int64), coarse_probes)

    @property
    def products_per_row(self) -> float:
        """Mean products a row costs: every coarse centroid, then the leaves of `coarse_probes` lists."""
        if self.exhaustive:
            return float(len(self.leaves))
        return len(self.coarse) + self.coarse_probes * float(np.diff(self.offsets).mean())

    def top(self, x: np.ndarray, probes: int, margin: float) -> tuple[np.ndarray, np.ndarray]:
        """As `top_clusters(x, leaves, probes, margin)`: (leaves, joined), searched through the index."""
        if self.exhaustive:
            return top_clusters(x, self.leaves, probes, margin)
        top, sims = blocked_top(x, min(probes, len(self.leaves)), self._top_block)
        return top, sims >= sims[:, :1] - margin

    def nearest(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(leaf, cosine) of each unit row's nearest leaf."""
        if self.exhaustive:
            return nearest(x, self.leaves)
        top, sims = blocked_top(x, 1, self._top_block)
        return top[:, 0], sims[:, 0]

    def _top_block(self, xb: np.ndarray, probes: int) -> tuple[np.ndarray, np.ndarray]:
        groups, _ = top_k(xb @ self.coarse.T, self.coarse_probes, scratch=True)  # (B, coarse_probes)
        best = np.full((len(xb), probes), -np.inf, np.float32)
        best_ids = np.full((len(xb), probes), -1, np.int64)
        flat_g = groups.ravel()
        flat_rows = np.repeat(np.arange(len(xb)), groups.shape[1])
        order = np.argsort(flat_g, kind="stable")
        gs, starts = np.unique(flat_g[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        for g, s, e in zip(gs, starts, ends, strict=True):  # one product per probed coarse centroid
            rows = flat_rows[order[s:e]]
            ids = self.lists[self.offsets[g]:self.offsets[g + 1]]
            cols, vals = top_k(xb[rows] @ self.leaves[ids].T, probes, scratch=True)  # this list's best
            cand = np.concatenate([best[rows], vals], axis=1)  # merged with the lists before: 2 x probes wide
            cand_ids = np.concatenate([best_ids[rows], ids[cols]], axis=1)
            cols, vals = top_k(cand, probes, scratch=True)
            best[rows], best_ids[rows] = vals, np.take_along_axis(cand_ids, cols, axis=1)
        # the merge above ordered by (cosine, column in the candidates); order ties by leaf id, as exhaustive search does
        order = np.lexsort((best_ids, -best), axis=1)
        return np.take_along_axis(best_ids, order, axis=1), np.take_along_axis(best, order, axis=1)

    def agreement(self, x: np.ndarray, probes: int, margin: float) -> float:
        """Share of rows whose joined leaves equal exhaustive search's (1.0 when exhaustive)."""
        if self.exhaustive or len(x) == 0:
            return 1.0
        a_top, a_join = self.top(x, probes, margin)
        b_top, b_join = top_clusters(x, self.leaves, probes, margin)
        return float(np.mean([set(a_top[i][a_join[i]]) == set(b_top[i][b_join[i]]) for i in range(len(x))]))


def indexed_assign(coarse_probes: int, seed: int):
    """A spherical_kmeans `assign` that searches the step's centroids through a fresh index (its
    coarse k-means costs leaves x sqrt(leaves) products, small beside rows x leaves)."""
    return lambda x, centroids: CentroidIndex.build(centroids, coarse_probes, seed).nearest(x)
