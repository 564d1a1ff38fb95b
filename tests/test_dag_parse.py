"""The DAG file imports cleanly, parses fast and stays thin (no provider / ML imports at parse time)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dag_helpers import DAG_ID, REPO, airflow_env

# Runs in a fresh interpreter that has Airflow loaded, like a DAG processor's parse subprocess:
# the DAG file and our plugin modules are imported cold.
PARSE = r"""
import json, sys, time
import airflow.sdk  # already loaded in a DAG processor
from airflow.dag_processing.dagbag import DagBag
from airflow.utils.file import iter_airflow_imports
# the DAG processor pre-imports the airflow.* modules a DAG file names, once, before forking parsers
pre = sorted(iter_airflow_imports(sys.argv[1] + "/mistral_finetune.py"))
for m in pre:
    __import__(m)
before = set(sys.modules)
# CPU time, not wall time: on a shared machine the scheduler's delays are not the DAG file's cost
t = time.process_time()
bag = DagBag(dag_folder=sys.argv[1])
elapsed = time.process_time() - t
heavy = [m for m in ("torch", "pyspark", "deepspeed", "transformers", "docker", "kubernetes",
                     "airflow.providers.apache.spark", "airflow.providers.docker",
                     "airflow.providers.cncf.kubernetes", "boto3") if m in set(sys.modules) - before]
dag = bag.dags.get("mistral_finetune")
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dag_ids": sorted(bag.dag_ids),
                  "elapsed": elapsed, "heavy": heavy, "pre_imported": pre,
                  "tasks": sorted(dag.task_ids) if dag else None,
                  "types": {t.task_id: [c.__name__ for c in type(t).__mro__] for t in dag.tasks} if dag else None,
                  "edges": sorted((t.task_id, d) for t in dag.tasks for d in t.downstream_task_ids) if dag else None}))
"""


def _parse(tmp_path) -> dict:
    env = airflow_env(tmp_path / "airflow_home")
    out = subprocess.run([sys.executable, "-c", PARSE, str(REPO / "dags")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_dagbag_has_no_import_errors_and_parses_fast(tmp_path):
    results = [_parse(tmp_path)]
    r = results[0]
    assert r["errors"] == {}
    assert r["dag_ids"] == [DAG_ID]
    assert r["tasks"] == ["approve", "data_report", "enrich", "evaluate", "filter", "publish", "resolve", "train"]
    # publish takes the plan as its argument: an edge from resolve besides the chain
    assert r["edges"] == [["approve", "train"], ["data_report", "approve"], ["enrich", "filter"],
                          ["evaluate", "publish"], ["filter", "data_report"], ["resolve", "enrich"],
                          ["resolve", "publish"], ["train", "evaluate"], ["train", "publish"]]
    # the Spark stages ARE SparkSubmitOperators; the provider is named in the DAG file, so the DAG
    # processor pre-imports it once, and nothing heavy (torch, Spark, boto3) is imported per parse
    assert "airflow.providers.apache.spark.operators.spark_submit" in r["pre_imported"]
    assert "SparkSubmitOperator" in r["types"]["enrich"] and "SparkSubmitOperator" in r["types"]["filter"]
    assert r["heavy"] == []
    # the machine is shared: judge CPU seconds (not wall), best of up to three cold parses
    while min(x["elapsed"] for x in results) >= 0.5 and len(results) < 3:
        results.append(_parse(tmp_path))
    best = min(x["elapsed"] for x in results)
    print(f"DAG file parse CPU time (cold, best of {len(results)}): {best * 1000:.0f} ms")
    assert best < 0.5, f"the DAG file took {best:.2f} CPU s to parse; keep heavy imports and I/O out of it"


def test_dag_structure_retries_pool_and_schedule(tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]
    assert dag.catchup is False
    assert dag.timetable.expression == "0 2 * * *"  # nightly by default (CronTriggerTimetable)
    train = dag.get_task("train")
    assert train.pool == "gpu"
    for tid in ("enrich", "filter", "train", "publish"):
        t = dag.get_task(tid)
        assert t.retries >= 1 and t.retry_exponential_backoff and t.execution_timeout is not None, tid
        assert t.on_failure_callback, tid
    # a bad parameter is not transient: the validating task never retries
    assert dag.get_task("resolve").retries == 0
    assert {o.name for o in dag.get_task("enrich").outlets} == {"mistral_finetune/enriched"}
    assert {o.name for o in dag.get_task("filter").outlets} == {"mistral_finetune/train_ready"}
    assert {o.name for o in dag.get_task("publish").outlets} == {"mistral_finetune/model"}
    for t in dag.tasks:  # every task documents itself in the UI
        assert t.doc_md and t.doc_md.startswith(f"### {t.task_id}"), t.task_id


def test_deployment_settings_from_the_environment():
    from plugins.mft_airflow.settings import load_settings

    s = load_settings(env={"MFT_DEPLOY__START_DATE": "2099-01-01", "MFT_DEPLOY__GPUS": "4",
                           "MFT_DEPLOY__SCHEDULE": "@weekly", "MFT_DEPLOY__SPARK_CONF": '{"spark.x": "1"}',
                           "MFT_CONFIG": "/etc/mft.yaml"})
    assert (s.start_date, s.gpus, s.schedule, s.spark_conf, s.config_file) == (
        "2099-01-01", 4, "@weekly", {"spark.x": "1"}, "/etc/mft.yaml")
    assert load_settings(env={"MFT_DEPLOY__SCHEDULE": ""}).schedule is None  # manual runs only
    with pytest.raises(ValueError, match="MFT_DEPLOY__GPUS"):
        load_settings(env={"MFT_DEPLOY__GPUS": "-1"})
    with pytest.raises(ValueError, match="MFT_DEPLOY__NO_SUCH"):
        load_settings(env={"MFT_DEPLOY__NO_SUCH": "1"})
