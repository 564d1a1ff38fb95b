"""`airflow dags test mistral_finetune` end to end: real spark-submit (local[2]), real DeepSpeed
on CPU through torchrun, the bundled sample; first on a local-directory store, then on a real S3
server on loopback, where a second run of the same dataset version reuses every committed artifact.
Params keep it tiny (seq_len 64, 2 steps); invalid conf is refused before any task computes.
After a run, the metadata database holds the typed plan (XCom), each operator's rendered templates,
asset events with row/token counts and the model asset event; the OpenLineage provider (file
transport) wrote events naming each stage's inputs and outputs; no Task SDK safeguard warning.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_latest, read_manifest, verify_artifact
from pipeline_core.config import StorageSection
from tests.dag_helpers import DAG_ID, REPO, airflow, airflow_env, init_db

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # whole pipeline runs on 2 shared cores

TINY = {"seq_len": 512, "steps": 2, "learning_rate": 1e-3}  # whole conversations of the sample fit in 512
TINY_OVERRIDES = {
    "train.micro_batch_size": 1, "train.gradient_accumulation_steps": 1, "train.checkpoint_every": 1,
    "train.keep_last": 1, "train.precision": "fp32", "train.eval_batches": 1, "train.warmup_steps": 1,
    "enrich.shuffle_partitions": 2,
}
SPARK_CONF = json.dumps({"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"})


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One Airflow home (SQLite, migrated, `gpu` pool) for the module's runs."""
    home = tmp_path_factory.mktemp("airflow_home")
    init_db(airflow_env(home))
    return home


def roots_env(tmp_path, store: str) -> dict[str, str]:
    """Store and staging are deployment settings (MFT__ environment), not trigger params."""
    return {"MFT__PIPELINE__STORE_URI": store, "MFT__PIPELINE__STAGING_URI": uris.qualify(tmp_path / "staging")}


def lineage_env(path) -> dict[str, str]:
    return {"AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(path), "append": True}),
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "mft-test"}


def dags_test(home, conf: dict, logical_date: str, extra_env: dict | None = None, check: bool = True):
    env = airflow_env(home, {"MFT_DEPLOY__SPARK_CONF": SPARK_CONF, **(extra_env or {})})
    t0 = time.time()
    proc = airflow(["dags", "test", DAG_ID, logical_date, "-c", json.dumps(conf)], env, timeout=1500, check=False)
    out = proc.stdout + proc.stderr
    print(f"airflow dags test ({logical_date}): {time.time() - t0:.0f}s, exit {proc.returncode}")
    finished = re.search(r"DagRun Finished: .*?run_id=(\S+?), .*?state=(\w+)", out)
    if check and (proc.returncode != 0 or not finished or finished.group(2) != "success"):
        raise AssertionError(f"dag run did not succeed (exit {proc.returncode})\n{out[-8000:]}")
    return proc, out, finished


def task_states(home, run_id: str) -> dict[str, str]:
    proc = airflow(["tasks", "states-for-dag-run", DAG_ID, run_id, "-o", "json"], airflow_env(home), timeout=120)
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    return {r["task_id"]: r["state"] for r in rows}


def sample_rows(splits: tuple[str, ...] = ("chat", "code", "math", "stem", "tool")) -> int:
    import pyarrow.parquet as pq

    files = [f for s in splits for f in (REPO / "sample_data" / "nemotron_v1" / "data").glob(f"{s}-*.parquet")]
    return sum(pq.read_metadata(f).num_rows for f in files)


