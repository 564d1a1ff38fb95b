"""Deterministic train/validation split by a hash of the prompt (DESIGN.md "filter").

A record's split depends only on (seed, prompt key), where the prompt key is the sha256 of the
canonical prompt text (`conversation.prompt_text`: the conversation up to its final answer, NFKC,
white space collapsed, case folded). Every answer to the same prompt therefore lands on the same
side (v1 has ~7.5 answers per question in math/stem), and neither the run, the partitioning, the
other records nor the tokenizer can move a prompt. The fraction is the first 52 bits of
sha256(f"{seed}:{prompt_key}") over 2**52, defined the same way in Spark SQL and in Python, so any
tool can recompute a record's split (the manifest publishes `SPLIT_RULE`). Rows of the SFT collection
cut from one seed conversation (several rows, different trained turns) share one prompt key, the
seed's (`conversation.seed_prompt_key`), so they land on one side (issue 28).
"""

from __future__ import annotations

import hashlib

from pyspark.sql import Column
from pyspark.sql import functions as F

from pipeline_core.names import SPLITS, Split  # noqa: F401  (SPLITS: re-exported for the filter stage)

TRAIN, VAL = Split.TRAIN, Split.VAL
_BITS = 52  # 13 hex digits: exact in a double
SPLIT_RULE = ("val iff int(sha256(f'{seed}:{prompt_key}')[:13], 16) / 2**52 < val_fraction, where prompt_key = "
              "sha256 hex of the canonical prompt (spark_jobs.conversations.conversation.prompt_text), or of the seed conversation "
              "for rows cut from one (conversation.seed_prompt_key: metadata.seed_dataset + seed_prompt_sha256); "
              "then at most "
              "val_max_documents val documents, whole prompts in hash order, the rest to train")


def split_fraction(prompt_key: str, seed: int) -> float:
    h = hashlib.sha256(f"{seed}:{prompt_key}".encode()).hexdigest()
    return int(h[: _BITS // 4], 16) / float(1 << _BITS)


def split_of(prompt_key: str, seed: int, val_fraction: float) -> str:
    return VAL if split_fraction(prompt_key, seed) < val_fraction else TRAIN


def split_column(key_col: str | Column, seed: int, val_fraction: float) -> Column:
    """Spark twin of `split_of`."""
    col = F.col(key_col) if isinstance(key_col, str) else key_col
    digest = F.sha2(F.concat(F.lit(f"{seed}:"), col), 256)
    fraction = F.conv(F.substring(digest, 1, _BITS // 4), 16, 10).cast("double") / F.lit(float(1 << _BITS))
    return F.when(fraction < F.lit(val_fraction), F.lit(VAL)).otherwise(F.lit(TRAIN))
