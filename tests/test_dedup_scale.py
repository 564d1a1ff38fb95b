"""Near-duplicate detection at scale (spark_jobs/dedup.py, near_dup_clusters.py, dedup_recall.py):
the clustering method against brute force, its independence from partitioning, the measured
recall it reports, and the LSH sizing rules. Real Spark local[2]."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from spark_jobs.dedup import lsh_candidate_probability, lsh_warnings, plan_lsh
from spark_jobs.dedup_recall import wilson
from spark_jobs.dedup_types import ClusterSettings, LshSettings, NearDupSettings
from spark_jobs.near_dup_clusters import pairs_in_cluster, spherical_kmeans

DIM = 16  # per half: [q; a] rows have 2 * DIM values


def halves(v: np.ndarray) -> np.ndarray:
    v = v.reshape(len(v), 2, -1)
    return (v / np.linalg.norm(v, axis=2, keepdims=True)).reshape(len(v), -1).astype(np.float32)


def clustered_rows(n: int, topics: int, seed: int) -> np.ndarray:
    """Topic clusters (anisotropic: every topic near a common direction) with 10% planted twins."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=2 * DIM)
    centres = halves(common + rng.normal(0, 0.8, (topics, 2 * DIM)))
    v = halves(centres[rng.integers(0, topics, n)] + rng.normal(0, 0.25, (n, 2 * DIM)))
    twins = np.nonzero(rng.random(n) < 0.1)[0]
    twins = twins[twins > 0]
    v[twins] = halves(v[twins - 1] + rng.normal(0, 0.03, (len(twins), 2 * DIM)))
    return v


def brute_force(v: np.ndarray, keys: np.ndarray, threshold: float, groups: np.ndarray | None = None) -> dict[int, int]:
    """key -> smallest key with similarity >= threshold among smaller keys (of the same group)."""
    sims = (v.astype(np.float64) @ v.T.astype(np.float64)) / 2
    if groups is not None:
        sims[groups[:, None] != groups[None, :]] = -np.inf
    order = np.argsort(keys)
    out = {}
    for rank, j in enumerate(order):
        earlier = order[:rank]
        hit = earlier[sims[j, earlier] >= threshold]
        if len(hit):
            out[int(keys[j])] = int(keys[hit].min())
    return out


def test_pairs_in_cluster_equals_brute_force():
    v = clustered_rows(700, 5, seed=3)
    keys = np.random.default_rng(0).permutation(10_000)[:700].astype(np.int64)
    pdf = pd.DataFrame({"_key": keys, "_id": [f"id{k}" for k in keys], "_group": np.zeros(700, np.int64), "_vec": list(v)})
    got = pairs_in_cluster(pdf, 0.9)
    want = brute_force(v, keys, 0.9)
    assert len(want) > 30
    assert dict(zip(got["_key"].astype(int), got["_lkey"].astype(int), strict=True)) == want
    assert (got["_lid"] == ["id" + str(k) for k in got["_lkey"]]).all()


def test_pairs_in_cluster_pairs_only_rows_of_one_group():
    """The group (the filter's conversation-context key) masks pairs: twins in different groups are
    both kept, and a row's representative is the smallest key of its own group."""
    v = clustered_rows(700, 5, seed=3)
    keys = np.random.default_rng(0).permutation(10_000)[:700].astype(np.int64)
    groups = np.random.default_rng(1).integers(0, 3, 700).astype(np.int64)
    pdf = pd.DataFrame({"_key": keys, "_id": [f"id{k}" for k in keys], "_group": groups, "_vec": list(v)})
    got = dict(zip(pairs_in_cluster(pdf, 0.9)["_key"].astype(int), pairs_in_cluster(pdf, 0.9)["_lkey"].astype(int),
                   strict=True))
    want = brute_force(v, keys, 0.9, groups)
    assert len(want) > 5 and len(want) < len(brute_force(v, keys, 0.9))
    assert got == want


def test_spherical_kmeans_is_deterministic_and_unit():
    x = clustered_rows(500, 8, seed=1)
    a, b = spherical_kmeans(x, 8, 10, seed=0), spherical_kmeans(x, 8, 10, seed=0)
    assert np.array_equal(a, b)
    assert np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)


def test_wilson_interval():
    lo, hi = wilson(95, 100)
    assert 0.88 < lo < 0.95 < hi < 0.985
    assert wilson(0, 0) == (0.0, 1.0)


def test_plan_lsh_keeps_buckets_under_the_cap_and_reaches_the_target():
    for rows in (250_000, 1_000_000, 25_700_000):
        s = plan_lsh(rows, 0.9, max_leaders=32, min_band_matches=2, target_recall=0.95)
        assert rows / 2**s.rows_per_band <= 32
        assert lsh_candidate_probability(0.9, s.bands, s.rows_per_band, 2) >= 0.95
        assert lsh_candidate_probability(0.9, s.bands - 1, s.rows_per_band, 2) < 0.95  # the fewest bands
        assert lsh_warnings(rows, s) == ()
    # today's defaults at the full dataset: the numbers (mean bucket ~392, warned)
    assert math.isclose(lsh_candidate_probability(0.9, 48, 16, 2), 0.92, abs_tol=0.01)
    (w,) = lsh_warnings(25_700_000, LshSettings())
    assert "max_leaders=32" in w and "lsh_rows_per_band" in w


