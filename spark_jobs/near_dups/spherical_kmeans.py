"""Cosine (spherical) k-means and exhaustive nearest-centroid search on unit rows, in numpy.

The near-duplicate clustering (near_dup_clusters.py) fits its leaf centroids with this, and the
two-level centroid index (centroid_index.py) fits its coarse level with it. `spherical_kmeans`
takes an optional `assign` function so that, with many centroids, Lloyd steps can assign through
the index instead of scoring every row against every centroid (as FAISS's Clustering accepts an
index for its assignment step).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

ASSIGN_BLOCK = 8192  # rows per block of a rows x centroids product (bounds its memory)
_ARGMAX_K = 4

# (rows, centroids) -> (index, cosine) of each row's nearest centroid
Assign = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def unit_rows(m: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.where(n > 0, n, 1.0)


def top_k(sims: np.ndarray, k: int, scratch: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(columns, values) of each row's k largest entries, largest first (ties: the lower column).
    `scratch`: `sims` may be overwritten. A few repeated argmax passes are ~10x faster than
    argpartition for the k <= 4 that probes use."""
    k = min(k, sims.shape[1])
    if k <= _ARGMAX_K:
        work = sims if scratch else sims.copy()
        rows = np.arange(len(work))
        cols = np.empty((len(work), k), np.int64)
        vals = np.empty((len(work), k), sims.dtype)
        for j in range(k):
            cols[:, j] = work.argmax(axis=1)
            vals[:, j] = work[rows, cols[:, j]]
            work[rows, cols[:, j]] = -np.inf
        return cols, vals
    part = np.argpartition(-sims, k - 1, axis=1)[:, :k] if k < sims.shape[1] else \
        np.broadcast_to(np.arange(sims.shape[1]), sims.shape)
    vals = np.take_along_axis(sims, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(vals, order, axis=1)


def blocked_top(x: np.ndarray, k: int, top_of_block: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(columns, cosines) of each row's k best, `top_of_block` applied to ASSIGN_BLOCK rows at a time
    (a rows x centroids product of all rows at once would not fit in memory)."""
    top = np.empty((len(x), k), np.int64)
    sims = np.empty((len(x), k), np.float32)
    for lo in range(0, len(x), ASSIGN_BLOCK):
        top[lo:lo + ASSIGN_BLOCK], sims[lo:lo + ASSIGN_BLOCK] = top_of_block(x[lo:lo + ASSIGN_BLOCK], k)
    return top, sims


def _scored(centroids: np.ndarray) -> Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]:
    return lambda xb, k: top_k(xb @ centroids.T, k, scratch=True)


def top_clusters(x: np.ndarray, centroids: np.ndarray, probes: int, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """Exhaustive search. (clusters, joined): each unit row's `probes` nearest centroids, nearest
    first, and which of them it joins (the nearest always; a further one within `margin` cosine)."""
    top, sims = blocked_top(x, min(probes, len(centroids)), _scored(centroids))
    return top, sims >= sims[:, :1] - margin


def nearest(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exhaustive search: (index, cosine) of each unit row's nearest centroid."""
    top, sims = blocked_top(x, 1, _scored(centroids))
    return top[:, 0], sims[:, 0]


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
        for lo in range(0, len(x), ASSIGN_BLOCK):  # blocked: x @ x[new].T is rows x new seeds floats
            best[lo:lo + ASSIGN_BLOCK] = np.maximum(best[lo:lo + ASSIGN_BLOCK],
                                                    (x[lo:lo + ASSIGN_BLOCK] @ x[new].T).max(axis=1))
    return x[np.asarray(picked)].copy()


def spherical_kmeans(x: np.ndarray, k: int, iterations: int, seed: int, assign: Assign | None = None) -> np.ndarray:
    """Unit-norm centroids of `x` (rows) by cosine k-means: k-means++ seeds, at most `iterations`
    Lloyd steps (fewer when no row moves); deterministic for a given x and seed. Empty clusters
    are re-seeded from the rows farthest from their centroid. `assign` replaces the exhaustive
    nearest-centroid search of the Lloyd steps (e.g. a centroid index rebuilt per step)."""
    x = unit_rows(x.astype(np.float32, copy=False))
    k = max(1, min(k, len(x)))
    c = seed_centroids(x, k, np.random.default_rng(seed))
    before = None
    for _ in range(iterations):
        assign_, best = (assign or nearest)(x, c)
        if before is not None and np.array_equal(assign_, before):
            break
        before = assign_
        order = np.argsort(assign_, kind="stable")
        used, starts = np.unique(assign_[order], return_index=True)
        sums = np.zeros_like(c)
        sums[used] = np.add.reduceat(x[order], starts, axis=0)
        empty = np.setdiff1d(np.arange(k), used)
        if len(empty):
            sums[empty] = x[np.argsort(best, kind="stable")[: len(empty)]]
        c = unit_rows(sums)
    return c
