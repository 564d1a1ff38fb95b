"""Typed hand-offs between stages: what one stage's manifest promises the next.

The filter stage writes `TrainReadyInfo` into the train-ready manifest's `extra`; the trainer, the
data report and the Airflow summary read it back with `TrainReadyInfo.from_manifest`, never by
string keys of their own. The same holds for a manifest's `counts` (`StageCounts`) and `files`
(`FileEntry`), each stage's other `extra` parts (`ExtraPart` subclasses), and the data report's XCom
(`ReportRef`). Writers construct models by field name; `read`/`from_manifest` accept the on-disk
keys only. A field added here is a contract change: bump nothing, but give it a default so
manifests committed before it still read. What a training run writes for others to read (metrics
columns, promotion decisions) is in `pipeline_core/run_records.py`; stage and split names in
`pipeline_core/names.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline_core.uris import safe_relpath

if TYPE_CHECKING:
    from pipeline_core.artifacts import Manifest


# Train-ready `labels` carry this wherever the loss must not look (prompt tokens, padding): the value
# torch's cross-entropy ignores by default. One definition for the packer, the trainer and the report.
IGNORE_INDEX = -100


class Handoff(BaseModel):
    # populate_by_name: writers build a model by its field names, the JSON on disk keeps its keys (aliases)
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    def to_json_dict(self) -> dict[str, Any]:
        """The model as it lies in a manifest (its on-disk keys)."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def read(cls, data: Any) -> Self:
        """The model from JSON as written: its on-disk keys only (a field's Python name is no key there)."""
        return cls.model_validate(data, by_name=False)


class UnbalancedCounts(RuntimeError):
    """Row counts that lose or invent records: in != out + sum(rejected)."""


class StageCounts(Handoff):
    """A manifest's `counts` for a stage that keeps or rejects rows: in = out + sum(rejected).

    On disk the keys are `in`, `out`, `rejected` ({reason: rows}); a count-less artifact (a model,
    an eval) has none, which `of` answers with None. A manifest whose counts lack `in` or `out`
    fails loudly in `from_manifest`.
    """

    rows_in: int = Field(alias="in", ge=0)
    rows_out: int = Field(alias="out", ge=0)
    rejected: dict[str, int] = Field(default_factory=dict, description="reason -> rejected rows")

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def balanced(self) -> bool:
        return self.rows_in == self.rows_out + self.rejected_total

    def to_counts(self) -> dict[str, Any]:
        return {"in": self.rows_in, "out": self.rows_out, "rejected": dict(sorted(self.rejected.items()))}

    def require_balanced(self, what: str = "") -> StageCounts:
        """self, or UnbalancedCounts: where a stage commits rows, none may be lost."""
        if not self.balanced:
            raise UnbalancedCounts(
                f"{what + ' ' if what else ''}row counts do not add up: in={self.rows_in} != out={self.rows_out} "
                f"+ rejected={self.rejected_total} {dict(sorted(self.rejected.items()))}")
        return self

    def plus_rejected(self, reason: str, rows: int) -> StageCounts:
        """`rows` more in, all rejected for `reason` (rows a reader lost before it could count them)."""
        return StageCounts(rows_in=self.rows_in + rows, rows_out=self.rows_out,
                           rejected={**self.rejected, reason: self.rejected.get(reason, 0) + rows})

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> StageCounts:
        return cls.read(manifest.counts or {})

    @classmethod
    def of(cls, manifest: Manifest) -> StageCounts | None:
        """None where the artifact carries no row counts (neither `in` nor `out`)."""
        if not {"in", "out"} & (manifest.counts or {}).keys():
            return None
        return cls.from_manifest(manifest)


