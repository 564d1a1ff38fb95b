"""The train and Spark operators render the right specs, checked on the real operator objects with
their templates rendered against a real plan (no Docker engine or Kubernetes cluster exists here):
image, command, GPU/CPU/memory requests, volumes, shm, multi-node rendezvous, deterministic names,
and credentials never in plain container config. The Kubernetes manifests are also checked against
what an API server would refuse (`tests/k8s_validation.py`: the OpenAPI schema of the installed
client package plus the server's own rules), and the Kubernetes operator is driven through its
real `execute` against a stand-in API (the one thing that cannot exist here) to show it defers."""

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
from tests.dag_helpers import FakeTI, task_context
from tests.k8s_validation import job_problems, service_problems
from tests.test_dag_params import deployment_env

SECRET = "wJalrXUtnFEMI-not-a-real-secret"
KEY_ID = "AKIAEXAMPLEKEYID"


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
    assert svc.metadata.name == pod.subdomain  # the pods' DNS names live under this Service
    # what an API server would refuse: nothing
    assert job_problems(job) == [] and service_problems(svc) == []


def _k8s_context(plan):
    """A task context as the Task Runner gives it: the provider labels the pods with the TI's ids."""
    return {**task_context(plan), "run_id": "scheduled__2026-01-01T02:00:00+00:00", "dag": SimpleNamespace()}


def test_kubernetes_job_of_the_default_settings_is_accepted_by_an_api_server(plan):
    """The defaults (8 GPUs, CPU and memory requests) on a real run's labels: a GPU is an extended
    resource, so the API server accepts it only with a limit equal to the request."""
    op = _prepared(_train_op(launcher="kubernetes", s3_secret="mft-s3"), plan)
    op.__dict__["hook"] = SimpleNamespace(is_in_cluster=False)
    job = op.build_job_request_obj(context=_k8s_context(plan))
    [c] = job.spec.template.spec.containers
    assert c.resources.requests == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"}
    assert c.resources.limits == {"nvidia.com/gpu": "8"}
    assert job.spec.template.metadata.labels["run_id"]  # the run id as a (normalised) label value
    assert job_problems(job) == []


@pytest.mark.parametrize("breakage, finding", [
    (lambda j: j["spec"]["template"]["spec"]["containers"][0]["resources"].pop("limits"),
     "limit must be set for non overcommitable resources"),
    (lambda j: j["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update(
        {"nvidia.com/gpu": "4"}), "must be equal to nvidia.com/gpu limit"),
    (lambda j: j["spec"]["template"]["spec"]["containers"][0]["resources"].update(
        limits={"memory": "1Gi", "nvidia.com/gpu": "8"}), "must be less than or equal to memory limit"),
    (lambda j: j["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"].update(cpu="eight"),
     "is not a quantity"),
    (lambda j: j["spec"]["template"]["spec"]["containers"][0].update(resourceRequests={"cpu": "1"}),
     "unknown field of V1Container"),
    (lambda j: j["spec"]["template"]["spec"]["containers"][0].pop("name"), "`name`, must not be `None`"),
    (lambda j: j["spec"].update(completions="4"), "expected int"),
    (lambda j: j["spec"]["template"]["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "scratch", "mountPath": "/scratch"}), "not found among the pod's volumes"),
    (lambda j: j["spec"]["template"]["spec"].update(restartPolicy="Always"), "must use Never or OnFailure"),
    (lambda j: j["metadata"].update(name="job-" + "x" * 60), "longer than 63 characters"),
    (lambda j: j["spec"]["template"]["metadata"]["labels"].update(run="a:b"), "invalid value"),
])
def test_the_api_server_checks_catch_what_a_cluster_refuses(plan, breakage, finding):
    """The checks above can fail: each manifest a real API server would refuse is named."""
    from tests.k8s_validation import to_json

    op = _prepared(_train_op(launcher="kubernetes", s3_secret="mft-s3", nnodes=2, staging_pvc="pvc",
                             memory_request="64Gi"), plan)
    op.__dict__["hook"] = SimpleNamespace(is_in_cluster=False)
    job = to_json(op.build_job_request_obj(context=_k8s_context(plan)))
    assert job_problems(job) == []
    breakage(job)
    assert any(finding in p for p in job_problems(job)), job_problems(job)


class FakeKubernetesApi:
    """The API calls the Job operator makes, recorded (no cluster exists here). Pods appear only
    after `pods_after` lists, as the Job controller creates them a moment after the Job."""

    def __init__(self, pods_after: int, n_pods: int, existing=None):
        from kubernetes.client import models as k8s

        self.pods_after, self.lists, self.jobs, self.services, self.blocking_waits = pods_after, 0, [], [], []
        self.existing, self.deleted = existing, []  # a Job of an earlier try, answered until deleted
        self.pods = [k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=f"job-mft-train-r1-{i}-x{i}", namespace="ml",
                                                         labels={"try_number": "1"})) for i in range(n_pods)]
        self.is_in_cluster = False
        self.core_v1_client = self

    # KubernetesHook
    def create_job(self, job):
        self.jobs.append(job)
        return job

    def wait_until_job_complete(self, **kwargs):
        self.blocking_waits.append(kwargs)
        raise AssertionError("the worker must not wait for the Job: it defers to the triggerer")

    def get_pod(self, name, namespace):
        return next(p for p in self.pods if p.metadata.name == name)

    # BatchV1Api
    def read_namespaced_job(self, name, namespace):
        from kubernetes.client.exceptions import ApiException

        if self.existing is not None and self.existing.metadata.name == name:
            return self.existing
        raise ApiException(status=404)

    def delete_namespaced_job(self, name, namespace, propagation_policy=None):
        self.deleted.append((name, namespace, propagation_policy))
        self.existing = None

    # CoreV1Api
    def create_namespaced_service(self, namespace, body):
        self.services.append(body)

    def list_namespaced_pod(self, namespace, label_selector):
        self.lists += 1
        return SimpleNamespace(items=self.pods if self.lists > self.pods_after else self.pods[:1])


