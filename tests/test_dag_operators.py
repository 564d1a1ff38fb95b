"""The operators' own decisions, without a scheduler: committed artifacts are reused (nothing is
launched), left-out stages skip, a run id is never silently reused for other data, and publishing
checks the model's files before `models/LATEST` moves."""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import AssetAlias
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from pipeline_core import uris
from pipeline_core.artifacts import CorruptArtifact, publish_artifact, read_latest
from pipeline_core.handoffs import StageCounts
from pipeline_core.run_records import RunSummary
from plugins.mft_airflow.operators import SparkStageOperator, StageResult, TrainOperator
from plugins.mft_airflow.plan import resolve_plan
from plugins.mft_airflow.settings import load_settings
from plugins.mft_airflow.summary import format_summary, latest_summary, newest_summary, publish_model
from tests.dag_helpers import task_context
from tests.test_dag_params import deployment_env


@pytest.fixture
def plan(tmp_path, local_store_uri):
    env = deployment_env({"pipeline.store_uri": local_store_uri, "pipeline.staging_uri": uris.qualify(tmp_path / "staging")})
    return resolve_plan({"dataset_version": "v1", "run_id": "r1"}, dag_id="mistral_finetune",
                        airflow_run_id="manual__x", run_date=None, env=env)


def _commit(tmp_path, uri, kind, files: dict[str, bytes], counts=None, inputs=(), extra=None):
    d = tmp_path / f"art-{abs(hash(uri))}"
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return publish_artifact(d, uri, kind=kind, counts=counts or {}, inputs=list(inputs), extra=extra)


def _enrich_op():
    return SparkStageOperator(task_id="enrich", stage="enrich", application="enrich/job.py", input_field="source_uri",
                              output_field="enriched_uri", settings=load_settings(env={}),
                              outlets=[AssetAlias("mistral_finetune/enriched")])


def test_committed_artifact_is_reused_without_spark(plan, tmp_path, monkeypatch):
    counts = {"in": 3, "out": 2, "rejected": {"empty_answer": 1}}
    _commit(tmp_path, plan.enriched_uri, "enriched", {"data/part-0.parquet": b"x"}, counts)
    op = _enrich_op()
    monkeypatch.setattr(SparkSubmitOperator, "execute", lambda self, ctx: pytest.fail("spark-submit must not run"))
    ctx = task_context(plan)
    result = op.execute(ctx)
    assert result["reused"] is True and result["counts"] == counts
    # the XCom is JSON with the manifest's keys; the model reads it back typed
    assert StageResult.read(json.loads(json.dumps(result))).counts == StageCounts(rows_in=3, rows_out=2,
                                                                                  rejected={"empty_answer": 1})
    [(asset, extra)] = ctx["outlet_events"][AssetAlias("mistral_finetune/enriched")].added
    assert asset.uri == plan.enriched_uri and extra["dataset_version"] == "v1"
    assert (extra["rows_in"], extra["rows_out"], extra["rows_rejected"]) == (3, 2, 1)
    # lineage of the reused artifact: input and output datasets from the plan, with row counts
    ol = op.get_openlineage_facets_on_complete(None)
    assert [(d.namespace, d.name) for d in ol.inputs] == [("file", uris.to_local_path(plan.source_uri).as_posix())]
    [out] = ol.outputs
    assert out.name == uris.to_local_path(plan.enriched_uri).as_posix()
    assert out.outputFacets["outputStatistics"].rowCount == 2


def test_spark_stage_is_the_providers_operator_and_runs_its_execute(plan, tmp_path, monkeypatch):
    """No nested operator: the stage's own (provider) execute submits, then the manifest is read."""
    op = _enrich_op()
    assert isinstance(op, SparkSubmitOperator)
    calls = []

    def fake_submit(self, ctx):  # what spark-submit would leave behind: a committed artifact
        calls.append(self)
        _commit(tmp_path, plan.enriched_uri, "enriched", {"data/p.parquet": b"y"}, {"in": 1, "out": 1})

    monkeypatch.setattr(SparkSubmitOperator, "execute", fake_submit)
    result = op.execute(task_context(plan))
    assert calls == [op] and result["reused"] is False and result["counts"]["out"] == 1


def test_stage_not_selected_is_skipped(plan):
    with pytest.raises(AirflowSkipException):
        _enrich_op().execute(task_context(plan.model_copy(update={"stages": ("filter", "train")})))
    with pytest.raises(AirflowSkipException):
        TrainOperator(task_id="train", settings=load_settings(env={})).execute(
            task_context(plan.model_copy(update={"stages": ("enrich",)})))


