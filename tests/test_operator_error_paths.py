"""The operators' failure paths: a Spark stage that "succeeds" without committing its artifact
fails the task and says so; the DAG's failure callback names what was not committed and never
raises itself. Real spark-submit (local[2]) under the real SparkStageOperator."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest
from plugins.mft_airflow.operators import SparkStageOperator
from plugins.mft_airflow.plan import resolve_plan
from plugins.mft_airflow.settings import load_settings
from tests.dag_helpers import DAG_ID, REPO
from tests.test_dag_params import deployment_env


class _TaskInstance:
    """What the operators ask of Airflow's task instance here: the plan in XCom, and an id."""

    def __init__(self, plan: Any, task_id: str = "enrich", broken: bool = False):
        self.plan, self.task_id, self.broken = plan, task_id, broken
        # what the provider's execute reads of its task instance (OpenLineage parent-job info)
        self.dag_id, self.run_id, self.try_number, self.map_index = DAG_ID, "manual__x", 1, -1

    def xcom_pull(self, task_ids: str):
        if self.broken:
            raise RuntimeError("XCom backend unreachable")
        return self.plan


@pytest.fixture
def plan(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    params = {"dataset_version": "v1", "run_id": "r1", "stages": ["enrich", "filter", "train"]}
    # store and staging are deployment settings (MFT__ environment), never a trigger's
    env = deployment_env({"pipeline.store_uri": uris.qualify(store),
                          "pipeline.staging_uri": uris.qualify(tmp_path / "staging")})
    return resolve_plan(params, dag_id=DAG_ID, airflow_run_id="manual__x", run_date=None, env=env)


def test_spark_stage_that_exits_0_without_a_manifest_fails_the_task(plan, tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    apps = tmp_path / "apps"
    apps.mkdir()
    # a stage application that parses its arguments and returns 0 without publishing anything
    (apps / "enrich.py").write_text("import sys\nprint('pretending to enrich', sys.argv[1:])\n")
    op = SparkStageOperator(task_id="enrich", stage="enrich", application="enrich.py", input_field="source_uri",
                            output_field="enriched_uri", settings=load_settings(env={}, spark_app_dir=str(apps)))
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    def provider_submit(self, context):  # the provider's hook, minus the Task Runner's context
        SparkSubmitHook(conn_id=self._conn_id, name="t").submit(self.application)

    monkeypatch.setattr(SparkSubmitOperator, "execute", provider_submit)
    with pytest.raises(RuntimeError) as e:
        op.execute({"ti": _TaskInstance(plan), "outlet_events": {}})
    msg = str(e.value)
    assert plan.enriched_uri in msg, msg
    assert "spark-submit" in msg and "no artifact" in msg, msg
    assert read_manifest(plan.enriched_uri) is None


def _callback():
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]
    callbacks = {t.task_id: t.on_failure_callback for t in dag.tasks}
    cb = callbacks["train"]
    return cb[0] if isinstance(cb, list) else cb


def test_failure_callback_names_the_target_and_never_raises(plan, caplog):
    cb = _callback()
    caplog.set_level(logging.ERROR)
    cb({"ti": _TaskInstance(plan, task_id="train")})
    assert plan.run_uri in caplog.text and "train" in caplog.text and plan.run_id in caplog.text
    caplog.clear()
    cb({"ti": _TaskInstance(plan, task_id="filter")})
    assert plan.train_ready_uri in caplog.text
    caplog.clear()
    cb({"ti": _TaskInstance(None, task_id="resolve")})  # failed before a plan existed
    assert "before a plan existed" in caplog.text
    caplog.clear()
    cb({"ti": _TaskInstance(plan, task_id="enrich", broken=True)})  # the callback must not raise
    assert "enrich" in caplog.text
    cb({})  # not even without a task instance
