"""The DAG's operators. Each one orchestrates; the work happens in the stage commands.

Every stage task is idempotent: it first looks for its committed artifact (a manifest) and, if
there is one, does nothing but report it; otherwise it launches the stage command, which
commits the artifact, and then checks that it did. A retried training run has the same run id,
so the trainer resumes from the run's newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, AssetAlias, BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from plugins.mft_airflow.settings import DeploySettings

log = logging.getLogger(__name__)
PLAN_TASK_ID = "resolve"


def _plan(context: Any, task_id: str = PLAN_TASK_ID) -> dict[str, Any]:
    plan = context["ti"].xcom_pull(task_ids=task_id)
    if not plan:
        raise AirflowFailException(f"no plan in XCom of task {task_id!r}; it must run first")
    return plan


def _committed_by(what: str, uri: str, storage: Any) -> Any:
    """The manifest a stage command that exited 0 must have committed; its absence is a failure
    of that command, said as such (not "run the stage first": it just ran)."""
    from pipeline_core.artifacts import ArtifactNotFound, require_manifest

    try:
        return require_manifest(uri, storage)
    except ArtifactNotFound:
        raise RuntimeError(f"{what} finished without error but committed no artifact at {uri} (no manifest); "
                           "the stage command must publish its output before exiting 0 -- see its log above") from None


def _summary(manifest: Any, reused: bool) -> dict[str, Any]:
    return {"uri": manifest.uri, "kind": manifest.kind, "counts": manifest.counts, "reused": reused,
            "manifest_sha256": manifest.sha256, "extra": manifest.extra}


class ResolvePlanOperator(BaseOperator):
    """First task: validate the Params and config, write the resolved config, push the plan."""

    ui_color = "#e8f4ea"

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        super().__init__(**kwargs)
        self.settings = settings

    def execute(self, context: Any) -> dict[str, Any]:
        from plugins.mft_airflow.plan import PlanError, resolve_plan

        dag_run = context["dag_run"]
        run_date = context.get("logical_date") or dag_run.run_after
        try:
            plan = resolve_plan(
                dict(context["params"]), dag_id=self.dag_id, airflow_run_id=dag_run.run_id,
                run_date=run_date, config_file=self.settings.config_file,
            )
        except (PlanError, ValueError) as e:
            # a bad parameter is not transient: fail now, without retries
            raise AirflowFailException(str(e)) from None
        self.log.info("plan:\n%s", json.dumps(plan, indent=2))
        return plan


class SparkStageOperator(BaseOperator):
    """A Spark stage (enrich or filter) through `SparkSubmitOperator` on `spark_conn_id`."""

    ui_color = "#fdf0e0"

    def __init__(self, *, stage: str, application: str, input_key: str, output_key: str,
                 settings: DeploySettings, **kwargs: Any):
        super().__init__(**kwargs)
        self.stage, self.application = stage, application
        self.input_key, self.output_key = input_key, output_key
        self.settings = settings
        self._inner: Any = None

    def build_submit(self, plan: dict[str, Any]) -> Any:
        """The SparkSubmitOperator for this plan (also what tests inspect)."""
        from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

        s = self.settings
        python = s.spark_python or sys.executable
        # Spark's INFO startup chatter would drown the task log; the stage logs what matters
        conf = {"spark.pyspark.python": python, "spark.pyspark.driver.python": python, "spark.log.level": "WARN",
                **s.spark_conf}
        env = {"PYSPARK_PYTHON": python,
               # spark-submit is resolved on this PATH: the interpreter's own bin dir first
               "PATH": os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")])}
        return SparkSubmitOperator(
            task_id=f"{self.task_id}-submit",
            conn_id=s.spark_conn_id,
            application=str(Path(s.spark_app_dir) / self.application),
            application_args=["--input", plan[self.input_key], "--output", plan[self.output_key],
                              "--config", plan["config_file"]],
            name=f"mft-{self.stage}-{plan['dataset_version']}",
            conf=conf,
            py_files=s.spark_py_files,
            archives=s.spark_archives,
            executor_memory=s.spark_executor_memory,
            executor_cores=s.spark_executor_cores,
            driver_memory=s.spark_driver_memory,
            num_executors=s.spark_num_executors,
            env_vars=env,
        )

    def execute(self, context: Any) -> dict[str, Any]:
        from pipeline_core.artifacts import read_manifest
        from plugins.mft_airflow.plan import load_plan_config

        plan = _plan(context)
        if self.stage not in plan["stages"]:
            raise AirflowSkipException(f"{self.stage} not in stages {plan['stages']}; using the committed artifact")
        storage = load_plan_config(plan).storage
        out = plan[self.output_key]
        existing = read_manifest(out, storage)
        if existing is not None:
            self.log.info("%s: artifact %s is already committed; nothing to do", self.stage, out)
            manifest, reused = existing, True
        else:
            self._inner = self.build_submit(plan)
            self._inner.execute(context)
            manifest, reused = _committed_by(f"{self.stage}: spark-submit", out, storage), False
        self.log.info("%s: %s counts=%s", self.stage, out, manifest.counts)
        self._emit_asset(context, plan, out, manifest, reused)
        return _summary(manifest, reused)

    def _emit_asset(self, context: Any, plan: dict[str, Any], uri: str, manifest: Any, reused: bool) -> None:
        for outlet in self.outlets:
            if isinstance(outlet, AssetAlias):
                context["outlet_events"][outlet].add(
                    Asset(name=f"{outlet.name}/{plan['dataset_version']}/{uri.rsplit('/', 1)[1]}", uri=uri),
                    extra={"dataset_version": plan["dataset_version"], "manifest_sha256": manifest.sha256,
                           "reused": reused},
                )

    def on_kill(self) -> None:
        if self._inner is not None:
            self._inner.on_kill()


class TrainOperator(BaseOperator):
    """Training through the launcher the plan names (local / docker / kubernetes)."""

    ui_color = "#e6e6fa"

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        super().__init__(**kwargs)
        self.settings = settings
        self._inner: Any = None

    def build_launcher(self, plan: dict[str, Any]) -> Any:
        from plugins.mft_airflow.launchers import build_launcher
        from plugins.mft_airflow.plan import load_plan_config

        return build_launcher(plan, load_plan_config(plan), self.settings, self.task_id, self.log)

    def execute(self, context: Any) -> dict[str, Any]:
        from pipeline_core.artifacts import read_manifest
        from plugins.mft_airflow.plan import load_plan_config

        plan = _plan(context)
        if "train" not in plan["stages"]:
            raise AirflowSkipException(f"train not in stages {plan['stages']}")
        storage = load_plan_config(plan).storage
        existing = read_manifest(plan["model_uri"], storage)
        if existing is not None:
            trained_on = [i["uri"] for i in existing.inputs]
            if trained_on and plan["train_ready_uri"] not in trained_on:
                # a run id names one training run; reusing it for other data would be a silent lie
                raise AirflowFailException(
                    f"run_id: run {plan['run_id']} already has a model trained on {trained_on[0]}, not on "
                    f"{plan['train_ready_uri']}; give this training a new run_id")
            self.log.info("train: model %s is already committed; nothing to do", plan["model_uri"])
            return _summary(existing, True)
        self.log.info("train: run %s (%s launcher), resuming from its newest checkpoint if any",
                      plan["run_uri"], plan["launcher"])
        self._inner = self.build_launcher(plan)
        self._inner.execute(context)
        return _summary(_committed_by(f"train: the {plan['launcher']} launcher", plan["model_uri"], storage), False)

    def on_kill(self) -> None:
        if self._inner is not None:
            self._inner.on_kill()


class PublishModelOperator(BaseOperator):
    """Evaluation-gated publish (plugins.mft_airflow.summary.publish_model): sha256 of every file,
    val loss vs the current LATEST, summary, then `models/LATEST` forward only."""

    ui_color = "#e0f0ff"

    def execute(self, context: Any) -> dict[str, Any]:
        from pipeline_core.pointers import order_key_from_date
        from plugins.mft_airflow.plan import load_plan_config
        from plugins.mft_airflow.summary import format_summary, publish_model

        plan = _plan(context)
        if "train" not in plan["stages"]:
            raise AirflowSkipException("no training in this run; nothing to publish")
        cfg = load_plan_config(plan)
        # runs are ordered by logical date (trigger time for manual runs): LATEST never moves back
        order_key = order_key_from_date(context.get("logical_date") or context["dag_run"].run_after)
        summary = publish_model(plan, cfg.storage, order_key, cfg.release)
        self.log.info("\n%s", format_summary(summary))
        return summary


def log_failure(context: Any) -> None:
    """Failure callback: say which artifact or run the failed task was producing."""
    ti = context.get("ti")
    task_id = getattr(ti, "task_id", "?")
    try:
        plan = ti.xcom_pull(task_ids=PLAN_TASK_ID) if ti else None
    except Exception:  # the callback must never raise
        plan = None
    if not plan:
        log.error("mistral_finetune: task %s failed before a plan existed (invalid params or config?)", task_id)
        return
    target = {"enrich": plan.get("enriched_uri"), "filter": plan.get("train_ready_uri"),
              "train": plan.get("run_uri"), "publish": plan.get("model_uri")}.get(task_id, plan.get("run_uri"))
    log.error("mistral_finetune: task %s failed; dataset_version=%s run_id=%s target=%s (not committed; "
              "a retry resumes from what is committed)", task_id, plan.get("dataset_version"),
              plan.get("run_id"), target)
