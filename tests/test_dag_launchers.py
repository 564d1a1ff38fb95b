"""The train and Spark operators render the right specs, checked on the real operator objects with
their templates rendered against a real plan (no Docker engine or cluster exists here): image,
command, GPU/CPU/memory requests, volumes, shm, multi-node rendezvous, deterministic names, and
credentials never in plain container config."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline_core import uris
from plugins.mft_airflow.launchers import local_env
from plugins.mft_airflow.operators import SparkStageOperator, TrainOperator, train_operator
from plugins.mft_airflow.plan import load_plan_config, resolve_plan
from plugins.mft_airflow.settings import load_settings
from tests.test_dag_params import deployment_env

SECRET = "wJalrXUtnFEMI-not-a-real-secret"
KEY_ID = "AKIAEXAMPLEKEYID"


class FakeTI:
    def __init__(self, plan):
        self.plan = plan

    def xcom_pull(self, task_ids):
        assert task_ids == "resolve"
        return self.plan


def rendered(op, plan):
    """The operator with its template fields rendered as the task runner does before execute."""
    op.render_template_fields({"ti": FakeTI(plan)})
    return op


@pytest.fixture
def s3_env(tmp_path):
    return {**deployment_env({"pipeline.store_uri": "s3://models-bucket/mft",
                              "pipeline.staging_uri": uris.qualify(tmp_path / "staging")}),
            "MFT__STORAGE__ENDPOINT_URL": "http://minio:9000"}


@pytest.fixture
def plan(s3_env):
    return resolve_plan({"dataset_version": "v1", "run_id": "r1"}, dag_id="mistral_finetune",
                        airflow_run_id="manual__x", run_date=None, env=s3_env)


@pytest.fixture
def creds(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)


def _train_op(**settings):
    return train_operator(load_settings(env={}, **settings), task_id="train")


def _trainer_args(plan):
    return ["-m", "training.train", "--input", plan.train_ready_uri, "--output", plan.run_uri,
            "--config", plan.config_file]


def _prepared(op, plan):
    op = rendered(op, plan)
    op._plan = plan
    op.prepare(load_plan_config(plan))
    return op


def test_docker_launcher_spec(plan, creds):
    from airflow.providers.docker.operators.docker import DockerOperator

    op = _prepared(_train_op(launcher="docker", image="registry.example/mft:1.2", gpus=4, shm_size_gb=32,
                             docker_network="mft"), plan)
    assert isinstance(op, DockerOperator)
    assert op.image == "registry.example/mft:1.2"
    assert op.command == ["torchrun", "--standalone", "--nproc-per-node=4", *_trainer_args(plan)]
    assert op.container_name == plan.trainer_name == "mft-train-r1"  # deterministic: a retry finds it
    [gpu] = op.device_requests
    assert gpu["Count"] == 4 and gpu["Capabilities"] == [["gpu"]]
    assert op.shm_size == 32 * 1024**3 and op.network_mode == "mft"
    staging = str(Path(plan.config_file).parents[3])
    mounts = {m["Target"]: m for m in op.mounts}
    assert (mounts[staging]["Source"], mounts[staging]["Type"]) == (staging, "bind")
    assert Path(plan.config_file).is_relative_to(staging)  # the config file is visible inside
    # credentials: a read-only mounted file (a Docker secret), not the container's environment or config
    secret = mounts["/run/secrets/aws_credentials"]
    assert secret["ReadOnly"] is True and op.environment["AWS_SHARED_CREDENTIALS_FILE"] == "/run/secrets/aws_credentials"
    assert SECRET in Path(secret["Source"]).read_text() and oct(os.stat(secret["Source"]).st_mode & 0o777) == "0o600"
    assert op._private_environment == {}
    public = json.dumps({f: getattr(op, f) for f in op.template_fields}, default=str) + json.dumps(op.environment)
    assert SECRET not in public and KEY_ID not in public
    assert op.auto_remove == "force"  # failed containers are removed too, after their logs were streamed
    assert op.environment["HF_HUB_OFFLINE"] == "1" and op.environment["HF_HOME"].startswith(staging)
    op._remove_secret()
    assert not Path(secret["Source"]).exists()


def test_docker_launcher_uses_the_deployments_secret_file(plan, creds, tmp_path):
    op = _prepared(_train_op(launcher="docker", credentials_file="/run/secrets/mft_s3"), plan)
    [secret] = [m for m in op.mounts if m["Target"] == "/run/secrets/aws_credentials"]
    assert secret["Source"] == "/run/secrets/mft_s3" and op._secret_file is None


def test_docker_launcher_takes_credentials_from_the_airflow_connection(plan, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_MFT_S3", json.dumps({"conn_type": "aws", "login": KEY_ID, "password": SECRET}))
    cfg = Path(plan.config_file)
    cfg.write_text(cfg.read_text().replace("aws_conn_id: null", "aws_conn_id: mft_s3"))
    op = _prepared(_train_op(launcher="docker", gpus=2), plan)
    assert SECRET in op._secret_file.read_text()
    # the container has no Airflow connection: it is told to use its credentials file instead
    assert op.environment["MFT__STORAGE__AWS_CONN_ID"] == ""
    assert SECRET not in json.dumps(op.environment)
    op._remove_secret()


def test_docker_launcher_mounts_a_local_store(tmp_path):
    env = deployment_env({"pipeline.store_uri": uris.qualify(tmp_path / "store"),
                          "pipeline.staging_uri": uris.qualify(tmp_path / "staging")})
    plan = resolve_plan({"dataset_version": "v1", "run_id": "r1"}, dag_id="d", airflow_run_id="manual__x",
                        run_date=None, env=env)
    op = _prepared(_train_op(launcher="docker", gpus=0, shared_volume="/srv/mft-staging", local_nproc_per_node=2),
                   plan)
    assert op.device_requests is None and op._private_environment == {}
    assert "--nproc-per-node=2" in op.command  # CPU ranks when the container has no GPU
    targets = {m["Target"]: m["Source"] for m in op.mounts}
    assert targets == {str(tmp_path / "staging"): "/srv/mft-staging", str(tmp_path / "store"): str(tmp_path / "store")}


def test_docker_node_of_a_rendezvous(plan):
    op = rendered(_train_op(launcher="docker", gpus=8, nnodes=2, node_rank=1, rdzv_endpoint="gpu-node-1:29500"), plan)
    assert op.command == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--node-rank=1", "--rdzv-backend=c10d",
                          "--rdzv-endpoint=gpu-node-1:29500", "--rdzv-id=r1", *_trainer_args(plan)]


def test_kubernetes_launcher_renders_an_indexed_multi_pod_job(plan, creds):
    from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator

    settings = dict(launcher="kubernetes", image="registry.example/mft:1.2", gpus=8, nnodes=4, namespace="ml",
                    staging_pvc="mft-staging", s3_secret="mft-s3", node_selector={"gpu": "h100"},
                    service_account="trainer", cpu_request="32", memory_request="512Gi",
                    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    op = _prepared(_train_op(**settings), plan)
    assert isinstance(op, KubernetesJobOperator) and op.deferrable and op.wait_until_job_complete
    op.__dict__["hook"] = SimpleNamespace(is_in_cluster=False)  # no cluster to ask
    job = op.build_job_request_obj(context=None)
    assert job.metadata.name == "job-mft-train-r1" and job.metadata.namespace == "ml"  # deterministic, no suffix
    assert job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism == 4
    pod = job.spec.template.spec
    [c] = pod.containers
    assert c.image == "registry.example/mft:1.2" and pod.subdomain == "mft-train-r1"
    assert c.command + c.args == [
        "torchrun", "--nnodes=4", "--nproc-per-node=8", "--node-rank=$(JOB_COMPLETION_INDEX)", "--rdzv-backend=c10d",
        "--rdzv-endpoint=job-mft-train-r1-0.mft-train-r1:29500", "--rdzv-id=r1", *_trainer_args(plan)]
    assert c.resources.requests == {"cpu": "32", "memory": "512Gi", "nvidia.com/gpu": "8"}
    assert c.resources.limits == {"nvidia.com/gpu": "8"}
    assert pod.node_selector == {"gpu": "h100"} and pod.service_account_name == "trainer"
    assert pod.tolerations[0].key == "nvidia.com/gpu"
    vols = {v.name: v for v in pod.volumes}
    assert vols["staging"].persistent_volume_claim.claim_name == "mft-staging"  # shared by every node
    assert vols["dshm"].empty_dir.medium == "Memory"
    mounts = {m.name: m.mount_path for m in c.volume_mounts}
    assert mounts["dshm"] == "/dev/shm" and Path(plan.config_file).is_relative_to(mounts["staging"])
    env = {e.name: e.value for e in c.env}
    assert env["HF_HUB_OFFLINE"] == "1" and Path(env["HF_HOME"]).is_relative_to(mounts["staging"])
    # credentials come from the Secret, by reference; no value in the spec
    assert [e.secret_ref.name for e in c.env_from] == ["mft-s3"]
    spec = json.dumps(job.to_dict(), default=str)
    assert SECRET not in spec and KEY_ID not in spec
    svc = op.rendezvous_service()  # headless: <job>-0.<service> is the index-0 pod
    assert svc.spec.cluster_ip == "None" and svc.spec.selector == {"mft-run": "mft-train-r1"}


def test_kubernetes_launcher_refuses_credentials_it_cannot_pass_safely(plan):
    with pytest.raises(ValueError, match="MFT_DEPLOY__S3_SECRET"):
        _prepared(_train_op(launcher="kubernetes", gpus=1), plan)
    with pytest.raises(ValueError, match="MFT_DEPLOY__STAGING_PVC"):
        _prepared(_train_op(launcher="kubernetes", gpus=1, nnodes=2, s3_secret="s"), plan)


def test_multi_node_settings_are_refused_without_a_rendezvous():
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        load_settings(env={}, nnodes=2)
    with pytest.raises(ValueError, match="node_rank=2 must be < nnodes=2"):
        load_settings(env={}, nnodes=2, node_rank=2, rdzv_endpoint="h:1")


def test_local_launcher_runs_torchrun_from_the_workers_interpreter(plan):
    op = rendered(_train_op(local_nproc_per_node=2), plan)
    assert isinstance(op, TrainOperator)
    assert op.command == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          *_trainer_args(plan)]
    hostfile = rendered(_train_op(nnodes=2, hostfile="/shared/hostfile"), plan)
    assert hostfile.command[:4] == ["deepspeed", "--hostfile=/shared/hostfile", "--num_nodes=2", "--num_gpus=2"]


def test_local_launcher_passes_an_allowlisted_environment(plan, creds):
    worker = {"PATH": "/usr/bin", "HF_HOME": "/hf", "NCCL_DEBUG": "INFO", "CUSTOM_FLAG": "1",
              "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://airflow:dbpass@db/airflow",
              "AIRFLOW__CORE__FERNET_KEY": "fernet", "AIRFLOW__API_AUTH__JWT_SECRET": "jwt",
              "MFT__TRAIN__STEPS": "99", "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
    cfg = load_plan_config(plan)
    env = local_env(cfg, load_settings(env={}, env_passthrough=["CUSTOM_FLAG"]), worker)
    assert {"PATH", "HF_HOME", "NCCL_DEBUG", "CUSTOM_FLAG"} <= set(env)
    assert not any(k.startswith(("AIRFLOW", "MFT__")) for k in env)
    assert "dbpass" not in json.dumps(env) and "fernet" not in json.dumps(env)
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET  # the store's credentials, which the trainer needs


def test_spark_stage_renders_spark_submit_on_spark_default(plan, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    op = SparkStageOperator(task_id="enrich", stage="enrich", application="enrich.py", input_field="source_uri",
                            output_field="enriched_uri",
                            settings=load_settings(env={}, spark_executor_memory="4g", spark_py_files="/opt/mft.zip"))
    op = rendered(op, plan)
    assert op.name == "mft-enrich-v1"
    cmd = op._get_hook()._build_spark_submit_command(op.application)
    assert cmd[0] == "spark-submit"
    assert cmd[cmd.index("--master") + 1] == "local[2]"
    assert f"spark.pyspark.python={sys.executable}" in cmd
    assert cmd[cmd.index("--executor-memory") + 1] == "4g" and cmd[cmd.index("--py-files") + 1] == "/opt/mft.zip"
    assert cmd[-7:] == [op.application, "--input", plan.source_uri, "--output", plan.enriched_uri,
                        "--config", plan.config_file]
    assert op.application.endswith("spark_jobs/enrich.py")
