"""Near-duplicate detection at scale (spark_jobs/near_dups/dedup.py, near_dup_clusters.py, dedup_recall.py):
the clustering method against brute force, its independence from partitioning, the measured
recall it reports, and its seed. Real Spark local[2]."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from spark_jobs.near_dups.arrow_vectors import vector_array
from spark_jobs.near_dups.centroid_index import CentroidIndex
from spark_jobs.near_dups.dedup_recall import wilson
from spark_jobs.near_dups.dedup_types import ClusterSettings, NearDupSettings
from spark_jobs.near_dups.near_dup_clusters import pairs_in_cluster, split_oversized
from spark_jobs.near_dups.spherical_kmeans import spherical_kmeans, top_clusters

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


def skewed_rows(n: int, seed: int, dim: int = 128) -> np.ndarray:
    """70% of rows in one compact blob, the rest in 20 looser topics, 10% planted twins at cosine
    0.90-0.99 (both halves), `dim` values per half. k-means++ seeds land in the blob rarely (its rows
    are near each other), so plain k-means leaves it as one cluster over twice the target size."""
    rng = np.random.default_rng(seed)
    centres = halves(rng.normal(size=(21, 2 * dim)))
    topic = np.where(rng.random(n) < 0.7, 0, rng.integers(1, 21, n))
    v = halves(centres[topic] + rng.normal(0, 1, (n, 2 * dim)) * np.where(topic == 0, 0.07, 0.1)[:, None])
    twins = np.nonzero(rng.random(n) < 0.1)[0]
    twins = twins[(twins > 0) & ~np.isin(twins - 1, twins)]  # never a twin of a twin
    c = rng.uniform(0.90, 0.99, len(twins))
    v = v.reshape(n, 2, dim)
    for h in range(2):
        base = v[twins - 1, h]
        u = rng.normal(size=base.shape)
        u -= (u * base).sum(1, keepdims=True) * base
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        v[twins, h] = c[:, None] * base + np.sqrt(1 - c[:, None] ** 2) * u
    return v.reshape(n, 2 * dim).astype(np.float32)


def brute_force(v: np.ndarray, keys: np.ndarray, threshold: float, groups: np.ndarray | None = None) -> dict[int, int]:
    """key -> smallest key with similarity >= threshold among smaller keys (of the same group)."""
    return {k: min(ls) for k, ls in brute_force_pairs(v, keys, threshold, groups).items()}


def brute_force_pairs(v: np.ndarray, keys: np.ndarray, threshold: float,
                      groups: np.ndarray | None = None) -> dict[int, set[int]]:
    """key -> every smaller key with similarity >= threshold (of the same group)."""
    sims = (v.astype(np.float64) @ v.T.astype(np.float64)) / 2
    if groups is not None:
        sims[groups[:, None] != groups[None, :]] = -np.inf
    order = np.argsort(keys)
    out = {}
    for rank, j in enumerate(order):
        earlier = order[:rank]
        hit = earlier[sims[j, earlier] >= threshold]
        if len(hit):
            out[int(keys[j])] = {int(k) for k in keys[hit]}
    return out


def keep_first_recall(found: dict[int, int], v: np.ndarray, keys: np.ndarray, threshold: float,
                      groups: np.ndarray | None = None) -> float:
    """Asserts what keep-first promises of a result (dropped key -> representative key): each
    representative is a smaller-key near duplicate (same group) that is kept. Returns the recall as
    the stage measures it: of the rows with a smaller-key near duplicate, the share dropped or whose
    every such duplicate was dropped (a miss = a duplicate left in the output)."""
    want = brute_force_pairs(v, keys, threshold, groups)
    for k, rep in found.items():
        assert rep in want.get(k, set()), (k, rep)  # a true smaller-key near duplicate of the same group
        assert rep not in found, (k, rep)  # that is kept: no chains
    handled = sum(1 for k, dups in want.items() if k in found or dups <= set(found))
    return handled / len(want)


def cluster_table(v: np.ndarray, keys: np.ndarray, groups: np.ndarray, cluster: int = 7) -> pa.Table:
    """One cluster's members as the in-cluster step receives them (applyInArrow)."""
    return pa.table({"_cluster": pa.array([cluster] * len(keys), pa.int32()), "_key": keys,
                     "_id": [f"id{k}" for k in keys], "_group": groups, "_guard": np.zeros(len(keys), np.int64),
                     "_joined": [[cluster, -1]] * len(keys), "_vec": vector_array(v)})