def test_a_run_id_is_not_reused_for_other_data(plan, tmp_path):
    other = uris.join(plan.store_uri, "datasets", "v0", "train", "abc")
    _commit(tmp_path, other, "train-ready", {"data/train/p.parquet": b"t"})
    _commit(tmp_path, plan.model_uri, "model", {"data/model.safetensors": b"m"}, inputs=[other])
    op = TrainOperator(task_id="train", settings=load_settings(env={}))
    with pytest.raises(AirflowFailException, match="run_id: run r1 already has a model trained on"):
        op.execute(task_context(plan))
    # the same data: the committed model is the answer, nothing is launched
    _commit(tmp_path, plan.train_ready_uri, "train-ready", {"data/train/p.parquet": b"t2"})
    plan2 = plan.model_copy(update={"model_uri": uris.join(plan.store_uri, "runs", "r2", "model")})
    _commit(tmp_path, plan2.model_uri, "model", {"data/model.safetensors": b"m2"}, inputs=[plan.train_ready_uri])
    assert op.execute(task_context(plan2))["reused"] is True


def test_publish_reports_losses_and_moves_latest_last(plan, tmp_path):
    from pipeline_core.pointers import order_key_from_date, read_pointer
    from tests.report_helpers import tiny_models, val_artifact

    _commit(tmp_path, plan.enriched_uri, "enriched", {"data/a.parquet": b"e"},
            {"in": 10, "out": 8, "rejected": {"empty_answer": 2}})
    val_artifact(tmp_path / "tr", plan.train_ready_uri, inputs=[plan.enriched_uri])
    model = publish_artifact(tiny_models(tmp_path / "models")["good"], plan.model_uri, kind="model",
                             inputs=[plan.train_ready_uri])
    _commit(tmp_path, uris.join(plan.run_uri, "report"), "report",
            {"report/metrics.csv": b"step,loss,lr\n1,10.5,0.001\n2,9.25,0.001\n"},
            extra={"eval_loss": 9.0, "eval_perplexity": 8103.1})
    s = publish_model(plan, None, order_key_from_date(datetime(2026, 1, 1, tzinfo=UTC)))
    assert s.train.loss_start == 10.5 and s.train.loss_end == 9.25 and s.train.eval_loss == 9.0
    assert s.enrich.counts.rejected == {"empty_answer": 2} and s.model.files == len(model.files)
    assert s.promotion.promoted and s.promotion.current_val_loss is None
    # the stored summary and the publish XCom are its JSON, read back as the same model
    assert RunSummary.read(json.loads(json.dumps(s.to_json_dict()))) == s
    assert read_pointer(plan.models_uri).target == plan.model_uri == read_latest(plan.models_uri)
    text = format_summary(latest_summary(plan.store_uri, None))
    assert "loss start 10.5000" in text and "-> end 9.2500" in text and plan.model_uri in text
    assert "promote PROMOTED" in text
    assert newest_summary(plan.store_uri, None).run_id == plan.run_id  # the same run, found by listing
    with pytest.raises(Exception, match="no published dpo run"):
        newest_summary(plan.store_uri, None, "dpo")


def test_the_summary_shows_a_dpo_runs_reward_metrics(plan, tmp_path):
    """`make demo`'s DPO section: the train pair metrics at step 1, at each validation step and at the
    last step beside every validation's, from metrics.csv and eval.csv, and val accuracy first -> last."""
    from plugins.mft_airflow.summary import _fmt_dpo, _losses

    cols = "pairs,dpo_loss,reward_accuracy,chosen_reward,rejected_reward,reward_margin"
    _commit(tmp_path, uris.join(plan.run_uri, "report"), "report", {
        "report/metrics.csv": f"step,loss,lr,{cols}\n1,0.69,0,4,0.69,0.25,0,0,0.0\n2,0.5,1,4,0.5,0.5,0.1,0,0.1\n"
                              "3,0.4,1,4,0.4,0.75,0.5,-0.4,0.9\n".encode(),
        "report/eval.csv": ("step,eval_loss,eval_perplexity," + ",".join(f"eval_{c}" for c in cols.split(","))
                            + "\n2,0.6,,6,0.6,0.5,0.05,0,0.05\n3,0.45,,6,0.45,0.8333,0.3,-0.2,0.5\n").encode()},
        extra={"eval_reward_accuracy": 0.8333})
    d = _losses(uris.join(plan.run_uri, "report"), None)["dpo"]
    assert [(r.step, r.reward_accuracy, r.reward_margin) for r in d.train] == [
        (1, 0.25, 0.0), (2, 0.5, 0.1), (3, 0.75, 0.9)]
    assert [(r.step, r.pairs, r.loss, r.reward_accuracy, r.chosen_reward, r.rejected_reward)
            for r in d.val] == [(2, 6, 0.6, 0.5, 0.05, 0.0), (3, 6, 0.45, 0.8333, 0.3, -0.2)]
    text = "\n".join(_fmt_dpo(d))
    assert "0.500 at step 2, 0.833 at step 3 (6 pairs); margin 0.0500 -> 0.5000, loss 0.6000 -> 0.4500" in text
    assert "      3 |  0.4000  0.75   0.5000  -0.4000   0.9000 |  0.4500  0.83   0.3000  -0.2000   0.5000" in text


