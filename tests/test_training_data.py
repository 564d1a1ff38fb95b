"""The train-ready loader: deterministic seeded order, exact resume by position, disjoint
data-parallel shards, per-stage columns, and clear errors on malformed shards."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline_core.handoffs import IGNORE_INDEX
from spark_jobs.filter.train_ready import write_rows
from training.data import COLUMNS, DataError, MicroBatches, ShardSet, columns_for

SEQ = 8


def _rows(start, n):
    # row i carries its id in input_ids so the order is observable
    return [{"input_ids": [start + i] * SEQ, "labels": [start + i] * SEQ, "position_ids": [0, 1, 2, 3, 0, 1, 2, 3]}
            for i in range(n)]


@pytest.fixture
def shards(tmp_path):
    write_rows(tmp_path / "a.parquet", _rows(0, 7))
    write_rows(tmp_path / "b.parquet", _rows(100, 5))
    return ShardSet([tmp_path / "a.parquet", tmp_path / "b.parquet"], SEQ, COLUMNS)


def _ids(it, n):
    return [tuple(inp[0][:, 0].tolist()) for inp, _ in itertools.islice(it, n)]


def test_order_is_a_seeded_permutation_per_epoch(shards):
    a = _ids(MicroBatches(shards, micro_batch=2, dp_rank=0, dp_size=1, seed=7), 12)
    assert a == _ids(MicroBatches(shards, micro_batch=2, dp_rank=0, dp_size=1, seed=7), 12)
    assert a != _ids(MicroBatches(shards, micro_batch=2, dp_rank=0, dp_size=1, seed=8), 12)
    epoch0 = [i for b in a[:6] for i in b]
    assert sorted(epoch0) == [*range(7), *range(100, 105)]  # 12 rows = 6 micro-batches, each once
    assert a[6:] != a[:6]  # a new epoch, a new order


def test_resume_from_position_continues_the_same_sequence(shards):
    full = _ids(MicroBatches(shards, micro_batch=2, dp_rank=0, dp_size=1, seed=3), 10)
    resumed = _ids(MicroBatches(shards, micro_batch=2, dp_rank=0, dp_size=1, seed=3, position=4), 6)
    assert resumed == full[4:]


def test_data_parallel_ranks_get_disjoint_rows(shards):
    r0 = _ids(MicroBatches(shards, micro_batch=2, dp_rank=0, dp_size=2, seed=1), 3)
    r1 = _ids(MicroBatches(shards, micro_batch=2, dp_rank=1, dp_size=2, seed=1), 3)
    seen = [i for b in r0 + r1 for i in b]
    assert len(seen) == len(set(seen)) == 12


def test_targets_are_shifted_and_masked_at_document_boundaries(shards):
    _, targets = next(MicroBatches(shards, micro_batch=1, dp_rank=0, dp_size=1, seed=0, shuffle=False))
    row = targets[0].tolist()
    assert row[:3] == [0, 0, 0] and row[3] == IGNORE_INDEX and row[-1] == IGNORE_INDEX
    assert targets.dtype == torch.int64


def test_stages_read_only_their_columns(tmp_path, shards):
    assert columns_for(True, False) == ("input_ids", "position_ids")
    assert columns_for(False, True) == ("position_ids", "labels")
    first = ShardSet(shards.files, SEQ, columns_for(True, False))
    inputs, targets = next(MicroBatches(first, micro_batch=1, dp_rank=0, dp_size=1, seed=0, need_labels=False))
    assert targets is None and inputs[0].shape == (1, SEQ)


def test_malformed_shards_fail_clearly(tmp_path):
    write_rows(tmp_path / "short.parquet", [{"input_ids": [1] * 5, "labels": [1] * 5, "position_ids": list(range(5))}])
    s = ShardSet([tmp_path / "short.parquet"], SEQ, COLUMNS)
    with pytest.raises(DataError, match="short.parquet row 0: input_ids has 5 tokens, expected train.seq_len=8"):
        next(MicroBatches(s, micro_batch=1, dp_rank=0, dp_size=1, seed=0))
    with pytest.raises(DataError, match="fewer than one global micro-batch"):
        MicroBatches(s, micro_batch=2, dp_rank=0, dp_size=1, seed=0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": [[1] * SEQ]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet: missing column\(s\) \['labels', 'position_ids'\]"):
        ShardSet([tmp_path / "bad.parquet"], SEQ, COLUMNS)