def check_pipeline_output(store_uri: str, storage: StorageSection | None, version: str, rows: int | None = None) -> dict:
    """Every stage committed its artifact under the version's prefix; rows add up; model published."""
    model_uri = read_latest(uris.join(store_uri, "models"), storage)
    assert model_uri is not None, "models/LATEST was not written"
    run_uri = uris.parent(model_uri)
    model = verify_artifact(model_uri, storage)  # every file's size and sha256
    assert model.kind == "model" and any(f["path"].endswith(".safetensors") for f in model.files)
    [train_ready] = model.inputs
    assert f"/datasets/{version}/train/" in train_ready["uri"]
    ready = read_manifest(train_ready["uri"], storage)
    [enriched] = ready.inputs
    assert f"/datasets/{version}/enriched/" in enriched["uri"]
    enr = read_manifest(enriched["uri"], storage)
    for m in (enr, ready):
        c = m.counts
        assert c["in"] == c["out"] + sum(c.get("rejected", {}).values()) and c["out"] > 0
    assert enr.counts["in"] == (rows or sample_rows())  # the bundled sample (or the splits asked for)
    assert ready.counts["in"] == enr.counts["out"]
    assert read_manifest(uris.join(run_uri, "report"), storage) is not None
    return {"model": model_uri, "run": run_uri, "enriched": enr, "train_ready": ready}


def test_invalid_conf_fails_before_compute(home, tmp_path):
    store = uris.qualify(tmp_path / "store")
    # refused by the Params schema: no run is even created
    proc, out, _ = dags_test(home, {"steps": 0}, "2026-01-01", check=False)
    assert proc.returncode != 0 and "steps" in out
    # schema-valid, refused by the config: the first task fails naming the field, nothing downstream runs
    conf = {"config_overrides": {"enrich.top_k": 0}}
    proc, out, finished = dags_test(home, conf, "2026-01-01", roots_env(tmp_path, store), check=False)
    assert finished and finished.group(2) == "failed"
    assert "enrich.top_k" in out
    states = task_states(home, finished.group(1))
    assert states["resolve"] == "failed"
    assert {states[t] for t in ("enrich", "filter", "train", "evaluate", "publish")} == {"upstream_failed"}
    assert not (tmp_path / "store").exists()