def test_publish_refuses_a_model_with_a_missing_file(plan, tmp_path):
    model = _commit(tmp_path, plan.model_uri, "model", {"data/model.safetensors": b"weights"})
    uris.to_local_path(uris.join(plan.model_uri, model.object_path("data/model.safetensors"))).unlink()
    with pytest.raises(CorruptArtifact, match="model.safetensors"):
        publish_model(plan, None, "0" * 20)
    assert read_latest(plan.models_uri) is None


def test_local_launcher_is_killed_with_its_task(tmp_path):
    import logging
    import sys
    import threading
    import time

    from plugins.mft_airflow.launchers import LocalTrainProcess

    # a "trainer" that ignores nothing and prints until stopped
    script = "import time\nprint('started', flush=True)\nwhile True: time.sleep(0.1)\n"
    proc = LocalTrainProcess([sys.executable, "-c", script], env={}, cwd=str(tmp_path), log=logging.getLogger("t"))
    errors = []
    t = threading.Thread(target=lambda: _capture(proc.execute, errors))
    t.start()
    deadline = time.time() + 30
    while proc._proc is None and time.time() < deadline:
        time.sleep(0.05)
    proc.on_kill(grace_s=10)
    t.join(30)
    assert not t.is_alive() and proc._proc.returncode != 0
    assert errors and "training exited with status" in str(errors[0])


def _capture(fn, errors):
    try:
        fn()
    except Exception as e:  # the launcher reports the non-zero exit as a task failure
        errors.append(e)


# A "trainer" like torchrun: its rank runs in a session of its own (so a process-group kill misses
# it) and ignores SIGTERM; both write their pids, then run until killed.
TRAINER = r"""
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c",
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(os.environ['PIDS'] + '.rank', 'w').write(str(os.getpid())); time.sleep(3600)"], start_new_session=True)
open(os.environ["PIDS"] + ".agent", "w").write(str(os.getpid()))
print("started", flush=True)
time.sleep(3600)
"""

# The Airflow task process: starts the launcher, then is SIGKILLed (no on_kill runs).
TASK = r"""
import logging, sys
from plugins.mft_airflow.launchers import LocalTrainProcess
LocalTrainProcess([sys.executable, "-c", sys.argv[1]], env={"PIDS": sys.argv[2], "PATH": "/usr/bin:/bin"},
                  cwd=".", log=logging.getLogger("t"), grace_s=2).execute()
"""


def _alive(pid: int) -> bool:
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    finally:
        os.sched_yield()


def test_the_trainer_tree_dies_with_a_sigkilled_task(tmp_path):
    """Seen on a GPU: after the launcher was SIGKILLed, an orphaned rank kept training and pushing
    checkpoints. The watchdog (child subreaper + parent-death signal) ends every descendant."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    pids = tmp_path / "pids"
    task = subprocess.Popen([sys.executable, "-c", TASK, TRAINER, str(pids)], cwd=REPO,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    deadline = time.time() + 60
    while not (Path(f"{pids}.rank").exists() and Path(f"{pids}.agent").exists()) and time.time() < deadline:
        time.sleep(0.1)
    agent, rank = int(Path(f"{pids}.agent").read_text()), int(Path(f"{pids}.rank").read_text())
    assert _alive(agent) and _alive(rank)
    task.send_signal(signal.SIGKILL)
    task.wait(30)
    deadline = time.time() + 30
    while (_alive(agent) or _alive(rank)) and time.time() < deadline:
        time.sleep(0.2)
    survivors = [p for p in (agent, rank) if _alive(p)]
    for p in survivors:  # never leave them behind, whatever the outcome
        os.kill(p, signal.SIGKILL)
    assert not survivors, "the trainer outlived its SIGKILLed task"


def test_on_kill_ends_ranks_that_ignore_sigterm(tmp_path, monkeypatch):
    import logging
    import threading
    import time

    from plugins.mft_airflow.launchers import LocalTrainProcess

    pids = tmp_path / "pids"
    proc = LocalTrainProcess([sys.executable, "-c", TRAINER], env={"PIDS": str(pids), "PATH": "/usr/bin:/bin"},
                             cwd=str(tmp_path), log=logging.getLogger("t"), grace_s=2)
    errors = []
    t = threading.Thread(target=lambda: _capture(proc.execute, errors))
    t.start()
    deadline = time.time() + 60
    while not Path(f"{pids}.rank").exists() and time.time() < deadline:
        time.sleep(0.1)
    rank = int(Path(f"{pids}.rank").read_text())
    proc.on_kill()
    t.join(60)
    assert not t.is_alive() and errors
    deadline = time.time() + 10
    while _alive(rank) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(rank), "a rank in its own session survived on_kill"
