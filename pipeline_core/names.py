"""The names that cross modules as strings on disk and in plans: stages and data splits.

A `StrEnum` member is its string (`Split.VAL == "val"`, f"{Split.VAL}" == "val"), so manifests,
paths and XComs keep the same bytes; the code spells each name once, here.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """A pipeline stage a run can run (the DAG's `stages` param, the stage commands' names)."""

    ENRICH = "enrich"
    FILTER = "filter"
    TRAIN = "train"


class Split(StrEnum):
    """A train-ready artifact's split: its rows lie under `data/<split>/` (`data_prefix`)."""

    TRAIN = "train"
    VAL = "val"


SPLITS = tuple(Split)  # the order the filter packs and the trainer reads them


def data_prefix(split: Split) -> str:
    """Where a split's packed rows lie in a train-ready artifact (as its manifest lists them)."""
    return f"data/{split}/"
