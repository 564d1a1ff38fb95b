"""Typed hand-offs between stages: what one stage's manifest promises the next.

The filter stage writes `TrainReadyInfo` into the train-ready manifest's `extra`; the trainer, the
data report and the Airflow summary read it back with `TrainReadyInfo.from_manifest`, never by
string keys of their own. A field added here is a contract change: bump nothing, but give it a
default so manifests committed before it still read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from pipeline_core.artifacts import Manifest


# Train-ready `labels` carry this wherever the loss must not look (prompt tokens, padding): the value
# torch's cross-entropy ignores by default. One definition for the packer, the trainer and the report.
IGNORE_INDEX = -100


class _Handoff(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class StageCounts(_Handoff):
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

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> StageCounts:
        return cls.model_validate(manifest.counts or {})

    @classmethod
    def of(cls, manifest: Manifest) -> StageCounts | None:
        """None where the artifact carries no row counts (neither `in` nor `out`)."""
        if not {"in", "out"} & (manifest.counts or {}).keys():
            return None
        return cls.from_manifest(manifest)


class FileEntry(_Handoff):
    """One entry of a manifest's `files`: a payload file's path under the artifact, size and sha256."""

    path: str = Field(min_length=1)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    def to_entry(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def all_of(cls, manifest: Manifest) -> tuple[FileEntry, ...]:
        return tuple(cls.model_validate(f) for f in manifest.files)


class TokenizerSpec(_Handoff):
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


class EvalSetCount(_Handoff):
    """One eval set the filter decontaminated against: what it was (URI, content hash) and what it removed."""

    name: str
    uri: str
    sha256: str = Field(description="sha256 over the set's files' names and sha256s")
    files: int = Field(ge=0)
    documents: int = Field(ge=0)
    documents_too_short: int = Field(0, ge=0, description="documents under filter.decontam_min_tokens (never matched)")
    rows_removed: int = Field(ge=0, description="records rejected as 'contaminated' naming this set")


class DecontamInfo(_Handoff):
    """The decontamination's settings and per-set counts (spark_jobs/filter/decontaminate.py)."""

    ngram: int
    threshold: float
    answers: bool
    eval_sets: tuple[EvalSetCount, ...] = ()


class TrainReadyInfo(_Handoff):
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
        return cls.model_validate(manifest.extra or {})

    @classmethod
    def of(cls, manifest: Manifest) -> TrainReadyInfo | None:
        """The typed hand-off; None for manifests written before the filter filled it."""
        from pydantic import ValidationError

        try:
            return cls.from_manifest(manifest)
        except ValidationError:
            return None


class MetricScore(_Handoff):
    value: float | None
    stderr: float | None = None


class TaskScores(_Handoff):
    """One lm-evaluation-harness task's scores on a model (training/benchmarks.py)."""

    task: str
    num_fewshot: int
    limit: int | None = None
    samples: int = Field(ge=0, description="documents scored")
    metrics: dict[str, MetricScore] = Field(default_factory=dict, description="'<metric>,<filter>' -> score")
    higher_is_better: dict[str, bool] = Field(default_factory=dict, description="metric name -> direction")
    yaml_sha256: str | None = Field(None, description="sha256 of the local YAML task, when the task is one")


class BenchmarkResults(_Handoff):
    """What a run's `eval/` artifact promises (its manifest `extra`): scores per task of one model."""

    model_uri: str
    model_manifest_sha256: str
    harness_version: str
    tasks: tuple[TaskScores, ...] = ()

    def to_extra(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> BenchmarkResults:
        return cls.model_validate(manifest.extra or {})

    def score(self, task: str, metric: str) -> MetricScore | None:
        """`metric` as '<name>' (first filter reporting it) or '<name>,<filter>'."""
        t = next((t for t in self.tasks if t.task == task), None)
        if t is None:
            return None
        if metric in t.metrics:
            return t.metrics[metric]
        return next((v for k, v in sorted(t.metrics.items()) if k.split(",")[0] == metric), None)
