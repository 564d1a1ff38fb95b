"""The DAG's stage operators, provider style: each one IS the provider operator that runs its stage.

- `SparkStageOperator` is a `SparkSubmitOperator`: its application arguments are templates over
  the `RunPlan` in XCom (the Rendered Template tab shows the real URIs), and the provider's own
  `execute` / `on_kill` submit and stop the job (with OpenLineage parent-job info injected).
- `TrainOperator` (local: torchrun on the worker, through `LocalTrainHook`), `DockerTrainOperator`
  (a `DockerOperator`) and `KubernetesTrainOperator` (a deferrable `KubernetesJobOperator`, one pod
  per node of an indexed Job) run the same trainer; `train_operator` picks the class the
  deployment's launcher names.

Every stage is idempotent: a committed artifact (manifest present) is reported, never rebuilt; a
retried training run keeps its run id and resumes from its newest checkpoint. Each stage emits an
asset event with its row/token counts and OpenLineage inputs/outputs from the plan's URIs.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import Asset, AssetAlias, BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from airflow.sdk.serde import allow_class
from pydantic import BaseModel, ConfigDict

from plugins.mft_airflow.run_plan import RunPlan, Stage
from plugins.mft_airflow.settings import DeploySettings

log = logging.getLogger(__name__)
PLAN_TASK_ID = "resolve"
REPO_ROOT = Path(__file__).resolve().parents[2]


class StageResult(BaseModel):
    """What a stage task returns (XCom): the artifact it committed or reused."""

    model_config = ConfigDict(frozen=True)

    uri: str
    kind: str
    counts: dict[str, Any]
    reused: bool
    manifest_sha256: str


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
    from pipeline_core.handoffs import TrainReadyInfo

    counts = manifest.counts or {}
    extra: dict[str, Any] = {"dataset_version": plan.dataset_version, "manifest_sha256": manifest.sha256,
                             "reused": reused, "rows_in": counts.get("in"), "rows_out": counts.get("out"),
                             "rows_rejected": sum((counts.get("rejected") or {}).values())}
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
        return StageResult(uri=uri, kind=manifest.kind, counts=manifest.counts, reused=reused,
                           manifest_sha256=manifest.sha256)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        from plugins.mft_airflow.lineage import lineage

        plan = getattr(self, "_plan", None)
        if plan is None:  # skipped or failed before the plan was read
            return None
        return lineage([getattr(plan, self.input_field)],
                       [(getattr(plan, self.output_field), getattr(self, "_manifest", None))])


# ------------------------------------------------------------------------------------------ Spark


class SparkStageOperator(_PlanStage, SparkSubmitOperator):
    """A Spark stage of the pipeline (`spark_jobs/<application> --input --output --config`).

    :param stage: `enrich` or `filter` (a run whose `stages` leave it out skips it)
    :param application: the PySpark application under `settings.spark_app_dir`
    :param input_field: the `RunPlan` field holding the input URI
    :param output_field: the `RunPlan` field holding the artifact URI this stage commits
    :param settings: deployment settings (Spark connection, resources, conf, Python)
    """

    template_fields: Sequence[str] = SparkSubmitOperator.template_fields
    ui_color = "#fdf0e0"
    command_name = "spark-submit"

    def __init__(self, *, stage: Stage, application: str, input_field: str, output_field: str,
                 settings: DeploySettings, **kwargs: Any):
        s = settings
        python = s.spark_python or sys.executable
        # Spark's INFO startup chatter would drown the task log; the stage logs what matters
        conf = {"spark.pyspark.python": python, "spark.pyspark.driver.python": python, "spark.log.level": "WARN",
                **s.spark_conf}
        env = {"PYSPARK_PYTHON": python,
               # spark-submit is resolved on this PATH: the interpreter's own bin dir first
               "PATH": os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")])}
        super().__init__(
            conn_id=s.spark_conn_id,
            application=str(Path(s.spark_app_dir) / application),
            application_args=["--input", plan_field(input_field), "--output", plan_field(output_field),
                              "--config", plan_field("config_file")],
            name=f"mft-{stage}-" + plan_field("dataset_version"),
            conf=conf, py_files=s.spark_py_files, archives=s.spark_archives,
            executor_memory=s.spark_executor_memory, executor_cores=s.spark_executor_cores,
            driver_memory=s.spark_driver_memory, num_executors=s.spark_num_executors, env_vars=env,
            openlineage_inject_parent_job_info=True,
            **kwargs,
        )
        self.stage, self.input_field, self.output_field = stage, input_field, output_field

    def execute(self, context: Any) -> dict[str, Any]:
        plan, committed = self._begin(context)
        if committed is None:
            super().execute(context)
        else:
            self.log.info("%s: artifact %s is already committed; nothing to do", self.stage,
                          getattr(plan, self.output_field))
        return self._finish(context, reused=committed is not None).model_dump()


# --------------------------------------------------------------------------------------- training


class _TrainStage(_PlanStage):
    command_name = "the training launcher"
    stage: Stage = "train"
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


class TrainOperator(_TrainStage, BaseOperator):
    """Training on this worker: the torchrun agent (or `deepspeed --hostfile`) as a subprocess
    under a watchdog, so its ranks die with the task.

    :param settings: deployment settings (processes per node, nodes, rendezvous, extra env names)
    """

    template_fields: Sequence[str] = ("command",)
    template_fields_renderers = {"command": "py"}
    ui_color = "#e6e6fa"

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        from plugins.mft_airflow.launchers import local_command

        super().__init__(**kwargs)
        self.settings = settings
        self.command = local_command(TEMPLATED_PLAN, settings)
        self._hook: Any = None

    def build_hook(self, context: Any = None) -> Any:
        from plugins.mft_airflow.hooks import LocalTrainHook
        from plugins.mft_airflow.launchers import attempt_env, local_env

        env = local_env(self._config(), self.settings)
        if context is not None:  # this try's own attempt id (not one the worker's environment carries)
            env.update(attempt_env(context))
        return LocalTrainHook(list(self.command), env, str(REPO_ROOT))

    def execute(self, context: Any) -> dict[str, Any]:
        if not self._begin_training(context):
            self._hook = self.build_hook(context)
            self._hook.run()
        return self._finish(context, reused=self._hook is None).model_dump()

    def on_kill(self) -> None:
        if self._hook is not None:
            self._hook.stop()


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
            return StageResult(uri=self._plan.eval_uri, kind="none", counts={}, reused=False, manifest_sha256="")
        return super()._finish(context, reused)


class EvalOperator(_EvalStage, TrainOperator):
    """The benchmark runner on this worker, as a watched subprocess (like `TrainOperator`)."""

    ui_color = "#e0f0e6"

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        from plugins.mft_airflow.launchers import eval_argv

        super().__init__(settings=settings, **kwargs)
        self.command = eval_argv(TEMPLATED_PLAN, [sys.executable])


def eval_operator(settings: DeploySettings, **kwargs: Any) -> BaseOperator:
    """The eval task for the deployment's launcher: the trainer's machinery with the benchmark command."""
    if settings.launcher == "docker":
        from plugins.mft_airflow.container_operators import DockerEvalOperator

        return DockerEvalOperator(settings=settings, **kwargs)
    if settings.launcher == "kubernetes":
        from plugins.mft_airflow.container_operators import KubernetesEvalOperator

        return KubernetesEvalOperator(settings=settings, **kwargs)
    return EvalOperator(settings=settings, **kwargs)


def train_operator(settings: DeploySettings, **kwargs: Any) -> BaseOperator:
    """The train task for the deployment's launcher (`MFT_DEPLOY__LAUNCHER`)."""
    if settings.launcher == "docker":
        from plugins.mft_airflow.container_operators import DockerTrainOperator

        return DockerTrainOperator(settings=settings, **kwargs)
    if settings.launcher == "kubernetes":
        from plugins.mft_airflow.container_operators import KubernetesTrainOperator

        return KubernetesTrainOperator(settings=settings, **kwargs)
    return TrainOperator(settings=settings, **kwargs)


def log_failure(context: Any) -> None:
    """Failure callback: say which artifact or run the failed task was producing."""
    ti = context.get("ti")
    task_id = getattr(ti, "task_id", "?")
    try:
        plan = pull_plan(context) if ti else None
    except Exception:  # the callback must never raise
        plan = None
    if plan is None:
        log.error("mistral_finetune: task %s failed before a plan existed (invalid params or config?)", task_id)
        return
    target = {"enrich": plan.enriched_uri, "filter": plan.train_ready_uri, "train": plan.run_uri,
              "publish": plan.model_uri}.get(task_id, plan.run_uri)
    log.error("mistral_finetune: task %s failed; dataset_version=%s run_id=%s target=%s (not committed; "
              "a retry resumes from what is committed)", task_id, plan.dataset_version, plan.run_id, target)
