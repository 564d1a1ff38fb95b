"""Typed settings and results of near-duplicate detection (dedup.py, near_dup_clusters.py,
dedup_recall.py). The filter stage builds `NearDupSettings` from its config section and puts
`NearDupReport.as_manifest()` into its manifest's `extra.near_duplicates` (`pipeline_core.handoffs.FilterReports`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from pipeline_core.handoffs import NearDupSummary

Method = Literal["cluster"]  # near_dup_clusters.py (the only method since issue 33)
Guard = Literal["numbers", "none"]  # near_dup_guard.py
# float32 products find candidates down to this under the threshold (they can sit a hair under the
# float64 cosine); the float64 product of the candidate pairs decides
FLOAT32_SLACK = 1e-5


@dataclass(frozen=True)
class ClusterSettings:
    cluster_size: int = 2000  # target rows per k-means cluster: the work per row
    probes: int = 2  # clusters a row may join
    probe_margin: float = 0.05  # a further centroid is joined only when its cosine is within this of the nearest
    sample_per_cluster: int = 32  # k-means training rows per centroid (as many again count the clusters)
    kmeans_iterations: int = 20  # at most; fewer when no sample row moves
    max_cluster_factor: float = 4.0  # a cluster estimated above this x cluster_size is split
    split_rounds: int = 3  # rounds of splitting (0 = never split)
    coarse_probes: int = 8  # coarse lists of the centroid index scored per row (0 = every centroid)
    seed: int = 0  # filter.near_dup_seed: the k-means sample, seeds, splits and centroid index


@dataclass(frozen=True)
class NearDupSettings:
    threshold: float
    method: Method = "cluster"
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    recall_sample: int = 2000  # rows whose true near duplicates are found by brute force (0 = no check)
    recall_seed: int = 1
    guard: Guard = "numbers"  # what the pairs must also agree on (near_dup_guard.py); the caller computes the keys


@dataclass(frozen=True)
class RecallEstimate:
    """Recall measured on the run's own rows: of the sampled rows that truly have a smaller-key
    near duplicate (brute force against every row; guard keys equal), the share the method handled:
    dropped it, or (keep-first) dropped every one of those smaller duplicates. A miss is a kept row
    with a kept smaller-key near duplicate: a duplicate left in the output."""

    sampled_rows: int
    with_duplicate: int
    found: int
    recall: float | None
    low_95: float | None  # Wilson score interval
    high_95: float | None


@dataclass(frozen=True)
class SavedPair:
    """A pair the guard kept apart: both rows stay (the data report shows them)."""

    split: str  # of `id`'s prompt
    id: str
    other_id: str  # the smaller-key row it resembles
    similarity: float


@dataclass(frozen=True)
class NearDupReport:
    method: Method
    rows: int
    threshold: float
    parameters: dict
    measured: RecallEstimate | None
    clusters: int
    largest_cluster: int
    mean_cluster: float
    split_clusters: int  # k-means clusters replaced by a k-means of their own members
    assignment_agreement: float  # sample rows the centroid index assigns as exhaustive search does
    warnings: tuple[str, ...] = ()
    guard: Guard = "numbers"
    guard_saved_pairs: int | None = None  # pairs at sim >= threshold that the guard kept apart
    guard_saved_rows: int | None = None  # rows with at least one such pair (the larger key of the pair)
    guard_saved_by_split: dict[str, int] | None = None  # saved pairs by the split of their larger-key row
    guard_saved_examples: tuple[SavedPair, ...] = ()  # a few per split, most similar first
    dropped_by_split: dict[str, int] | None = None  # near duplicates dropped, by the split of their prompt

    def as_manifest(self) -> NearDupSummary:
        return NearDupSummary.read(asdict(self))