def db_rows(home, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(home / "airflow.db") as db:
        return db.execute(sql, args).fetchall()


def test_dags_test_local_store(home, tmp_path):
    store = uris.qualify(tmp_path / "store")
    conf = {**TINY, "config_overrides": TINY_OVERRIDES}
    events = tmp_path / "openlineage.jsonl"
    _, out, finished = dags_test(home, conf, "2026-01-02", {**roots_env(tmp_path, store), **lineage_env(events)})
    run_id = finished.group(1)
    states = task_states(home, run_id)
    assert states == {**dict.fromkeys(["resolve", "enrich", "filter", "data_report", "train", "evaluate", "publish"],
                                      "success"),
                      "approve": "skipped"}  # require_approval is off by default
    got = check_pipeline_output(store, None, "20260102")  # dataset version from the logical date
    assert "/runs/20260102-manual__" in got["run"]
    assert "loss start" in out  # the publish task's summary
    # no operator nests another: the Task SDK's safeguard never fires
    assert "cannot be called outside of the Task Runner" not in out

    # the typed plan went through XCom (serde names the class) and deserializes to a RunPlan
    from airflow.sdk.serde import deserialize

    import plugins.mft_airflow.operators  # noqa: F401  (registers RunPlan for deserialization, as a worker does)
    from plugins.mft_airflow.run_plan import RunPlan

    [(xcom,)] = db_rows(home, "select value from xcom where run_id=? and task_id='resolve' and key='return_value'",
                        run_id)
    plan = deserialize(json.loads(xcom))
    assert isinstance(plan, RunPlan) and plan.model_uri == got["model"]

    # rendered templates of each operator: the real URIs, as the UI's Rendered Template tab shows them
    rendered = {t: json.loads(f) for t, f in db_rows(
        home, "select task_id, rendered_fields from rendered_task_instance_fields where run_id=?", run_id)}
    assert rendered["enrich"]["application_args"] == ["--input", plan.source_uri, "--output", plan.enriched_uri,
                                                      "--config", plan.config_file]
    assert rendered["filter"]["application_args"][1::2] == [plan.enriched_uri, plan.train_ready_uri, plan.config_file]
    assert rendered["filter"]["name"] == "mft-filter-20260102"
    assert rendered["train"]["command"][-6:] == ["--input", plan.train_ready_uri, "--output", plan.run_uri,
                                                 "--config", plan.config_file]

    # asset events with counts for the data artifacts, and the model's event for downstream DAGs
    asset_events = {name: json.loads(extra) for name, extra in db_rows(
        home, "select a.name, e.extra from asset_event e join asset a on a.id = e.asset_id "
              "where e.source_run_id=?", run_id)}
    [enriched] = [v for k, v in asset_events.items() if k.startswith("mistral_finetune/enriched/20260102/")]
    assert enriched["rows_out"] == got["enriched"].counts["out"] and enriched["rows_in"] == sample_rows()
    [ready] = [v for k, v in asset_events.items() if k.startswith("mistral_finetune/train_ready/20260102/")]
    assert ready["rows_out"] == got["train_ready"].counts["out"] and ready["tokens"]["train"] > 0
    assert asset_events["mistral_finetune/model"]["model_uri"] == got["model"]

    # OpenLineage: each stage's complete event names its inputs and outputs
    complete = {}
    for line in events.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("eventType") == "COMPLETE" and ev["job"]["name"].startswith(f"{DAG_ID}."):
            complete[ev["job"]["name"].split(".", 1)[1]] = ev
    path = lambda uri: uris.to_local_path(uri).as_posix()  # noqa: E731
    io = {t: ([d["name"] for d in complete[t]["inputs"]], [d["name"] for d in complete[t]["outputs"]])
          for t in ("enrich", "filter", "data_report", "train")}
    assert io["enrich"] == ([path(plan.source_uri)], [path(plan.enriched_uri)])
    [report] = io["data_report"][1]
    assert io["data_report"][0] == [path(plan.train_ready_uri)] and "/report/" in report
    assert io["filter"] == ([path(plan.enriched_uri)], [path(plan.train_ready_uri)])
    assert io["train"] == ([path(plan.train_ready_uri)], [path(plan.model_uri)])
    stats = complete["filter"]["outputs"][0]["outputFacets"]["outputStatistics"]
    assert stats["rowCount"] == got["train_ready"].counts["out"]


def test_dags_test_s3_store_and_rerun_reuses_artifacts(home, tmp_path, s3_server, s3_bucket_uri):
    s3_env = {**s3_server.env, "MFT__STORAGE__MAX_ATTEMPTS": "3"}
    store = f"{s3_bucket_uri}/mft"
    conf = {**TINY, "dataset_version": "s3-e2e", "run_id": "s3-run", "splits": ["chat", "math"],
            "config_overrides": TINY_OVERRIDES}
    s3_env.update(roots_env(tmp_path, store))
    dags_test(home, conf, "2026-01-03", s3_env)
    got = check_pipeline_output(store, s3_server.storage, "s3-e2e", rows=sample_rows(("chat", "math")))
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket_uri[5:])["Contents"]}
    assert "mft/models/LATEST" in keys and "mft/runs/s3-run/model/_manifest.json" in keys
    assert any(k.startswith("mft/runs/s3-run/checkpoints/step-") for k in keys)

    # the same dataset version (and run) again: every stage finds its committed artifact
    _, out, finished = dags_test(home, conf, "2026-01-04", s3_env)
    for stage in ("enrich: artifact", "filter: artifact", "train: model"):
        assert re.search(rf"{stage} \S+ is already committed; nothing to do", out), f"{stage} was not reused"
    for key in ("enriched", "train_ready"):
        again = read_manifest(got[key].uri, s3_server.storage)
        assert again.sha256 == got[key].sha256 and again.created_at == got[key].created_at
    assert task_states(home, finished.group(1))["publish"] == "success"