@pytest.fixture
def local_plan(tmp_path):
    env = deployment_env({"pipeline.store_uri": uris.qualify(tmp_path / "store"),
                          "pipeline.staging_uri": uris.qualify(tmp_path / "staging")})
    return resolve_plan({"dataset_version": "v1", "run_id": "r1"}, dag_id="mistral_finetune",
                        airflow_run_id="manual__x", run_date=None, env=env)


def _kubernetes_op_on(api, plan, **settings):
    op = rendered(_train_op(launcher="kubernetes", gpus=8, nnodes=2, namespace="ml", staging_pvc="pvc", **settings),
                  plan)
    for attr in ("hook", "job_client", "client"):  # the provider's cached API clients
        op.__dict__[attr] = api
    op.startup_check_interval_seconds = 0.01
    return op


def test_kubernetes_launcher_defers_so_no_worker_slot_is_held(local_plan, tmp_path, monkeypatch):
    from airflow.providers.cncf.kubernetes.triggers.job import KubernetesJobTrigger
    from airflow.sdk.exceptions import TaskDeferred

    from pipeline_core.artifacts import publish_artifact

    api = FakeKubernetesApi(pods_after=5, n_pods=2)  # the provider alone stops after 4 lists
    op = _kubernetes_op_on(api, local_plan)
    ctx = _k8s_context(local_plan)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(ctx)
    # the worker returned right after creating the Job: the triggerer waits for it
    [job] = api.jobs
    assert job_problems(job) == [] and api.blocking_waits == []
    assert [s.metadata.name for s in api.services] == ["mft-train-r1"]  # the rendezvous Service, before the pods
    trigger = deferred.value.trigger
    assert isinstance(trigger, KubernetesJobTrigger) and deferred.value.method_name == "execute_complete"
    classpath, kwargs = trigger.serialize()  # what the triggerer gets (it must round-trip)
    assert classpath.endswith("KubernetesJobTrigger") and kwargs["job_name"] == "job-mft-train-r1"
    # every node's pod is watched, not the one that happened to exist at the first list
    assert api.lists == 6 and kwargs["pod_names"] == [p.metadata.name for p in api.pods]
    assert kwargs["job_namespace"] == kwargs["pod_namespace"] == "ml" and kwargs["get_logs"] is True

    # the Job succeeded and the trainer committed the model: the resumed task reports it
    model = tmp_path / "model"
    (model / "data").mkdir(parents=True)
    (model / "data" / "model.safetensors").write_bytes(b"weights")
    publish_artifact(model, local_plan.model_uri, kind="model", counts={})
    logged = []
    monkeypatch.setattr(op, "_write_logs", lambda pod, **kw: logged.append(pod.metadata.name))
    monkeypatch.setattr(op, "post_complete_action", lambda **kw: None)
    result = op.execute_complete(ctx, event={"status": "success", "job": job.to_dict(), "message": "done",
                                             "pod_names": kwargs["pod_names"], "pod_namespace": "ml"})
    assert result["uri"] == local_plan.model_uri and result["reused"] is False
    assert logged == kwargs["pod_names"]  # each node's log lands in the task log


