"""The stage operators' common base: the plan in XCom (`pull_plan`, `TEMPLATED_PLAN`,
`plan_field`), the stage result, and the stage mixins (`_PlanStage`, `_TrainStage`, `_EvalStage`)
that the local operators (operators.py) and the container operators (container_operators.py)
both build on, so neither imports the other at module level."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, AssetAlias
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from airflow.sdk.serde import allow_class
from pydantic import Field, field_validator

from pipeline_core.handoffs import Counts, Handoff, read_counts
from pipeline_core.names import Stage
from plugins.mft_airflow.run_plan import RunPlan

log = logging.getLogger(__name__)
PLAN_TASK_ID = "resolve"
REPO_ROOT = Path(__file__).resolve().parents[2]


class StageResult(Handoff):
    """What a stage task returns (XCom): the artifact it committed or reused. The XCom holds
    `to_json_dict()` (the counts with their manifest keys, JSON-serialisable); read it back with `read`."""

    uri: str
    kind: str
    counts: Counts | None = Field(description="the manifest's counts; None for a count-less artifact")
    reused: bool
    manifest_sha256: str

    @field_validator("counts", mode="before")
    @classmethod
    def _typed_counts(cls, v: Any) -> Counts | None:
        return read_counts(v)


allow_class(RunPlan)
allow_class(StageResult)


def plan_field(name: str) -> str:
    """A Jinja template rendering one field of the run's plan."""
    if name not in RunPlan.model_fields:
        raise ValueError(f"RunPlan has no field {name!r}")
    return "{{ ti.xcom_pull(task_ids='" + PLAN_TASK_ID + "')." + name + " }}"


# The plan as templates: spec builders fill argv with these; Airflow renders them per run.
TEMPLATED_PLAN = RunPlan.model_construct(**{n: plan_field(n) for n, f in RunPlan.model_fields.items()
                                            if f.annotation in ("str", str)})


def pull_plan(context: Any) -> RunPlan:
    plan = context["ti"].xcom_pull(task_ids=PLAN_TASK_ID)
    if not plan:
        raise AirflowFailException(f"no plan in XCom of task {PLAN_TASK_ID!r}; it must run first")
    return plan if isinstance(plan, RunPlan) else RunPlan.model_validate(plan)


def asset_extra(plan: RunPlan, manifest: Any, reused: bool) -> dict[str, Any]:
    """Asset-event `extra`: what downstream consumers schedule and filter on (rows, tokens)."""
    from pipeline_core.handoffs import StageCounts, TrainReadyInfo

    counts = StageCounts.of(manifest)
    extra: dict[str, Any] = {"dataset_version": plan.dataset_version, "manifest_sha256": manifest.sha256,
                             "reused": reused, "rows_in": counts.rows_in if counts else None,
                             "rows_out": counts.rows_out if counts else None,
                             "rows_rejected": counts.rejected_total if counts else 0}
    if manifest.kind == "train-ready":
        try:
            info = TrainReadyInfo.from_manifest(manifest)
        except ValueError:  # an artifact committed before the typed hand-off: counts only
            return extra
        extra.update(tokens=info.tokens, target_tokens=info.target_tokens, sequences=info.sequences,
                     seq_len=info.seq_len)
    return extra


class _PlanStage:
    """What every stage operator shares: the plan, idempotency, assets and lineage."""

    stage: Stage
    command_name = "the stage command"  # named in the error when it "succeeds" without committing
    input_field: str
    output_field: str
    outlets: Sequence[Any]

    def _begin(self, context: Any) -> tuple[RunPlan, Any]:
        """(plan, committed manifest or None); skips when the run leaves this stage out."""
        from plugins.mft_airflow.hooks import ArtifactStoreHook
        from plugins.mft_airflow.plan import load_plan_config

        plan = pull_plan(context)
        if not plan.runs(self.stage):
            raise AirflowSkipException(f"{self.stage} not in stages {list(plan.stages)}; using the committed artifact")
        self._plan, self._store = plan, ArtifactStoreHook(load_plan_config(plan).storage)
        self._manifest = self._store.manifest(getattr(plan, self.output_field))
        return plan, self._manifest

    def _finish(self, context: Any, reused: bool) -> StageResult:
        plan = self._plan
        uri = getattr(plan, self.output_field)
        manifest = self._manifest if reused else self._store.manifest(uri)
        if manifest is None:  # the command ended well but committed nothing: say which, and where
            raise RuntimeError(f"{self.stage}: {self.command_name} exited with status 0 but committed no artifact "
                               f"at {uri} (no _manifest.json); see the task log above for its output")
        self._manifest = manifest
        self.log.info("%s: %s %s counts=%s", self.stage, "reused" if reused else "committed", uri, manifest.counts)
        for outlet in self.outlets:
            if isinstance(outlet, AssetAlias):
                context["outlet_events"][outlet].add(
                    Asset(name=f"{outlet.name}/{plan.dataset_version}/{uri.rsplit('/', 1)[1]}", uri=uri),
                    extra=asset_extra(plan, manifest, reused))
        return StageResult(uri=uri, kind=manifest.kind, counts=read_counts(manifest.counts), reused=reused,
                           manifest_sha256=manifest.sha256)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        from plugins.mft_airflow.lineage import lineage

        plan = getattr(self, "_plan", None)
        if plan is None:  # skipped or failed before the plan was read
            return None
        return lineage([getattr(plan, self.input_field)],
                       [(getattr(plan, self.output_field), getattr(self, "_manifest", None))])


# ------------------------------------------------------------------------------------------ Spark


class _TrainStage(_PlanStage):
    command_name = "the training launcher"
    stage: Stage = Stage.TRAIN
    input_field = "train_ready_uri"
    output_field = "model_uri"
    prefetch_base = True  # containers: fill the hub cache with the base model before going offline

    def _begin_training(self, context: Any) -> bool:
        """True when the run's model is already committed (nothing to launch)."""
        plan, existing = self._begin(context)
        if existing is not None:
            trained_on = [i["uri"] for i in existing.inputs]
            if trained_on and plan.train_ready_uri not in trained_on:
                # a run id names one training run; reusing it for other data would be a silent lie
                raise AirflowFailException(
                    f"run_id: run {plan.run_id} already has a model trained on {trained_on[0]}, not on "
                    f"{plan.train_ready_uri}; give this training a new run_id")
            self.log.info("train: model %s is already committed; nothing to do", plan.model_uri)
            return True
        self.log.info("train: run %s, resuming from its newest checkpoint if any", plan.run_uri)
        return False

    def _config(self) -> Any:
        from plugins.mft_airflow.plan import load_plan_config

        return load_plan_config(self._plan)


class _EvalStage(_TrainStage):
    """Benchmarks after training (`python -m training.benchmarks`, docs/evaluation.md), launched like
    the trainer. A run without `release.eval_tasks` succeeds with nothing to do (publish follows)."""

    command_name = "the benchmark runner"
    input_field = "model_uri"
    output_field = "eval_uri"
    prefetch_base = False
    _no_tasks = False

    def _begin_training(self, context: Any) -> bool:
        plan, existing = self._begin(context)
        if existing is not None:
            self.log.info("eval: scores %s are already committed; nothing to do", plan.eval_uri)
            return True
        if not self._config().release.eval_tasks:
            self.log.info("eval: release.eval_tasks is empty; no benchmarks for this run")
            self._no_tasks = True
            return True
        return False

    def _finish(self, context: Any, reused: bool) -> StageResult:
        if self._no_tasks:
            return StageResult(uri=self._plan.eval_uri, kind="none", counts=None, reused=False, manifest_sha256="")
        return super()._finish(context, reused)
