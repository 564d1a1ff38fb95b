"""The validation cap (spark_jobs/filter_rows.prompts_past_cap): the prompts a global running sum in
hash order puts past the cap, computed per hash range without a single-partition window. Real Spark
local[2]."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from spark_jobs.filter.filter_rows import prompts_past_cap

SPARK_CONF = {"spark.sql.shuffle.partitions": "4"}  # runtime settings for this module on the shared session (conftest `spark`)


def past_cap_reference(counts: dict[str, int], seed: int, cap: int) -> set[str]:
    """One running sum over every prompt in sha256(f"{seed}:{key}") order (ties by key)."""
    order = sorted(counts, key=lambda k: (hashlib.sha256(f"{seed}:{k}".encode()).hexdigest(), k))
    out, total = set(), 0
    for k in order:
        total += counts[k]
        if total > cap:
            out.add(k)
    return out


@pytest.mark.parametrize("cap", [1, 2_500, 7_000, 100_000])
def test_cap_picks_the_prompts_of_one_running_sum_in_hash_order(spark, cap):
    rng = np.random.default_rng(0)
    counts = {f"prompt-{i}": int(n) for i, n in enumerate(rng.integers(1, 8, 3000))}  # 3,000 prompts, ~12 k docs
    per_prompt = spark.createDataFrame(sorted(counts.items()), "_prompt_key string, _n long").repartition(3)
    got = prompts_past_cap(per_prompt, seed=1234, cap=cap)
    picked = {r["_prompt_key"] for r in got.collect()}
    assert picked == past_cap_reference(counts, 1234, cap)
    if cap in (2_500, 7_000):  # cuts inside the data, in some range after the first: offsets matter
        assert 0 < len(picked) < len(counts)
    plan = got._jdf.queryExecution().executedPlan().toString()
    assert "SinglePartition" not in plan  # the window is partitioned (no "No Partition Defined" shuffle)