class FileEntry(Handoff):
    """One entry of a manifest's `files`: a payload file's path under the artifact, size and sha256."""

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        # the store is data: a path that could leave the artifact's directory is refused on read
        return safe_relpath(v, "manifest file path")

    def to_entry(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def all_of(cls, manifest: Manifest, prefix: str = "") -> tuple[FileEntry, ...]:
        """The manifest's files (those whose path starts with `prefix`)."""
        return tuple(e for e in map(cls.read, manifest.files) if e.path.startswith(prefix))

    @classmethod
    def named(cls, manifest: Manifest, path: str) -> FileEntry | None:
        return next((e for e in cls.all_of(manifest) if e.path == path), None)


class SourceFile(Handoff):
    """A file read from outside the store (an `enrich.prompt_sources` table), by URI, with the size
    and sha256 it had when read: provenance, never fetched back by this path."""

    path: str = Field(min_length=1, description="the file's URI")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class RowsPerSplit(Handoff):
    """A manifest's `counts` for an artifact that annotates rows without keeping or rejecting any
    (the DPO reference log-probs): rows per split."""

    rows: dict[str, int] = Field(default_factory=dict)

    def to_counts(self) -> dict[str, Any]:
        return {"rows": dict(self.rows)}


Counts = StageCounts | RowsPerSplit


def read_counts(data: Counts | Mapping[str, Any] | None) -> Counts | None:
    """A manifest's `counts` (or their dump in an XCom) as its model: None when there are none."""
    if data is None or isinstance(data, StageCounts | RowsPerSplit):
        return data
    if not data:
        return None
    return (StageCounts if {"in", "out"} & data.keys() else RowsPerSplit).read(data)


class TokenizerSpec(Handoff):
    """The tokenizer and chat format a train-ready artifact was rendered with.

    The trainer refuses a base model whose vocabulary disagrees (size, special ids) before any
    weights load, and the exported model carries `chat_template` so `apply_chat_template`, vLLM
    and TGI reproduce the training format.
    """

    name: str = Field(description="filter.tokenizer as configured: 'mistral-v1', 'mistral-v3', or an HF path/id")
    vocab_size: int = Field(ge=1)
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    chat_template: str | None = Field(None, description="Jinja chat template equivalent to the rendering used")


class EvalSetCount(Handoff):
    """One eval set the filter decontaminated against: what it was (URI, content hash) and what it removed."""

    name: str
    uri: str
    sha256: str = Field(description="sha256 over the set's files' names and sha256s")
    files: int = Field(ge=0)
    documents: int = Field(ge=0)
    documents_too_short: int = Field(0, ge=0, description="documents under filter.decontam_min_tokens (never matched)")
    rows_removed: int = Field(ge=0, description="records rejected as 'contaminated' naming this set")


class DecontamInfo(Handoff):
    """The decontamination's settings and per-set counts (spark_jobs/filter/decontaminate.py)."""

    ngram: int
    threshold: float
    answers: bool
    eval_sets: tuple[EvalSetCount, ...] = ()


class TrainReadyInfo(Handoff):
    """What the filter stage promises about a train-ready artifact (manifest `extra`)."""

    seq_len: int = Field(ge=1)
    tokenizer: TokenizerSpec
    tokens: dict[str, int] = Field(default_factory=dict, description="tokens per split (train/val)")
    target_tokens: dict[str, int] = Field(default_factory=dict, description="loss-bearing tokens per split")
    documents: dict[str, int] = Field(default_factory=dict, description="packed documents per split")
    sequences: dict[str, int] = Field(default_factory=dict, description="packed rows per split")
    packing_efficiency: float | None = None
    train_on: str | None = None
    prompt_context: str | None = None
    render_sample_documents: int = Field(
        0, ge=0, description="documents under data/render_sample/ with their conversations (pipeline_core.render_sample)")
    decontamination: DecontamInfo | None = None
    objective: str = Field("sft", description="sft: packed documents; dpo: one pair per row (chosen, rejected)")

    def to_extra(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> TrainReadyInfo:
        return cls.read(manifest.extra or {})

    @classmethod
    def of(cls, manifest: Manifest) -> TrainReadyInfo | None:
        """The typed hand-off; None for manifests written before the filter filled it."""
        from pydantic import ValidationError

        try:
            return cls.from_manifest(manifest)
        except ValidationError:
            return None


class ExtraPart(Handoff):
    """Keys of a manifest's `extra` that one stage writes and other modules read: the writer merges
    `to_extra()` into the extra it commits, every reader calls `from_manifest`. Only the fields a
    writer set are written (`exclude_unset`), so the JSON on disk is what the dict literals were."""

    def to_extra(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> Self:
        return cls.read(manifest.extra or {})


class PackedSplit(Handoff):
    """One split of a train-ready artifact as packed (`extra.splits[<split>]`, spark_jobs/filter/train_ready.py)."""

    records: int = Field(0, ge=0, description="kept records")
    documents: int = Field(0, ge=0)
    rows: int = Field(0, ge=0, description="packed rows of seq_len tokens")
    files: int = Field(0, ge=0)
    doc_tokens: int = Field(0, ge=0)
    answer_tokens: int = Field(0, ge=0)
    truncated: int = Field(0, ge=0)
    slots: int = Field(0, ge=0, description="rows * seq_len")
    packing_efficiency: float | None = None


class TrainReadySplits(ExtraPart):
    """The train-ready manifest's per-split packing statistics (also in manifests older than TrainReadyInfo)."""

    splits: dict[str, PackedSplit] = Field(default_factory=dict)


class SourceSplit(Handoff):
    """One input split as the filter saw it (`extra.source_splits[<split>]`, issue 28)."""

    rows_in: int = Field(0, alias="in", ge=0)
    rows_out: int = Field(0, alias="out", ge=0)
    rejected: dict[str, int] = Field(default_factory=dict)
    measured: int = Field(0, ge=0, description="records whose rendered length was measured")
    fit_seq_len_with_reasoning: int = Field(0, ge=0)
    fit_seq_len_without_reasoning: int = Field(0, ge=0)


class FilterSourceSplits(ExtraPart):
    """The filter stage's per-input-split accounting (written by the Spark filter only)."""

    source_splits: dict[str, SourceSplit] = Field(default_factory=dict)


class PromptSourceOutcome(Handoff):
    """One seed dataset named by withheld prompts (`extra.prompt_sources[<hub id>]`, enrich):
    where it came from (when configured) and how many prompts it restored."""

    uri: str | None = None
    config_key: str
    recipes: list[str] | None = None
    rows: int | None = None
    files: list[SourceFile] | None = None
    downloaded_to: str | None = None
    restored: int = Field(0, ge=0)
    unrestorable: int = Field(0, ge=0)
    outcomes: dict[str, int] = Field(default_factory=dict, description="restore status -> rows")


class EnrichedInfo(ExtraPart):
    """What the enrich stage promises other modules in its manifest's `extra` (per-split counts,
    withheld prompts restored per seed source)."""

    objective: str = Field("sft", description="sft, or dpo: the rows carry a rejected answer too")
    splits: dict[str, StageCounts] = Field(default_factory=dict, description="input split -> in/out/rejected")
    prompt_sources: dict[str, PromptSourceOutcome] = Field(default_factory=dict)


class LengthFitCategory(Handoff):
    """One record category's rendered lengths against seq_len (issue 29, spark_jobs/filter/job.split_fit)."""

    rendered: int = Field(0, ge=0)
    fit: int = Field(0, ge=0)
    fit_without_reasoning: int = Field(0, ge=0)
    reasoning_dropped: int = Field(0, ge=0)
    kept: int = Field(0, ge=0)


class LengthFit(Handoff):
    """The filter's `extra.length_fit`: how many conversations fit seq_len, per record category."""

    seq_len: int
    overflow: str
    with_reasoning: bool
    splits: dict[str, LengthFitCategory] = Field(default_factory=dict)


# the near-duplicate report's measured numbers, kept as written (an int stays an int: the JSON is unchanged)
Number = int | float


class RecallMeasured(Handoff):
    """spark_jobs/near_dups/dedup_types.RecallEstimate as written."""

    sampled_rows: int
    with_duplicate: int
    found: int
    recall: Number | None
    low_95: Number | None
    high_95: Number | None


class GuardSavedPair(Handoff):
    """A pair the near-duplicate guard kept apart (both rows stay; the data report shows them)."""

    split: str
    id: str
    other_id: str
    similarity: Number


class NearDupSummary(Handoff):
    """The filter's `extra.near_duplicates`: the method's parameters, the recall measured on the run's
    rows and what the guard kept apart (spark_jobs/near_dups/dedup_types.NearDupReport.as_manifest)."""

    method: str
    rows: int
    threshold: Number
    parameters: dict[str, Any] = Field(default_factory=dict)
    measured: RecallMeasured | None = None
    clusters: int
    largest_cluster: int
    mean_cluster: Number
    split_clusters: int
    assignment_agreement: Number
    warnings: list[str] = Field(default_factory=list)
    guard: str = "numbers"
    guard_saved_pairs: int | None = None
    guard_saved_rows: int | None = None
    guard_saved_by_split: dict[str, int] | None = None
    guard_saved_examples: list[GuardSavedPair] = Field(default_factory=list)
    dropped_by_split: dict[str, int] | None = None


class FilterReports(ExtraPart):
    """The filter stage's near-duplicate report and length fit (written by the Spark filter only;
    None in manifests from before them, or written in process)."""

    near_duplicates: NearDupSummary | None = None
    length_fit: LengthFit | None = None


class TrainReadyBasics(ExtraPart):
    """The train-ready `extra` keys manifests had before `TrainReadyInfo` (the data report's fallback)."""

    class LegacyTokenizer(Handoff):
        spec: str | None = None

    seq_len: int = 0
    tokenizer: LegacyTokenizer | None = None
    packing_efficiency: float | None = None


class SplitAccount(Handoff):
    """One input split through both data stages (reports.facts.source_split_rows; the data report and
    the run summary show it): rows in, rejects by '<stage>:<reason>', kept, and the length fit."""

    rows_in: int = Field(0, alias="in")
    rejected: dict[str, int] = Field(default_factory=dict)
    kept: int | None = None
    measured: int | None = None
    fit_with: int | None = None
    fit_without: int | None = None


class SourcesSummary(Handoff):
    """The run summary's `sources`: per input split through both stages, and the withheld prompts
    restored per seed source (plugins/mft_airflow/summary.py)."""

    splits: dict[str, SplitAccount] = Field(default_factory=dict)
    prompt_sources: dict[str, PromptSourceOutcome] = Field(default_factory=dict)

    def to_summary(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class Headline(Handoff):
    """A data report's headline figures (report manifest `extra.headline`; the approval request and
    the run note show them)."""

    records_in: int
    enriched: int
    kept: int
    rejected: dict[str, int] = Field(default_factory=dict, description="'<stage>:<reason>' -> rows")
    tokens: dict[str, int] = Field(default_factory=dict)
    target_tokens: dict[str, int] = Field(default_factory=dict)
    documents: dict[str, int] = Field(default_factory=dict)
    val_documents: int = 0
    packing_efficiency: float | None = None
    seq_len: int = 0


class DataReportInfo(ExtraPart):
    headline: Headline | None = None


class ReportRef(Handoff):
    """The data report task's XCom: the report's URIs and headline, for the approval gate and the run note."""

    uri: str
    page: str = Field(description="store URI of the report page")
    headline: Headline | None = None
    view: str | None = Field(None, description="the page's browser address, when Airflow's [api] base_url is set")


class MetricScore(Handoff):
    value: float | None
    stderr: float | None = None


class TaskScores(Handoff):
    """One lm-evaluation-harness task's scores on a model (training/benchmarks.py)."""

    task: str
    num_fewshot: int
    limit: int | None = None
    samples: int = Field(ge=0, description="documents scored")
    metrics: dict[str, MetricScore] = Field(default_factory=dict, description="'<metric>,<filter>' -> score")
    higher_is_better: dict[str, bool] = Field(default_factory=dict, description="metric name -> direction")
    yaml_sha256: str | None = Field(None, description="sha256 of the local YAML task, when the task is one")


class BenchmarkResults(Handoff):
    """What a run's `eval/` artifact promises (its manifest `extra`): scores per task of one model."""

    model_uri: str
    model_manifest_sha256: str
    harness_version: str
    tasks: tuple[TaskScores, ...] = ()

    def to_extra(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> BenchmarkResults:
        return cls.read(manifest.extra or {})

    def score(self, task: str, metric: str) -> MetricScore | None:
        """`metric` as '<name>' (first filter reporting it) or '<name>,<filter>'."""
        t = next((t for t in self.tasks if t.task == task), None)
        if t is None:
            return None
        if metric in t.metrics:
            return t.metrics[metric]
        return next((v for k, v in sorted(t.metrics.items()) if k.split(",")[0] == metric), None)