def edges_of(pairs: pd.DataFrame) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for k, lk in zip(pairs["_key"], pairs["_lkey"], strict=True):
        out.setdefault(int(k), set()).add(int(lk))
    return out


def pair_rows(t: pa.Table) -> pd.DataFrame:
    """The pair rows of pairs_in_cluster's output (its size row has a null key)."""
    df = t.to_pandas()
    return df[df["_key"].notna()].astype({"_key": "int64", "_lkey": "int64"})


def test_pairs_in_cluster_equals_brute_force():
    v = clustered_rows(700, 5, seed=3)
    keys = np.random.default_rng(0).permutation(10_000)[:700].astype(np.int64)
    out = pairs_in_cluster(cluster_table(v, keys, np.zeros(700, np.int64)), 0.9)
    got = pair_rows(out)
    want = brute_force_pairs(v, keys, 0.9)  # every edge (keep_first.py decides which rows go)
    assert len(want) > 30
    assert edges_of(got) == want
    assert (got["_lid"] == ["id" + str(k) for k in got["_lkey"]]).all()
    size = out.to_pandas().query("_key.isna()")
    assert size["_members"].tolist() == [700] and size["_cluster"].tolist() == [7]


def test_pairs_in_cluster_pairs_only_rows_of_one_group():
    """The group (the filter's conversation-context key) masks pairs: twins in different groups are
    never an edge."""
    v = clustered_rows(700, 5, seed=3)
    keys = np.random.default_rng(0).permutation(10_000)[:700].astype(np.int64)
    groups = np.random.default_rng(1).integers(0, 3, 700).astype(np.int64)
    pairs = pair_rows(pairs_in_cluster(cluster_table(v, keys, groups), 0.9))
    want = brute_force_pairs(v, keys, 0.9, groups)
    assert len(want) > 5 and len(want) < len(brute_force_pairs(v, keys, 0.9))
    assert edges_of(pairs) == want


def test_spherical_kmeans_is_deterministic_and_unit():
    x = clustered_rows(500, 8, seed=1)
    a, b = spherical_kmeans(x, 8, 10, seed=0), spherical_kmeans(x, 8, 10, seed=0)
    assert np.array_equal(a, b)
    assert np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)


def test_split_oversized_bounds_the_clusters_plain_kmeans_leaves_too_big():
    """On the skewed rows, k-means alone leaves clusters above max_cluster_factor x cluster_size
    (counted over all rows, probes included); after splitting none is, and the result is the same
    on a second call."""
    n, s = 4000, ClusterSettings(cluster_size=100)
    x = skewed_rows(n, seed=0)
    perm = np.random.default_rng(1).permutation(n)
    fit, count = x[np.sort(perm[:1280])], x[np.sort(perm[1280:2560])]
    plain = spherical_kmeans(fit, 40, s.kmeans_iterations, seed=0)

    def largest(c):
        top, joined = top_clusters(x, c, s.probes, s.probe_margin)
        return np.bincount(top[joined], minlength=len(c)).max()

    limit = s.max_cluster_factor * s.cluster_size
    assert largest(plain) > 2 * limit
    split, n_split, unsplit = split_oversized(fit, count, plain, n, s)
    assert n_split >= 1 and unsplit == 0 and len(split) > len(plain)
    assert largest(split) <= limit
    assert np.array_equal(split, split_oversized(fit, count, plain, n, s)[0])
    _, none_split, still = split_oversized(fit, count, plain, n, ClusterSettings(cluster_size=100, split_rounds=0))
    assert none_split == 0 and still >= 1


def topic_rows(n: int, topics: int, seed: int, noise: float = 0.02, d: int = 64) -> np.ndarray:
    """Anisotropic topic rows, `d` values per half (every row near one common direction, as MiniLM's
    are), same-topic cosine ~1 / (1 + d noise^2)."""
    rng = np.random.default_rng(seed)
    centres = halves(rng.normal(size=2 * d) * 0.5 + rng.normal(size=(topics, 2 * d)) / np.sqrt(d))
    v = halves(centres[rng.integers(0, topics, n)] + rng.normal(0, noise, (n, 2 * d)))
    return v


