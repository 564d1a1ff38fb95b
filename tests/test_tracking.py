"""MLflow tracking (issue 31.4) against a real `mlflow server` on loopback.

The product depends on the client only (`mlflow-skinny`); the server package pins pyarrow<26, below
the project's lock, so the fixture builds it once into its own venv (.cache/mlflow-server-venv) and
runs it with a SQLite backend and a local artifact root in tmp."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline_core import layout, uris
from pipeline_core.config import load_config

REPO = Path(__file__).resolve().parents[1]
SERVER_VENV = REPO / ".cache" / "mlflow-server-venv"
MLFLOW_SERVER = "mlflow==3.17.2"  # the server matching the client pinned in requirements/lock.txt


def _server_bin() -> Path:
    mlflow = SERVER_VENV / "bin" / "mlflow"
    if mlflow.exists():
        return mlflow
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(SERVER_VENV)], check=True)
    pip = subprocess.run([str(SERVER_VENV / "bin" / "pip"), "install", "-q", MLFLOW_SERVER],
                         capture_output=True, text=True, timeout=900)
    if pip.returncode != 0:
        out = pip.stdout + pip.stderr
        if any(s in out for s in ("Could not find a version", "No matching distribution", "connection",
                                  "Network is unreachable", "Temporary failure in name resolution")):
            pytest.skip(f"cannot install {MLFLOW_SERVER} into {SERVER_VENV} (package index unreachable): {out[-500:]}")
        raise RuntimeError(f"pip install {MLFLOW_SERVER} failed:\n{out[-3000:]}")
    return mlflow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path):
        self.root, self.port = root, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        self.log = (root / "server.log").open("w")
        self.proc = subprocess.Popen(
            [str(_server_bin()), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--default-artifact-root", uris.qualify(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # the server and its uvicorn worker (its own session)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _run_of(client, run_id: str, experiment: str = "mistral-finetune"):
    from training.tracking import RUN_TAG

    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'")
    assert len(runs) == 1, runs
    return runs[0]


def _tracking(uri: str, **kw):
    return {"tracking.mlflow_uri": uri, "tracking.backoff_s": 0.2, "tracking.max_attempts": 3,
            "tracking.request_timeout_s": 5, **kw}


# ------------------------------------------------------------------ a real training run, then promotion
@pytest.mark.slow
def test_a_training_run_and_its_promotion_are_in_mlflow(mlflow_server, tmp_path, local_store_uri):
    from pipeline_core.artifacts import read_manifest
    from pipeline_core.pointers import read_pointer
    from tests.training_helpers import make_tiny_model, sample_train_ready
    from training.launch import process_env, standalone_argv
    from training.promote import promote

    steps = 4
    model_dir = make_tiny_model(tmp_path / "tiny", hidden_size=32, intermediate_size=64)
    input_uri = sample_train_ready(local_store_uri, tmp_path / "ready", seq_len=128)
    cfg = load_config(overrides={
        "pipeline.store_uri": local_store_uri, "pipeline.staging_uri": uris.qualify(tmp_path / "staging"),
        "train.base_model": str(model_dir), "train.seq_len": 128, "train.micro_batch_size": 2,
        "train.gradient_accumulation_steps": 1, "train.steps": steps, "train.checkpoint_every": steps,
        "train.precision": "fp32", "train.warmup_steps": 1, "train.eval_batches": 1, "train.eval_every": 2,
        "release.registered_model": "tiny-mistral", **_tracking(mlflow_server.uri)})
    run_uri = uris.join(local_store_uri, "runs", "tracked")
    log_path = tmp_path / "train.log"
    with log_path.open("w") as out:
        proc = subprocess.run(standalone_argv(input_uri, run_uri, cfg.dump(tmp_path / "cfg.yaml"), nproc=2),
                              env=process_env({"MFT_CHECKPOINT_HMAC_KEY": "tracking-test-key"}, cpu=True), cwd=REPO,
                              stdout=out, stderr=subprocess.STDOUT, timeout=500)
    assert proc.returncode == 0, log_path.read_text()[-6000:]
    models_uri = uris.join(local_store_uri, "models")
    decision = promote(uris.join(run_uri, "model"), input_uri, models_uri, "0" * 19 + "1", cfg.release,
                       tracking=cfg.tracking)
    assert decision.promoted and read_pointer(models_uri).target == uris.join(run_uri, "model")

    client = _client(mlflow_server.uri)
    run = _run_of(client, "tracked")
    # params: the resolved config, flattened
    assert run.data.params["train.steps"] == str(steps) and run.data.params["tracking.experiment"] == "mistral-finetune"
    # per-step metrics: what MetricsLog wrote (metrics.csv), step for step
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")) == [2, 4]
    assert run.info.status == "FINISHED"  # the trainer ended its MLflow run
    # data manifest as tags
    manifest = read_manifest(input_uri)
    assert run.data.tags["data.train_ready.sha256"] == manifest.sha256
    assert run.data.tags["data.train_ready.uri"] == input_uri
    # promotion: the decision, and the registered version holding the alias
    assert run.data.tags["mft.promotion.promoted"] == "true"
    assert "promotion/candidate_val_loss" in run.data.metrics
    champion = client.get_model_version_by_alias("tiny-mistral", "champion")
    assert champion.run_id == run.info.run_id and champion.tags["mft.model_uri"] == uris.join(run_uri, "model")
    assert "giving up" not in log_path.read_text()


# ------------------------------------------------------------------ champion forward only
def test_champion_never_moves_to_an_older_run(mlflow_server):
    from training.tracking import Tracker

    settings = load_config(overrides=_tracking(mlflow_server.uri)).tracking
    for run_id, key in (("run-new", "00000000000000000020"), ("run-old", "00000000000000000010")):
        t = Tracker(settings, run_id)
        t.register("fwd", f"s3://b/runs/{run_id}/model", key)
        assert t.close()
    client = _client(mlflow_server.uri)
    assert {v.version for v in client.search_model_versions("name = 'fwd'")} == {"1", "2"}  # both registered
    champ = client.get_model_version_by_alias("fwd", "champion")
    assert champ.run_id == _run_of(client, "run-new").info.run_id  # the older run did not take it
    t = Tracker(settings, "run-newest")
    t.register("fwd", "s3://b/runs/run-newest/model", "00000000000000000030")
    assert t.close()
    assert client.get_model_version_by_alias("fwd", "champion").run_id == _run_of(client, "run-newest").info.run_id


def test_eval_scores_and_manifests_are_logged_at_publish(mlflow_server, tmp_path, local_store_uri):
    from pipeline_core.artifacts import publish_artifact
    from pipeline_core.handoffs import BenchmarkResults, MetricScore, TaskScores
    from pipeline_core.pointers import order_key_from_date
    from plugins.mft_airflow.summary import publish_model
    from tests.report_helpers import tiny_models, val_artifact
    from tests.test_dag_operators import _commit
    from training.benchmarks import KIND

    plan = _plan(tmp_path, local_store_uri, "pub1")
    _commit(tmp_path, plan.enriched_uri, "enriched", {"data/a.parquet": b"e"},
            {"in": 10, "out": 8, "rejected": {"empty_answer": 2}})
    val_artifact(tmp_path / "tr", plan.train_ready_uri, inputs=[plan.enriched_uri])
    publish_artifact(tiny_models(tmp_path / "models")["good"], plan.model_uri, kind="model",
                     inputs=[plan.train_ready_uri])
    scores = BenchmarkResults(model_uri=plan.model_uri, model_manifest_sha256="m", harness_version="test", tasks=(TaskScores(
        task="tiny_qa", num_fewshot=0, samples=16, metrics={"acc,none": MetricScore(value=0.375, stderr=0.1)}),))
    _commit(tmp_path, layout.eval_uri(plan.run_uri), KIND, {"data/results.json": b"{}"}, extra=scores.to_extra())
    cfg = load_config(overrides=_tracking(mlflow_server.uri, **{"release.registered_model": "published"}))
    from datetime import UTC, datetime

    s = publish_model(plan, None, order_key_from_date(datetime(2026, 1, 1, tzinfo=UTC)), cfg.release, cfg.tracking)
    assert s.promotion.promoted
    client = _client(mlflow_server.uri)
    run = _run_of(client, "pub1")
    assert run.data.metrics["eval/tiny_qa/acc_none"] == pytest.approx(0.375)
    assert run.data.tags["data.enriched.in"] == "10" and run.data.tags["data.enriched.rejected.empty_answer"] == "2"
    assert client.get_model_version_by_alias("published", "champion").tags["mft.model_uri"] == plan.model_uri


# ------------------------------------------------------------------ a stopped server
def test_a_stopped_server_leaves_training_and_publish_unaffected(tmp_path, local_store_uri, caplog):
    from datetime import UTC, datetime

    from pipeline_core.artifacts import publish_artifact
    from pipeline_core.pointers import order_key_from_date, read_pointer
    from plugins.mft_airflow.summary import publish_model
    from tests.report_helpers import tiny_models, val_artifact
    from training.metrics import MetricsLog
    from training.tracking import Tracker

    server = MlflowServer(tmp_path / "mlflow")
    uri = server.uri
    server.stop()  # killed: the port refuses connections
    cfg = load_config(overrides=_tracking(uri, **{"tracking.max_attempts": 2, "tracking.flush_timeout_s": 30}))
    caplog.set_level(logging.INFO, logger="training.tracking")

    # training: a step's metrics row never waits on the server
    tracker = Tracker(cfg.tracking, "dead-train")
    metrics = MetricsLog(tmp_path / "report" / "metrics.csv", None, tracker)
    t0 = time.time()
    for step in range(1, 6):
        metrics.add({"step": step, "loss": 1.0 / step, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 1.0,
                     "step_time_s": 0.1, "target_tokens": 10, "skipped": 0})
    assert time.time() - t0 < 1.0  # queued, not sent inline
    assert len(metrics.rows) == 5 and (tmp_path / "report" / "metrics.csv").read_text().count("\n") == 6
    assert tracker.close() is False and tracker.failures == 5

    # publish: promoted and LATEST moved as without tracking
    plan = _plan(tmp_path, local_store_uri, "dead1")
    val_artifact(tmp_path / "tr", plan.train_ready_uri)
    publish_artifact(tiny_models(tmp_path / "models")["good"], plan.model_uri, kind="model",
                     inputs=[plan.train_ready_uri])
    s = publish_model(plan, None, order_key_from_date(datetime(2026, 1, 1, tzinfo=UTC)), cfg.release, cfg.tracking)
    assert s.promotion.promoted and read_pointer(plan.models_uri).target == plan.model_uri
    gave_up = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
    assert gave_up and all(uri in m for m in gave_up), json.dumps([r.getMessage() for r in caplog.records])[-2000:]


def _plan(tmp_path, store_uri: str, run_id: str):
    from plugins.mft_airflow.plan import resolve_plan
    from tests.test_dag_params import deployment_env

    env = deployment_env({"pipeline.store_uri": store_uri, "pipeline.staging_uri": uris.qualify(tmp_path / "staging")})
    return resolve_plan({"dataset_version": "v1", "run_id": run_id}, dag_id="mistral_finetune",
                        airflow_run_id=f"manual__{run_id}", run_date=None, env=env)


def test_the_demo_default_sqlite_store_needs_no_server(tmp_path):
    """`make demo` logs straight into sqlite:///.store/mlflow/mlflow.db through the client package."""
    from training.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(overrides=_tracking(uri))
    t = Tracker(cfg.tracking, "demo-run")
    t.log_config(cfg)
    t.log_step({"step": 1, "loss": 2.5, "lr": 1e-4, "skipped": 0})
    t.register("demo", uris.qualify(tmp_path / "runs" / "demo-run" / "model"), "0" * 20)
    assert t.close() and t.failures == 0
    client = _client(uri)
    run = _run_of(client, "demo-run")
    assert run.data.params["tracking.mlflow_uri"] == uri and run.data.metrics["train/loss"] == 2.5
    assert client.get_model_version_by_alias("demo", "champion").source == f"runs:/{run.info.run_id}/model"
