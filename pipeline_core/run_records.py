"""What a training run writes that other modules read back: its metrics tables, the promotion decision.

- `StepMetrics` / `EvalMetrics`: one row of the run report's `metrics.csv` / `eval.csv`. The
  column lists (`STEP_COLUMNS`, `EVAL_COLUMNS`) are their fields, in file order: the trainer
  (training/metrics.py) writes those columns, the run summary reads rows back with `read_rows`.
- `Promotion` (SFT, training/promote.py) and `DPOPromotion` (training/dpo_promote.py): the gate's
  decision, stored in the run's `pipeline_summary.json` (`promotion`) and the publish task's XCom,
  read back with `read_decision`. Their `pointer_extra()` is what the pointer record keeps for the
  next run's comparison (`SFTPointerNumbers` / `DPOPointerNumbers`, read with `of`).
- `RunSummary`: the run's `pipeline_summary.json` and the publish task's XCom (plugins/mft_airflow/summary.py
  writes it and formats it; the publish task reads the decision from it).
"""

from __future__ import annotations

import csv
import io
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import Field, field_serializer, field_validator

from pipeline_core.handoffs import (
    BenchmarkResults,
    Counts,
    DecontamInfo,
    ExtraPart,
    Handoff,
    SourcesSummary,
    StageCounts,
    read_counts,
)

if TYPE_CHECKING:
    from pipeline_core.pointers import PointerRecord


class StepMetrics(Handoff):
    """One row of `metrics.csv`: a training step; the pair metrics are empty for SFT runs."""

    step: int
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    target_tokens: int | None = None
    skipped: int | None = None
    # objective dpo: the step's pair metrics (training/dpo_loss.DPOMetrics.as_row)
    pairs: int | None = None
    dpo_loss: float | None = None
    reward_accuracy: float | None = None
    chosen_reward: float | None = None
    rejected_reward: float | None = None
    reward_margin: float | None = None


STEP_COLUMNS = tuple(StepMetrics.model_fields)  # file order
DPO_COLUMNS = STEP_COLUMNS[STEP_COLUMNS.index("pairs"):]


class EvalMetrics(Handoff):
    """One row of `eval.csv`: a validation pass at `step` (the pair metrics: `eval_` + DPO_COLUMNS)."""

    step: int
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    eval_micro_batches: int | None = None
    eval_target_tokens: int | None = None
    eval_pairs: int | None = None
    eval_dpo_loss: float | None = None
    eval_reward_accuracy: float | None = None
    eval_chosen_reward: float | None = None
    eval_rejected_reward: float | None = None
    eval_reward_margin: float | None = None


EVAL_COLUMNS = tuple(EvalMetrics.model_fields)
M = TypeVar("M", bound=Handoff)


def read_rows(model: type[M], text: str) -> list[M]:
    """The rows of a metrics CSV as written (`None` and '' are empty cells)."""
    return [model.read({k: v for k, v in r.items() if v not in ("", "None")}) for r in csv.DictReader(io.StringIO(text))]


class RunReportInfo(ExtraPart):
    """The run report's manifest `extra` (training/train.py): the final validation and, objective dpo,
    the val pair metrics and the reference log-probs they were measured against."""

    eval_loss: float | None = None
    eval_perplexity: float | None = None
    final_train_loss: float | None = None
    eval_reward_accuracy: float | None = None
    eval_reward_margin: float | None = None
    eval_dpo_loss: float | None = None
    reference_uri: str | None = None


class MetricComparison(Handoff):
    """One `release.promote_on` metric: both models' scores (each from its own eval artifact)."""

    task: str
    metric: str
    candidate: float | None
    current: float | None
    min_delta: float
    higher_is_better: bool
    worse_by: float | None = Field(description="how much worse the candidate is (negative: better); None when a score is missing")
    ok: bool


class Decision(Handoff):
    """What every gate returns (training/pointer_gate): the verdict and the pointer record it was made against."""

    promoted: bool
    reason: str
    candidate_uri: str
    current_uri: str | None = Field(description="the pointer's target the candidate was compared with (None: empty pointer)")
    val_uri: str
    order_key: str
    forced: bool
    latest_uri: str | None = Field(None, description="where the pointer names after the decision")
    current_order_key: str | None = Field(None, description="the pointer record compared with (the compare-and-swap's expected value)")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def pointer_extra(self) -> dict[str, Any]:
        """The numbers the pointer record keeps (what the next run is compared with)."""
        raise NotImplementedError


class Promotion(Decision):
    """The SFT gate's decision and the numbers it was made on (training/promote.py)."""

    candidate_val_loss: float | None
    current_val_loss: float | None
    tolerance: float
    val_rows: int
    val_target_tokens: int
    promote_on: str = Field("val_loss", description='or "metrics": `compared` decided')
    compared: tuple[MetricComparison, ...] = Field((), description="every benchmark metric compared (release.promote_on)")

    def pointer_extra(self) -> dict[str, Any]:
        return SFTPointerNumbers(val_uri=self.val_uri, val_loss=self.candidate_val_loss,
                                 previous=self.current_uri).to_json_dict()