@pytest.fixture(scope="module")
def spark():
    from spark_jobs.common import spark_session

    s = spark_session("test-dedup-scale", "local[2]", 4, {"spark.ui.enabled": "false"})
    yield s
    s.stop()


def frame(spark, v: np.ndarray, keys: np.ndarray, partitions: int, tmp_path):
    """Through a Parquet file, as the filter reads it (createDataFrame of array columns is very slow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"vec-{len(v)}-{partitions}.parquet"
    groups = (keys % 3).astype(np.int64)  # a group column for the tests that pass group="_group"
    pq.write_table(pa.table({"_key": keys, "id": [f"id{k}" for k in keys], "_group": groups, "_vec": list(v)}), path)
    return spark.read.parquet(f"file://{path}").repartition(partitions)


def test_cluster_method_matches_brute_force_and_reports_measured_recall(spark, tmp_path):
    from spark_jobs.dedup import near_duplicates

    v = clustered_rows(3000, 12, seed=5)
    keys = np.random.default_rng(2).choice(1 << 30, size=3000, replace=False).astype(np.int64)
    want = brute_force(v, keys, 0.9)
    settings = NearDupSettings(threshold=0.9, method="cluster", cluster=ClusterSettings(cluster_size=250),
                               recall_sample=400)
    results = []
    for parts in (1, 5):
        got = near_duplicates(frame(spark, v, keys, parts, tmp_path), key="_key", vec="_vec", settings=settings)
        rows = got.frame.collect()
        results.append({int(r["_key"]): r["_near_rep"] for r in rows})
        got.frame.unpersist()
    assert results[0] == results[1]  # independent of the partitioning
    found = {k: int(rep[2:]) for k, rep in results[0].items()}
    assert set(found) <= set(want) and all(found[k] == want[k] for k in found)  # never a false drop or wrong rep
    assert len(found) / len(want) >= 0.95
    r = got.report
    assert r.method == "cluster" and r.rows == 3000 and r.clusters == 12 and r.expected_recall_at_threshold is None
    assert r.measured is not None and r.measured.with_duplicate > 10
    assert r.measured.found <= r.measured.with_duplicate and r.measured.low_95 <= r.measured.recall
    assert r.as_manifest()["measured"]["recall"] == r.measured.recall


def test_measured_recall_sees_a_method_that_misses(spark, tmp_path):
    """The recall check is independent of the method: an LSH with one band of many bits misses most pairs,
    and the report says so (and states the analytic value it expected)."""
    from spark_jobs.dedup import near_duplicates

    v = clustered_rows(1500, 6, seed=9)
    keys = np.arange(1500, dtype=np.int64) * 7919 % 100_003
    settings = NearDupSettings(threshold=0.9, method="lsh", recall_sample=600,
                               lsh=LshSettings(bands=1, rows_per_band=24, min_band_matches=1, max_leaders=4))
    got = near_duplicates(frame(spark, v, keys, 2, tmp_path), key="_key", vec="_vec", settings=settings)
    m = got.report.measured
    assert m.with_duplicate > 10 and m.recall < 0.6
    assert got.report.expected_recall_at_threshold < 0.1
    got.frame.unpersist()


@pytest.mark.parametrize("method", ["cluster", "lsh"])
def test_both_methods_and_the_recall_check_respect_groups(spark, tmp_path, method):
    from spark_jobs.dedup import near_duplicates

    v = clustered_rows(1500, 6, seed=11)
    keys = np.random.default_rng(4).choice(1 << 30, size=1500, replace=False).astype(np.int64)
    want = brute_force(v, keys, 0.9, (keys % 3).astype(np.int64))
    settings = NearDupSettings(threshold=0.9, method=method, recall_sample=1500,
                               cluster=ClusterSettings(cluster_size=250),
                               lsh=LshSettings(bands=64, rows_per_band=8, min_band_matches=1, max_leaders=64))
    got = near_duplicates(frame(spark, v, keys, 2, tmp_path), key="_key", vec="_vec", settings=settings, group="_group")
    found = {int(r["_key"]): int(r["_near_rep"][2:]) for r in got.frame.collect()}
    got.frame.unpersist()
    assert len(want) > 20
    assert set(found) <= set(want) and all(found[k] == want[k] for k in found)  # no cross-group drop
    assert len(found) / len(want) >= 0.95
    assert got.report.measured.with_duplicate == len(want)  # the brute-force truth is per group too