def index_case(coarse_probes: int):
    """400 leaf centroids fitted on topic rows, queries from the same distribution; 20 coarse lists."""
    x = topic_rows(24_000, 300, seed=21)
    leaves = spherical_kmeans(x[:16_000], 400, 10, seed=0)
    return CentroidIndex.build(leaves, coarse_probes, seed=0), leaves, x[16_000:]


def test_centroid_index_finds_the_exhaustive_leaves_with_a_fraction_of_the_products():
    """Two-level search (coarse k-means over the leaves, 8 of 20 coarse lists per row) gives almost
    every row the nearest leaf and the joined leaves (probes 2, margin 0.05) that scoring every leaf
    gives, while scoring under half of them."""
    index, leaves, q = index_case(coarse_probes=8)
    assert not index.exhaustive and len(index.coarse) == 20
    assert sorted(index.lists.tolist()) == list(range(400)) and index.offsets[-1] == 400  # every leaf filed once
    top, joined = index.top(q, 2, 0.05)
    want_top, want_joined = top_clusters(q, leaves, 2, 0.05)
    assert np.mean(top[:, 0] == want_top[:, 0]) >= 0.99
    same = [set(top[i][joined[i]]) == set(want_top[i][want_joined[i]]) for i in range(len(q))]
    assert np.mean(same) >= 0.98 and index.agreement(q, 2, 0.05) == pytest.approx(np.mean(same))
    assert index.products_per_row < 0.5 * len(leaves)


def test_centroid_index_agreement_exposes_a_coarse_level_that_does_not_fit_the_leaves():
    """What the stage reports (NearDupReport.assignment_agreement) sees a broken index: coarse
    centroids that are not the leaves' k-means send rows to the wrong lists."""
    index, _, q = index_case(coarse_probes=8)
    rng = np.random.default_rng(5)
    broken = CentroidIndex(index.leaves, halves(rng.normal(size=index.coarse.shape)), index.lists, index.offsets,
                           index.coarse_probes)
    assert index.agreement(q, 2, 0.05) >= 0.98
    assert broken.agreement(q, 2, 0.05) < 0.8


def test_centroid_index_is_exhaustive_search_when_it_cannot_save_products():
    _, leaves, q = index_case(coarse_probes=8)
    for coarse_probes in (0, 20, 64):  # 0 = off; 20 of ceil(sqrt(400)) = 20 lists = all of them
        index = CentroidIndex.build(leaves, coarse_probes, seed=0)
        assert index.exhaustive
        got, want = index.top(q, 2, 0.05), top_clusters(q, leaves, 2, 0.05)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert index.agreement(q, 2, 0.05) == 1.0


def test_wilson_interval():
    lo, hi = wilson(95, 100)
    assert 0.88 < lo < 0.95 < hi < 0.985
    assert wilson(0, 0) == (0.0, 1.0)


SPARK_CONF = {"spark.sql.shuffle.partitions": "4"}  # runtime settings for this module on the shared session (conftest `spark`)