class DPOPromotion(Decision):
    """The DPO gate's decision: the run's val reward accuracy and margin (training/dpo_promote.py)."""

    reward_accuracy: float | None
    reward_margin: float | None
    current_reward_accuracy: float | None
    current_reward_margin: float | None
    reference_uri: str | None

    def pointer_extra(self) -> dict[str, Any]:
        """The numbers the next DPO run is compared with, and the pairs they were measured on."""
        return DPOPointerNumbers(val_uri=self.val_uri, reference_uri=self.reference_uri,
                                 reward_accuracy=self.reward_accuracy, reward_margin=self.reward_margin,
                                 previous=self.current_uri).to_json_dict()


def read_decision(data: dict[str, Any]) -> Promotion | DPOPromotion:
    """A stored decision (`pipeline_summary.json`'s `promotion`, the publish XCom) as its model."""
    return (DPOPromotion if "reward_accuracy" in data else Promotion).read(data)


class SFTPointerNumbers(Handoff):
    """`models/LATEST`'s record `extra`: the promoted model's val loss and the rows it was measured on."""

    val_uri: str
    val_loss: float | None
    previous: str | None

    @classmethod
    def of(cls, record: PointerRecord) -> SFTPointerNumbers | None:
        return cls.read(record.extra) if "val_loss" in record.extra else None


class DPOPointerNumbers(Handoff):
    """`models/dpo/LATEST`'s record `extra`: what the next DPO run is compared with, on which pairs."""

    val_uri: str
    reference_uri: str | None
    reward_accuracy: float | None
    reward_margin: float | None
    previous: str | None

    @classmethod
    def of(cls, record: PointerRecord) -> DPOPointerNumbers | None:
        """None for a record written by another gate (or before these numbers were kept)."""
        return cls.read(record.extra) if "reward_accuracy" in record.extra else None


class StageSummary(Handoff):
    """One data stage in the run summary: its artifact and the manifest's counts and timings."""

    uri: str
    committed: bool = True
    counts: Counts | None = None
    timings: dict[str, Any] | None = None

    @field_validator("counts", mode="before")
    @classmethod
    def _typed_counts(cls, v: Any) -> Counts | None:
        return read_counts(v)

    @property
    def stage_counts(self) -> StageCounts | None:
        return self.counts if isinstance(self.counts, StageCounts) else None


class FilterSummary(StageSummary):
    decontamination: DecontamInfo | None = None


class DPOPoint(Handoff):
    """objective dpo: the pair metrics at one step (train: that step's pairs; val: every val pair)."""

    step: int
    pairs: int | None = None
    loss: float | None = None
    reward_accuracy: float | None = None
    chosen_reward: float | None = None
    rejected_reward: float | None = None
    reward_margin: float | None = None


class DPOCurves(Handoff):
    train: tuple[DPOPoint, ...] = ()
    val: tuple[DPOPoint, ...] = ()


class TrainSummary(RunReportInfo):
    """The run's training in the summary: the run report's figures and the loss at its first and last
    logged step (metrics.csv)."""

    run_uri: str | None = None
    tokens: int | None = None
    loss_start: float | None = None
    loss_end: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    dpo: DPOCurves | None = None


class ModelSummary(Handoff):
    uri: str
    files: int = Field(ge=0)
    bytes: int = Field(ge=0)
    manifest_sha256: str | None = None


class EvalSummary(BenchmarkResults):
    """The run's committed benchmark scores and where they are (runs/<run>/eval)."""

    uri: str


class RunSummary(Handoff):
    """What a published run did (`runs/<run>/pipeline_summary.json`, the publish task's XCom): the data
    stages' counts, the training's losses, the model, its scores and the promotion decision."""

    dataset_version: str
    run_id: str
    objective: str = "sft"
    source_uri: str
    enrich: StageSummary
    filter: FilterSummary
    data_report: str | None = Field(None, description="the data report's page URI")
    sources: SourcesSummary | None = None
    train: TrainSummary = TrainSummary()
    model: ModelSummary
    eval: EvalSummary | None = None
    # the gate's decision: each kind has required fields the other lacks, so the union reads it as
    # read_decision does (a partial decision is refused)
    promotion: Promotion | DPOPromotion | None = None
    latest: str | None = Field(None, description="the pointer the decision was about (models[/dpo]/LATEST)")

    @field_serializer("sources")
    def _sources_as_written(self, v: SourcesSummary | None) -> dict[str, Any] | None:
        return None if v is None else v.to_summary()  # only what was counted (no empty keys per source)
