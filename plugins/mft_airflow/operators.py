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
from airflow.sdk import BaseOperator

from pipeline_core.names import Stage
from plugins.mft_airflow.settings import DeploySettings
from plugins.mft_airflow.stage_base import (  # noqa: F401  (PLAN_TASK_ID, StageResult, pull_plan: re-exported)
    PLAN_TASK_ID,
    REPO_ROOT,
    TEMPLATED_PLAN,
    StageResult,
    _EvalStage,
    _PlanStage,
    _TrainStage,
    plan_field,
    pull_plan,
)

log = logging.getLogger(__name__)


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
        return self._finish(context, reused=committed is not None).to_json_dict()


# --------------------------------------------------------------------------------------- training


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
        return self._finish(context, reused=self._hook is None).to_json_dict()

    def on_kill(self) -> None:
        if self._hook is not None:
            self._hook.stop()


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
    target = {Stage.ENRICH: plan.enriched_uri, Stage.FILTER: plan.train_ready_uri, Stage.TRAIN: plan.run_uri,
              "publish": plan.model_uri}.get(task_id, plan.run_uri)
    log.error("mistral_finetune: task %s failed; dataset_version=%s run_id=%s target=%s (not committed; "
              "a retry resumes from what is committed)", task_id, plan.dataset_version, plan.run_id, target)