def frame(spark, v: np.ndarray, keys: np.ndarray, partitions: int, tmp_path):
    """Through a Parquet file, as the filter reads it (createDataFrame of array columns is very slow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"vec-{len(v)}-{partitions}.parquet"
    groups = (keys % 3).astype(np.int64)  # a group column for the tests that pass group="_group"
    pq.write_table(pa.table({"_key": keys, "id": [f"id{k}" for k in keys], "_group": groups, "_vec": list(v)}), path)
    return spark.read.parquet(f"file://{path}").repartition(partitions)


def test_cluster_method_matches_brute_force_and_reports_measured_recall(spark, tmp_path):
    from spark_jobs.near_dups.dedup import near_duplicates

    v = clustered_rows(3000, 12, seed=5)
    keys = np.random.default_rng(2).choice(1 << 30, size=3000, replace=False).astype(np.int64)
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
    assert keep_first_recall(found, v, keys, 0.9) >= 0.95  # never a false drop, a dropped or wrong rep
    r = got.report
    assert r.method == "cluster" and r.rows == 3000 and r.clusters == 12
    assert r.measured is not None and r.measured.with_duplicate > 10
    assert r.measured.found <= r.measured.with_duplicate and r.measured.low_95 <= r.measured.recall
    assert r.as_manifest().measured.recall == r.measured.recall


def test_skewed_input_biggest_cluster_is_split_and_keeps_its_recall(spark, tmp_path):
    """The stage's entry point on rows where k-means alone leaves one cluster over twice the limit:
    the report says clusters were split and the largest is within the limit; no row is dropped
    without a smaller-key near duplicate (each representative is one), the recall against brute
    force is >= 0.95 (the issue's target), and the report's measured recall agrees with it."""
    from spark_jobs.near_dups.dedup import near_duplicates

    n = 4000
    v = skewed_rows(n, seed=0)
    keys = np.random.default_rng(3).choice(1 << 30, size=n, replace=False).astype(np.int64)
    want = brute_force(v, keys, 0.9)
    # 3 probes: a split region is dense, many of its pairs sit near a boundary between siblings; with
    # the default 2 this input gives 0.950 (the bench's 250 k anisotropic rows: 0.980, bench/RESULTS.md)
    c = ClusterSettings(cluster_size=100, probes=3)
    got = near_duplicates(frame(spark, v, keys, 3, tmp_path), key="_key", vec="_vec",
                          settings=NearDupSettings(threshold=0.9, method="cluster", cluster=c, recall_sample=n))
    found = {int(r["_key"]): (int(r["_near_rep"][2:]), r["_near_sim"]) for r in got.frame.collect()}
    got.frame.unpersist()
    r = got.report
    assert r.split_clusters >= 1 and r.clusters > math.ceil(n / c.cluster_size)
    assert r.largest_cluster <= c.max_cluster_factor * c.cluster_size and r.warnings == ()
    assert len(want) > 300 and set(found) <= set(want)
    recall = keep_first_recall({k: rep for k, (rep, _) in found.items()}, v, keys, 0.9)
    by_key = dict(zip(keys.tolist(), range(n), strict=True))
    for k, (rep, sim) in found.items():  # the representative is a smaller-key near duplicate
        assert rep < k and sim >= 0.9
        assert float(v[by_key[k]].astype(np.float64) @ v[by_key[rep]].astype(np.float64)) / 2 >= 0.9
    assert recall >= 0.95
    assert r.measured.with_duplicate == len(want) and r.measured.recall == round(recall, 4)


def test_stage_assigns_through_the_centroid_index_and_reports_its_agreement(spark, tmp_path):
    """The entry point with an active index (120 leaves, 11 coarse lists, 4 probed): pairs are found
    as by brute force (a near-duplicate pair's two rows take the same path through the index, so the
    index's misses cost little recall: measured 0.992 here, 1.0 exhaustive, 0.956 with 2 probed),
    and the report states the index's agreement with exhaustive search and its setting."""
    from spark_jobs.near_dups.dedup import near_duplicates

    n = 6000
    v = clustered_rows(n, 60, seed=8)
    keys = np.random.default_rng(6).choice(1 << 30, size=n, replace=False).astype(np.int64)
    want = brute_force(v, keys, 0.9)
    c = ClusterSettings(cluster_size=50, coarse_probes=4)
    got = near_duplicates(frame(spark, v, keys, 3, tmp_path), key="_key", vec="_vec",
                          settings=NearDupSettings(threshold=0.9, method="cluster", cluster=c, recall_sample=1000))
    found = {int(r["_key"]): int(r["_near_rep"][2:]) for r in got.frame.collect()}
    got.frame.unpersist()
    r = got.report
    assert len(want) > 400 and keep_first_recall(found, v, keys, 0.9) >= 0.95
    assert r.parameters["coarse_probes"] == 4 and r.clusters >= 120
    assert 0.7 <= r.assignment_agreement < 1.0  # approximate, and measured: exhaustive search would say 1.0
    assert r.as_manifest().assignment_agreement == r.assignment_agreement


def test_measured_recall_sees_a_result_that_misses(spark, tmp_path):
    """The recall check judges the result, not the method: the clustering's drops with two in three
    of them taken back leave most duplicates in, and the check says so."""
    from pyspark.sql import functions as F

    from spark_jobs.near_dups.dedup import near_duplicates
    from spark_jobs.near_dups.dedup_recall import measure_recall

    v = clustered_rows(1500, 6, seed=9)
    keys = np.arange(1500, dtype=np.int64) * 7919 % 100_003
    df = frame(spark, v, keys, 2, tmp_path).persist()
    settings = NearDupSettings(threshold=0.9, cluster=ClusterSettings(cluster_size=250), recall_sample=600)
    got = near_duplicates(df, key="_key", vec="_vec", settings=settings)
    assert got.report.measured.recall >= 0.95
    a_third = got.frame.where(F.pmod("_key", F.lit(3)) == 0)
    m = measure_recall(df, a_third, key="_key", vec="_vec", threshold=0.9, rows=1500, sample=600,
                       seed=settings.recall_seed)
    assert m.with_duplicate > 10 and m.recall < 0.6
    got.frame.unpersist()
    df.unpersist()


def test_the_method_and_the_recall_check_respect_groups(spark, tmp_path):
    from spark_jobs.near_dups.dedup import near_duplicates

    v = clustered_rows(1500, 6, seed=11)
    keys = np.random.default_rng(4).choice(1 << 30, size=1500, replace=False).astype(np.int64)
    want = brute_force(v, keys, 0.9, (keys % 3).astype(np.int64))
    settings = NearDupSettings(threshold=0.9, method="cluster", recall_sample=1500,
                               cluster=ClusterSettings(cluster_size=250))
    got = near_duplicates(frame(spark, v, keys, 2, tmp_path), key="_key", vec="_vec", settings=settings, group="_group")
    found = {int(r["_key"]): int(r["_near_rep"][2:]) for r in got.frame.collect()}
    got.frame.unpersist()
    assert len(want) > 20
    assert keep_first_recall(found, v, keys, 0.9, (keys % 3).astype(np.int64)) >= 0.95  # no cross-group drop
    assert got.report.measured.with_duplicate == len(want)  # the brute-force truth is per group too


def test_coarse_probes_setting_is_validated_and_reaches_the_method():
    from pydantic import ValidationError

    from pipeline_core.config import FilterSection
    from spark_jobs.near_dups.dedup import settings_for

    assert settings_for(FilterSection()).cluster.coarse_probes == 8
    assert settings_for(FilterSection(near_dup_coarse_probes=0)).cluster.coarse_probes == 0  # 0 = exhaustive
    for bad in (-1, 5000):
        with pytest.raises(ValidationError, match="near_dup_coarse_probes"):
            FilterSection(near_dup_coarse_probes=bad)


def test_near_dup_seed_reaches_the_clustering_and_moves_its_centroids(spark, tmp_path):
    """filter.near_dup_seed (default 0, the seed the clustering always had) seeds the k-means sample,
    its k-means++ seeds and splits: another seed gives other centroids."""
    from pipeline_core.config import FilterSection
    from spark_jobs.near_dups.dedup import settings_for
    from spark_jobs.near_dups.near_dup_clusters import fit_clusters

    assert settings_for(FilterSection()).cluster.seed == 0
    v = clustered_rows(1500, 12, seed=5)
    keys = np.random.default_rng(2).choice(1 << 30, size=1500, replace=False).astype(np.int64)
    df = frame(spark, v, keys, 2, tmp_path)
    fitted = {}
    for seed in (0, 3):
        s = settings_for(FilterSection(near_dup_seed=seed, near_dup_cluster_size=125)).cluster
        fitted[seed] = fit_clusters(df, key="_key", vec="_vec", rows=1500, s=s)
    assert not np.array_equal(fitted[0].centroids, fitted[3].centroids)
    again = fit_clusters(df, key="_key", vec="_vec", rows=1500, s=settings_for(FilterSection(near_dup_cluster_size=125)).cluster)
    assert np.array_equal(again.centroids, fitted[0].centroids)  # a seed is deterministic
