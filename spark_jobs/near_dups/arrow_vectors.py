"""Vector columns between Spark's Arrow batches and numpy matrices, without a Python object per
row (a pandas column of arrays costs one np.ndarray per row, then np.stack copies them again)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def vector_matrix(col, name: str) -> np.ndarray:
    """(rows, dim) float32 of an Arrow list<float> column (no per-row Python objects); every list
    must have one length (the filter's row checks reject missing or mismatched embeddings)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if len(arr) == 0:
        return np.zeros((0, 0), np.float32)
    lengths = pc.list_value_length(arr)
    lo, hi = pc.min_max(lengths).values()
    if arr.null_count or lo.as_py() != hi.as_py():
        raise ValueError(f"near duplicates: column {name!r} needs one vector per row, all of one length "
                         f"(got {arr.null_count} nulls, lengths {lo.as_py()}..{hi.as_py()})")
    return np.asarray(arr.flatten().to_numpy(zero_copy_only=False), np.float32).reshape(len(arr), -1)


def vector_array(m: np.ndarray):
    """An Arrow list<float> column of the rows of `m`."""
    offsets = pa.array(np.arange(len(m) + 1, dtype=np.int32) * np.int32(m.shape[1]))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(m, np.float32).ravel()))
