"""Measured recall of near-duplicate detection on the run's own rows.

A deterministic sample of rows (hash of the key) is compared by brute force with every row:
a sampled row "has a duplicate" when some row with a smaller key, of the same group and guard key,
has similarity >= threshold. Under keep-first (keep_first.py) such a row must go unless every one
of those smaller duplicates went: the method missed it when it kept the row and one of them. The
share not missed is its recall, with a Wilson 95% interval. Cost: sample x rows dot products (2,000 x 25 M x 768 is
~8e13 FLOP, minutes on a CPU cluster), one pass over the vectors, in float32 (the few pairs near
the threshold are decided in float64).
"""

from __future__ import annotations

import math

import numpy as np

from spark_jobs.near_dups.arrow_vectors import vector_matrix
from spark_jobs.near_dups.dedup_types import FLOAT32_SLACK, RecallEstimate

_SAMPLE_BUCKETS = 1 << 20


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, mid - half), min(1.0, mid + half))


def _truth_batches(batches, sample_keys: np.ndarray, sample_vecs: np.ndarray, sample_groups: np.ndarray,
                   sample_guards: np.ndarray, key: str, vec: str, threshold: float):
    """mapInArrow body: (sampled key, key of a row of these batches that duplicates it: smaller key,
    same group and guard key, similarity >= threshold). float32 products find the candidates (with a
    slack under the threshold); the decision is the float64 product of the candidate pairs only."""
    import pyarrow as pa

    s32 = sample_vecs.astype(np.float32)
    for b in batches:
        if b.num_rows == 0:
            continue
        m = vector_matrix(b.column(vec), vec)
        keys, groups = b.column(key).to_numpy(), b.column("_group").to_numpy()
        guards = b.column("_guard").to_numpy()
        cand = ((m @ s32.T) / 2.0 >= threshold - FLOAT32_SLACK) & (keys[:, None] < sample_keys[None, :]) \
            & (groups[:, None] == sample_groups[None, :]) & (guards[:, None] == sample_guards[None, :])
        r, c = np.nonzero(cand)
        sims = np.einsum("ij,ij->i", m[r].astype(np.float64), sample_vecs[c]) / 2.0
        hit = sims >= threshold
        yield pa.RecordBatch.from_arrays([pa.array(sample_keys[c[hit]], pa.int64()), pa.array(keys[r[hit]], pa.int64())],
                                         names=["_sample_key", "_dup_key"])


def group_column(group: str | None):
    """The near-duplicate group of a row as a long column: `group`'s value, or one group for all rows."""
    from pyspark.sql import functions as F

    return (F.col(group) if group else F.lit(0)).cast("long")


def measure_recall(df, found, *, key: str, vec: str, threshold: float, rows: int, sample: int, seed: int,
                   group: str | None = None, guard: str | None = None) -> RecallEstimate:
    """`found`: the method's output (one row per dropped key, column `key`); `group` and `guard` as in
    dedup.near_duplicates (a duplicate must share the sampled row's group and guard key)."""
    from pyspark.sql import functions as F

    df = df.select(key, vec, group_column(group).alias("_group"), group_column(guard).alias("_guard"))
    cut = max(1, math.ceil(_SAMPLE_BUCKETS * min(sample, rows) / max(rows, 1)))
    pick = (df.where(F.pmod(F.xxhash64(F.col(key), F.lit(seed)), F.lit(_SAMPLE_BUCKETS)) < cut)
            .toArrow().sort_by(key))
    if pick.num_rows == 0:
        return RecallEstimate(0, 0, 0, None, None, None)
    keys = pick.column(key).to_numpy().astype(np.int64)
    vecs = vector_matrix(pick.column(vec), vec).astype(np.float64)
    groups = pick.column("_group").to_numpy().astype(np.int64)
    guards = pick.column("_guard").to_numpy().astype(np.int64)
    truth = df.mapInArrow(lambda it: _truth_batches(it, keys, vecs, groups, guards, key, vec, threshold),
                          "_sample_key long, _dup_key long").persist()
    gone = found.select(F.col(key).alias("_dup_key"))
    with_dup = {int(r[0]) for r in truth.select("_sample_key").distinct().collect()}
    kept_dup = {int(r[0]) for r in truth.join(gone, "_dup_key", "left_anti").select("_sample_key").distinct().collect()}
    truth.unpersist()
    dropped = {int(r[0]) for r in found.select(key).where(F.col(key).isin([int(k) for k in keys])).collect()}
    n = len(with_dup)
    hits = n - len(kept_dup - dropped)
    lo, hi = wilson(hits, n)
    return RecallEstimate(pick.num_rows, n, hits, round(hits / n, 4) if n else None,
                          round(lo, 4) if n else None, round(hi, 4) if n else None)
