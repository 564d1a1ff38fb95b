"""Near-duplicate detection at growing N: time and recall of the filter's `dedup.near_duplicates`
on synthetic anisotropic vectors.

    .venv/bin/python bench/dedup_bench.py --sizes 250000,1000000,4000000 [--json OUT]
    .venv/bin/python bench/dedup_bench.py --model-only   # the compute terms timed, the curve to 25.7 M

Vectors: [q; a], each half unit-norm, 384 dims (MiniLM's). Anisotropic like MiniLM: every vector
shares one common direction (mean pairwise cosine ~0.3), rows sit in dense topic clusters
(`--rows-per-topic`, same-topic cosine ~0.7), and 10% of rows get a planted near-duplicate of the
row before them at a cosine drawn uniformly from [0.90, 0.99] (both halves). More rows = more
topics at the same density. Recall = planted pairs found / planted pairs (a pair counts when the
larger-key row is dropped with a representative of cosine >= threshold); the stage's own measured
recall (brute force on a sample) is reported beside it. Vectors are generated and written in
chunks to Parquet, so memory stays ~ one chunk + Spark.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.proc_cpu import cpu_seconds  # noqa: E402

DIM = 384


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def at_cosine(v: np.ndarray, c: np.ndarray, rng) -> np.ndarray:
    """Unit vectors at exactly cosine c to the unit rows v."""
    u = rng.normal(size=v.shape)
    u = unit(u - (u * v).sum(-1, keepdims=True) * v)
    return c[:, None] * v + np.sqrt(1 - c[:, None] ** 2) * u


def write_vectors(path: Path, n: int, rows_per_topic: int, seed: int, chunk: int = 100_000) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    common = unit(rng.normal(size=(2, DIM)))
    topics = max(1, n // rows_per_topic)
    centres = unit(common[None] * 0.55 + unit(rng.normal(size=(topics, 2, DIM))) * 0.85)
    planted, writer = 0, None
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        t = rng.integers(0, topics, m)
        v = unit(centres[t] + rng.normal(0, 0.045, (m, 2, DIM)))
        twin = rng.random(m) < 0.1
        twin[0] = False
        twin[1:] &= ~twin[:-1]  # never a twin of a twin: row i is planted against row i-1's final vector
        idx = np.nonzero(twin)[0]
        c = rng.uniform(0.90, 0.99, len(idx))
        for h in range(2):
            v[idx, h] = at_cosine(v[idx - 1, h], c, rng)
        planted += len(idx)
        ids = np.arange(lo, lo + m)
        table = pa.table({"id": [f"r{i:09d}" for i in ids], "_key": ids.astype(np.int64),
                          "_twin_of": np.where(twin, ids - 1, -1).astype(np.int64),
                          "_vec": list(v.reshape(m, 2 * DIM).astype(np.float32))})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return planted


def run_one(spark, n: int, work: Path, args) -> dict:
    from pyspark.sql import functions as F

    from spark_jobs.near_dups.dedup import near_duplicates
    from spark_jobs.near_dups.dedup_types import ClusterSettings, NearDupSettings

    path = work / f"vec-{n}.parquet"
    planted = write_vectors(path, n, args.rows_per_topic, seed=n)
    # keys in a shuffled order: a planted twin is the larger key half of the time
    df = spark.read.parquet(f"file://{path}").withColumn("_key", F.xxhash64("id")).persist()
    df.count()
    settings = NearDupSettings(threshold=args.threshold, recall_sample=args.recall_sample,
                               cluster=ClusterSettings(cluster_size=args.cluster_size,
                                                            coarse_probes=args.coarse_probes))
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    got = near_duplicates(df, key="_key", vec="_vec", settings=settings, rows=n)
    dropped = got.frame.count()
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    # planted pairs: (twin, original) at cosine >= 0.90: found when the larger-key one is dropped
    pairs = df.where(F.col("_twin_of") >= 0).select(F.col("_key").alias("k1"), F.col("_twin_of").alias("o"))
    orig = df.select(F.col("id").alias("oid"), F.col("_key").alias("k2"),
                     F.regexp_extract("id", r"r0*(\d+)", 1).cast("long").alias("o"))
    pairs = pairs.join(orig, "o").select(F.greatest("k1", "k2").alias("_key"))
    found = pairs.join(got.frame, "_key").count()
    total = pairs.count()
    r = got.report
    out = {"rows": n, "seconds": round(dt, 1), "cpu_seconds": round(cpu, 1), "rows_per_s": round(n / dt),
           "load_avg_after": round(os.getloadavg()[0], 1), "dropped": dropped, "planted": planted,
           "planted_pairs": total, "planted_found": found, "planted_recall": round(found / max(1, total), 4),
           "measured_recall": r.measured.recall if r.measured else None,
           "measured_interval": [r.measured.low_95, r.measured.high_95] if r.measured else None,
           "clusters": r.clusters, "largest_cluster": r.largest_cluster, "mean_cluster": r.mean_cluster,
           "split_clusters": r.split_clusters, "assignment_agreement": r.assignment_agreement,
           "coarse_probes": args.coarse_probes, "warnings": list(r.warnings)}
    got.frame.unpersist()
    df.unpersist()
    return out


def cost_model(cluster_size: int, probes: int, copies_per_row: float, leaves_per_cluster: float, coarse_probes: int,
               sample_per_cluster: int = 32, sizes=(250_000, 1_000_000, 4_000_000, 25_700_000)) -> dict:
    """CPU seconds of the method's compute terms, timed here with process CPU time (steadier than wall
    time on a shared machine), and the curve they give:
    - in-cluster products: copies x cluster size per row (fixed per row);
    - assignment: each row's products through the centroid index, timed at each size's leaf count
      (rows / cluster_size x the leaves per k-means cluster after splits; random unit leaves, so the
      coarse lists are balanced) and, for comparison, exhaustive (one product per leaf);
    - the driver's k-means: k-means++ seeding (sample x k products) and at most 20 Lloyd steps
      through the index, on 2 x sample_per_cluster rows per centroid."""
    import pyarrow as pa

    from spark_jobs.near_dups.arrow_vectors import vector_array
    from spark_jobs.near_dups.centroid_index import CentroidIndex
    from spark_jobs.near_dups.near_dup_clusters import pairs_in_cluster
    from spark_jobs.near_dups.spherical_kmeans import top_clusters, unit_rows

    rng = np.random.default_rng(0)
    rows = unit(rng.normal(size=(cluster_size, 2, DIM))).reshape(cluster_size, 2 * DIM).astype(np.float32)
    table = pa.table({"_cluster": pa.array([0] * cluster_size, pa.int32()), "_key": np.arange(cluster_size, dtype=np.int64),
                      "_id": [f"r{i}" for i in range(cluster_size)], "_group": np.zeros(cluster_size, np.int64),
                      "_guard": np.zeros(cluster_size, np.int64), "_joined": [[0, -1]] * cluster_size,
                      "_vec": vector_array(rows)})
    t = time.process_time()
    for _ in range(5):
        pairs_in_cluster(table, 0.9)
    in_cluster = (time.process_time() - t) / 5 / cluster_size  # s per member of one cluster
    x = unit_rows(rng.normal(size=(20_000, 2 * DIM)).astype(np.float32))
    c = unit_rows(rng.normal(size=(2_000, 2 * DIM)).astype(np.float32))
    t = time.process_time()
    top_clusters(x, c, probes, 0.05)
    per_dot = (time.process_time() - t) / (len(x) * len(c))  # s per row x centroid, exhaustive
    curve = []
    for n in sizes:
        k = math.ceil(n / cluster_size)
        leaves = round(k * leaves_per_cluster)
        index = CentroidIndex.build(unit_rows(rng.normal(size=(leaves, 2 * DIM)).astype(np.float32)), coarse_probes, 0)
        q = x[:5_000]
        t = time.process_time()
        index.top(q, probes, 0.05)
        per_row = (time.process_time() - t) / len(q)
        fit_rows = k * sample_per_cluster
        curve.append({"rows": n, "leaves": leaves, "coarse": len(index.coarse), "products_per_row": round(index.products_per_row),
                      "in_cluster_cpu_s": round(n * copies_per_row * in_cluster, 1),
                      "assign_cpu_s": round(n * per_row, 1),
                      "assign_exhaustive_cpu_s": round(n * leaves * per_dot, 1),
                      "kmeans_driver_cpu_s": round(fit_rows * k * per_dot + 20 * fit_rows * per_row, 1)})
    for a, b in zip(curve, curve[1:], strict=False):
        b["rows_ratio_vs_prev"] = round(b["rows"] / a["rows"], 2)
        total = lambda r: r["in_cluster_cpu_s"] + r["assign_cpu_s"] + r["kmeans_driver_cpu_s"]  # noqa: E731
        b["compute_ratio_vs_prev"] = round(total(b) / total(a), 2)
    return {"in_cluster_s_per_copy": in_cluster, "assign_s_per_row_centroid": per_dot, "coarse_probes": coarse_probes,
            "curve": curve}


def main(argv: list[str] | None = None) -> int:
    from spark_jobs.common import spark_session

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="250000,1000000,4000000")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--cluster-size", type=int, default=2000)
    ap.add_argument("--coarse-probes", type=int, default=8, help="near_dup_coarse_probes (0 = exhaustive assignment)")
    ap.add_argument("--rows-per-topic", type=int, default=200)
    ap.add_argument("--recall-sample", type=int, default=2000)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="6g", help="local mode: the JVM heap (1g fails at 250 k rows)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model-only", action="store_true",
                    help="only time the two compute terms and print the analytic curve (no Spark)")
    ap.add_argument("--copies-per-row", type=float, default=1.66,
                    help="model: cluster memberships per row (mean_cluster x clusters / rows; 1 M run 3: 1.66)")
    ap.add_argument("--leaves-per-cluster", type=float, default=2.56,
                    help="model: clusters after splits / k (1 M run 3: 1,278 / 500)")
    a = ap.parse_args(argv)
    if a.model_only:
        print(json.dumps(cost_model(a.cluster_size, 2, a.copies_per_row, a.leaves_per_cluster, a.coarse_probes), indent=2))
        return 0
    res: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                 "machine": f"{platform.node()} {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}",
                 "command": "bench/dedup_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]), "runs": []}
    spark = spark_session("dedup-bench", a.master, 8, {"spark.ui.enabled": "false", "spark.driver.memory": a.driver_memory,
                                                        "spark.sql.execution.arrow.maxRecordsPerBatch": "4096"})
    with tempfile.TemporaryDirectory(prefix="dedup-bench-") as tmp:
        for n in [int(x) for x in a.sizes.split(",")]:
            r = run_one(spark, n, Path(tmp), a)
            res["runs"].append(r)
            print(json.dumps(r), flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(res, indent=2))
    runs = res["runs"]
    res["time_ratios"] = [round(b["seconds"] / x["seconds"], 2) for x, b in zip(runs, runs[1:], strict=False)]
    res["cpu_ratios"] = [round(b["cpu_seconds"] / x["cpu_seconds"], 2) for x, b in zip(runs, runs[1:], strict=False)]
    res["load_avg_at_end"] = round(os.getloadavg()[0], 1)
    spark.stop()
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0 if math.isfinite(len(runs)) else 1


if __name__ == "__main__":
    sys.exit(main())