def _earlier_job(active: int):
    from kubernetes.client import models as k8s

    return k8s.V1Job(metadata=k8s.V1ObjectMeta(name="job-mft-train-r1", namespace="ml"),
                     status=k8s.V1JobStatus(active=active, failed=0 if active else 1))


def test_kubernetes_retry_adopts_the_earlier_tries_active_job(local_plan):
    """Issue 26 item 10: a retry whose predecessor's Job is still active waits on that Job (deferred
    on its name) instead of creating a second trainer."""
    from airflow.sdk.exceptions import TaskDeferred

    earlier = _earlier_job(active=2)
    api = FakeKubernetesApi(pods_after=0, n_pods=2, existing=earlier)
    op = _kubernetes_op_on(api, local_plan)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(_k8s_context(local_plan))
    assert api.jobs == [] and api.deleted == [], "no second Job, and the running one is not deleted"
    assert op.job is earlier and deferred.value.trigger.serialize()[1]["job_name"] == "job-mft-train-r1"


def test_kubernetes_retry_replaces_the_earlier_tries_finished_job(local_plan):
    """A finished (failed) Job of the previous try is deleted, then this try's Job is created, carrying
    this try's attempt id (its own staging directory and checkpoint markers)."""
    from airflow.sdk.exceptions import TaskDeferred

    api = FakeKubernetesApi(pods_after=0, n_pods=2, existing=_earlier_job(active=0))
    op = _kubernetes_op_on(api, local_plan)
    ctx = _k8s_context(local_plan)
    ctx["ti"].try_number = 2
    with pytest.raises(TaskDeferred):
        op.execute(ctx)
    assert api.deleted == [("job-mft-train-r1", "ml", "Foreground")]
    [job] = api.jobs
    env = {e.name: e.value for e in job.spec.template.spec.containers[0].env}
    assert env["MFT_ATTEMPT_ID"] == "scheduled__2026-01-01T02:00:00+00:00-try2"


class FakeDockerApi:
    """The Docker engine calls of the train operator's take-over (no engine exists here): one
    container of this run's name from an earlier try; `wait` is where it finishes."""

    def __init__(self, state: str, mounts: list[dict], on_wait=None):
        self.container = {"Id": "c0ffee" * 4, "State": state, "Mounts": mounts}
        self.on_wait, self.removed, self.waited = on_wait, [], []

    def containers(self, all, filters):
        return [self.container]

    def logs(self, cid, stream=False, follow=False, tail=50):
        return iter([b"step 2 of 2\n"]) if stream else b"Traceback: an earlier failure\n"

    def wait(self, cid):
        self.waited.append(cid)
        if self.on_wait:
            self.on_wait()

    def remove_container(self, cid, force=False):
        self.removed.append(cid)


def _earlier_secret(plan) -> Path:
    """What an earlier try's operator wrote for its container (its process died before removing it)."""
    staging = uris.to_local_path(load_plan_config(plan).pipeline.staging_uri)
    secret = staging / "secrets" / f"{plan.trainer_name}-99999" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_text("[default]\n")
    return secret


def _commit_model(plan, tmp_path):
    from pipeline_core.artifacts import publish_artifact

    model = tmp_path / "model"
    (model / "data").mkdir(parents=True)
    (model / "data" / "model.safetensors").write_bytes(b"weights")
    publish_artifact(model, plan.model_uri, kind="model", counts={})


def test_docker_retry_adopts_a_running_container_reports_reused_and_removes_its_credentials(local_plan, tmp_path,
                                                                                            monkeypatch):
    from airflow.providers.docker.operators.docker import DockerOperator

    from plugins.mft_airflow.launchers import CONTAINER_CREDENTIALS

    secret = _earlier_secret(local_plan)
    api = FakeDockerApi("running", [{"Source": str(secret), "Destination": CONTAINER_CREDENTIALS}],
                        on_wait=lambda: _commit_model(local_plan, tmp_path))
    monkeypatch.setattr(DockerOperator, "execute", lambda self, ctx: pytest.fail("a second trainer was started"))
    op = rendered(_train_op(launcher="docker"), local_plan)
    op.__dict__["hook"] = SimpleNamespace(api_client=api)
    result = op.execute(task_context(local_plan))
    assert api.waited and api.removed, "the running container is waited for, then removed"
    assert result["reused"] is True and result["uri"] == local_plan.model_uri
    assert not secret.exists() and not secret.parent.exists(), "the adopted container's credentials file stays"


