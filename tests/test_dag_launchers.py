"""The launchers render the right specs, checked on the real operator objects (no Docker engine or
cluster exists here): image, command, GPU requests, volumes, shm, and credentials never in plain
text. The Spark stages render the spark-submit command of the `spark_default` connection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline_core import uris
from plugins.mft_airflow.operators import SparkStageOperator, TrainOperator
from plugins.mft_airflow.plan import resolve_plan
from plugins.mft_airflow.settings import load_settings

SECRET = "wJalrXUtnFEMI-not-a-real-secret"
KEY_ID = "AKIAEXAMPLEKEYID"


@pytest.fixture
def plan(tmp_path):
    params = {"dataset_version": "v1", "run_id": "r1", "launcher": "docker", "stages": ["enrich", "filter", "train"],
              "config_overrides": {"pipeline.store_uri": "s3://models-bucket/mft",
                                   "pipeline.staging_uri": uris.qualify(tmp_path / "staging"),
                                   "storage.endpoint_url": "http://minio:9000"}}
    return resolve_plan(params, dag_id="mistral_finetune", airflow_run_id="manual__x", run_date=None, env={})


@pytest.fixture
def creds(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)


def _train_op(**settings):
    return TrainOperator(task_id="train", settings=load_settings(env={}, **settings))


def _expected_command(plan, nproc):
    return ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m", "training.train",
            "--input", plan["train_ready_uri"], "--output", plan["run_uri"], "--config", plan["config_file"]]


def test_docker_launcher_spec(plan, creds):
    from airflow.providers.docker.operators.docker import DockerOperator

    op = _train_op(image="registry.example/mft:1.2", gpus=4, shm_size_gb=32, docker_network="mft").build_launcher(plan)
    assert isinstance(op, DockerOperator)
    assert op.image == "registry.example/mft:1.2"
    assert op.command == _expected_command(plan, 4)
    [gpu] = op.device_requests
    assert gpu["Count"] == 4 and gpu["Capabilities"] == [["gpu"]]
    assert op.shm_size == 32 * 1024**3 and op.network_mode == "mft"
    staging = str(Path(plan["config_file"]).parents[3])
    assert [(m["Source"], m["Target"], m["Type"]) for m in op.mounts] == [(staging, staging, "bind")]
    assert Path(plan["config_file"]).is_relative_to(op.mounts[0]["Target"])  # the config file is visible inside
    # credentials: only in private_environment, which is neither templated nor rendered in the UI
    assert op._private_environment == {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
    assert "private_environment" not in op.template_fields
    public = json.dumps({f: getattr(op, f) for f in op.template_fields}, default=str) + json.dumps(op.environment)
    assert SECRET not in public and KEY_ID not in public
    assert op.auto_remove == "success"


def test_docker_launcher_takes_credentials_from_the_airflow_connection(plan, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_MFT_S3", json.dumps({"conn_type": "aws", "login": KEY_ID, "password": SECRET}))
    cfg = Path(plan["config_file"])
    cfg.write_text(cfg.read_text().replace("aws_conn_id: null", "aws_conn_id: mft_s3"))
    op = _train_op(gpus=2).build_launcher(plan)
    assert op._private_environment["AWS_SECRET_ACCESS_KEY"] == SECRET
    # the container has no Airflow connection: it is told to use the environment instead
    assert op.environment["MFT__STORAGE__AWS_CONN_ID"] == ""
    assert SECRET not in json.dumps(op.environment)


def test_docker_launcher_mounts_a_local_store(tmp_path):
    params = {"dataset_version": "v1", "run_id": "r1", "launcher": "docker",
              "config_overrides": {"pipeline.store_uri": uris.qualify(tmp_path / "store"),
                                   "pipeline.staging_uri": uris.qualify(tmp_path / "staging")}}
    plan = resolve_plan(params, dag_id="d", airflow_run_id="manual__x", run_date=None, env={})
    op = _train_op(gpus=0, shared_volume="/srv/mft-staging", local_nproc_per_node=2).build_launcher(plan)
    assert op.device_requests is None and op._private_environment == {}
    assert "--nproc_per_node=2" in op.command  # CPU ranks when the container has no GPU
    targets = {m["Target"]: m["Source"] for m in op.mounts}
    assert targets == {str(tmp_path / "staging"): "/srv/mft-staging", str(tmp_path / "store"): str(tmp_path / "store")}


def test_kubernetes_launcher_pod_spec(plan, creds):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    settings = dict(image="registry.example/mft:1.2", gpus=8, namespace="ml", staging_pvc="mft-staging",
                    s3_secret="mft-s3", node_selector={"gpu": "h100"}, service_account="trainer",
                    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    op = _train_op(**settings).build_launcher({**plan, "launcher": "kubernetes"})
    assert isinstance(op, KubernetesPodOperator)
    pod = op.build_pod_request_obj(context=None, dry_run=True)  # dry run: no cluster to ask
    [c] = pod.spec.containers
    assert pod.metadata.namespace == "ml" and c.image == "registry.example/mft:1.2"
    assert c.command + c.args == _expected_command(plan, 8)
    assert c.resources.limits == {"nvidia.com/gpu": "8"} and c.resources.requests == {"nvidia.com/gpu": "8"}
    assert pod.spec.node_selector == {"gpu": "h100"} and pod.spec.service_account_name == "trainer"
    assert pod.spec.tolerations[0].key == "nvidia.com/gpu"
    vols = {v.name: v for v in pod.spec.volumes}
    assert vols["staging"].persistent_volume_claim.claim_name == "mft-staging"
    assert vols["dshm"].empty_dir.medium == "Memory"
    mounts = {m.name: m.mount_path for m in c.volume_mounts}
    assert mounts["dshm"] == "/dev/shm" and Path(plan["config_file"]).is_relative_to(mounts["staging"])
    # credentials come from the Secret, by reference; no value in the pod spec
    assert [e.secret_ref.name for e in c.env_from] == ["mft-s3"]
    spec = json.dumps(pod.to_dict(), default=str)
    assert SECRET not in spec and KEY_ID not in spec


def test_kubernetes_launcher_refuses_a_connection_it_cannot_pass(plan):
    cfg = Path(plan["config_file"])
    cfg.write_text(cfg.read_text().replace("aws_conn_id: null", "aws_conn_id: mft_s3"))
    with pytest.raises(ValueError, match="MFT_DEPLOY__S3_SECRET"):
        _train_op(gpus=1).build_launcher({**plan, "launcher": "kubernetes"})


def test_local_launcher_runs_torchrun_from_the_workers_interpreter(plan):
    import sys

    proc = _train_op(local_nproc_per_node=2).build_launcher({**plan, "launcher": "local"})
    assert proc.command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert proc.command[3:] == _expected_command(plan, 2)[1:]
    assert not any(k.startswith("MFT__") for k in proc.env)


def test_spark_stage_renders_spark_submit_on_spark_default(plan, monkeypatch):
    import sys

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    op = SparkStageOperator(task_id="enrich", stage="enrich", application="enrich.py", input_key="source_uri",
                            output_key="enriched_uri",
                            settings=load_settings(env={}, spark_executor_memory="4g", spark_py_files="/opt/mft.zip"))
    submit = op.build_submit(plan)
    cmd = submit._get_hook()._build_spark_submit_command(submit.application)
    assert cmd[0] == "spark-submit"
    assert cmd[cmd.index("--master") + 1] == "local[2]"
    assert f"spark.pyspark.python={sys.executable}" in cmd
    assert cmd[cmd.index("--executor-memory") + 1] == "4g" and cmd[cmd.index("--py-files") + 1] == "/opt/mft.zip"
    assert cmd[-7:] == [submit.application, "--input", plan["source_uri"], "--output", plan["enriched_uri"],
                        "--config", plan["config_file"]]
    assert submit.application.endswith("spark_jobs/enrich.py")
