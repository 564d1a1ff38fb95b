"""Deterministic train/validation split by a hash of the record id.

A record's split depends only on (seed, id): not on the run, the partitioning or the other
records, so re-runs and backfills agree and a record never moves between train and val. The
hash is sha256 (the first 52 bits as a fraction in [0, 1)), defined the same way in Spark SQL
and in Python so any tool can recompute a record's split.
"""

from __future__ import annotations

import hashlib

from pyspark.sql import Column
from pyspark.sql import functions as F

TRAIN, VAL = "train", "val"
_BITS = 52  # 13 hex digits: exact in a double


def split_fraction(record_id: str, seed: int) -> float:
    h = hashlib.sha256(f"{seed}:{record_id}".encode()).hexdigest()
    return int(h[: _BITS // 4], 16) / float(1 << _BITS)


def split_of(record_id: str, seed: int, val_fraction: float) -> str:
    return VAL if split_fraction(record_id, seed) < val_fraction else TRAIN


def split_column(id_col: str | Column, seed: int, val_fraction: float) -> Column:
    """Spark twin of `split_of`."""
    col = F.col(id_col) if isinstance(id_col, str) else id_col
    digest = F.sha2(F.concat(F.lit(f"{seed}:"), col), 256)
    fraction = F.conv(F.substring(digest, 1, _BITS // 4), 16, 10).cast("double") / F.lit(float(1 << _BITS))
    return F.when(fraction < F.lit(val_fraction), F.lit(VAL)).otherwise(F.lit(TRAIN))