def test_docker_retry_after_a_failed_container_launches_its_own_with_this_tries_attempt(local_plan, tmp_path,
                                                                                        monkeypatch):
    from airflow.providers.docker.operators.docker import DockerOperator

    from plugins.mft_airflow.launchers import CONTAINER_CREDENTIALS

    secret = _earlier_secret(local_plan)
    api = FakeDockerApi("exited", [{"Source": str(secret), "Destination": CONTAINER_CREDENTIALS}])
    launched = []
    monkeypatch.setattr(DockerOperator, "execute", lambda self, ctx: (launched.append(dict(self.environment)),
                                                                       _commit_model(local_plan, tmp_path)))
    op = rendered(_train_op(launcher="docker"), local_plan)
    op.__dict__["hook"] = SimpleNamespace(api_client=api)
    ctx = task_context(local_plan)
    ctx["ti"].try_number = 3
    result = op.execute({**ctx, "run_id": "manual__x"})
    assert api.removed and not api.waited
    assert result["reused"] is False and len(launched) == 1
    assert launched[0]["MFT_ATTEMPT_ID"] == "manual__x-try3"
    assert not secret.exists()


def test_kubernetes_launcher_fails_when_the_pods_never_appear(local_plan):
    from airflow.sdk.exceptions import AirflowException

    api = FakeKubernetesApi(pods_after=10**9, n_pods=2)
    op = _kubernetes_op_on(api, local_plan)
    op.schedule_timeout_seconds = 0.2
    with pytest.raises(AirflowException, match="1 of 2 pods created within"):
        op.execute(_k8s_context(local_plan))


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


def test_a_hub_model_prefetched_on_the_worker_resolves_in_the_offline_container(plan, monkeypatch, tmp_path):
    """Containers run with HF_HUB_OFFLINE=1: the worker fills the hub cache on the shared staging
    volume, and the trainer's own resolve finds it there, offline, through the container's HF_HOME.
    The download is the one stand-in (no hub here): it writes the hub cache layout, as the real one
    does."""
    import logging
    import subprocess

    import huggingface_hub

    from plugins.mft_airflow.container_operators import prefetch_base_model
    from plugins.mft_airflow.launchers import hub_cache_env

    fetched = []

    def download(repo_id, cache_dir, allow_patterns):
        fetched.append((repo_id, allow_patterns))
        repo = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
        (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
        (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    op = _prepared(_train_op(launcher="docker", gpus=1), plan)
    cfg = load_plan_config(plan).model_copy(deep=True)
    cfg.train.base_model = "mistralai/Mistral-7B-v0.3"
    prefetch_base_model(cfg, logging.getLogger("t"))
    assert [r for r, _ in fetched] == ["mistralai/Mistral-7B-v0.3"] and "*.safetensors" in fetched[0][1]
    env = {**os.environ, "HF_HOME": op.environment["HF_HOME"], "HF_HUB_OFFLINE": "1"}
    assert env["HF_HOME"] == hub_cache_env(cfg)["HF_HOME"]
    found = subprocess.run([sys.executable, "-c", "from training.weights import resolve_model_dir; "
                            "print(resolve_model_dir('mistralai/Mistral-7B-v0.3'))"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-3000:]
    assert Path(found.stdout.strip(), "config.json").is_file()
    assert Path(found.stdout.strip()).is_relative_to(env["HF_HOME"])
    # a local directory or the embedded tiny model needs nothing fetched
    cfg.train.base_model = "tiny"
    prefetch_base_model(cfg, logging.getLogger("t"))
    assert len(fetched) == 1


def test_kubernetes_resources_from_the_environment_are_quantities():
    """`MFT_DEPLOY__CPU_REQUEST=8` is YAML's int 8: it must still be the quantity "8"; a value the API
    server would refuse is refused here, before any run, naming the variable."""
    s = load_settings(env={"MFT_DEPLOY__CPU_REQUEST": "8", "MFT_DEPLOY__MEMORY_REQUEST": "64Gi",
                           "MFT_DEPLOY__MEMORY_LIMIT": "96Gi"})
    assert (s.cpu_request, s.memory_request, s.memory_limit) == ("8", "64Gi", "96Gi")
    assert load_settings(env={"MFT_DEPLOY__CPU_REQUEST": "0.5"}).cpu_request == "0.5"
    with pytest.raises(ValueError, match="MFT_DEPLOY__CPU_REQUEST: .*'eight' is not a Kubernetes quantity"):
        load_settings(env={"MFT_DEPLOY__CPU_REQUEST": "eight"})
    with pytest.raises(ValueError, match="memory_limit=32Gi is below memory_request=64Gi"):
        load_settings(env={"MFT_DEPLOY__MEMORY_LIMIT": "32Gi"})


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
    op = SparkStageOperator(task_id="enrich", stage="enrich", application="enrich/job.py", input_field="source_uri",
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
    assert op.application.endswith("spark_jobs/enrich/job.py")
