"""Training in containers: the provider operators themselves, with the trainer's spec from the plan.

- `DockerTrainOperator` is a `DockerOperator`: GPU `DeviceRequest`s, shared directories bind-mounted
  at the same path (so `file://` URIs mean the same inside), a large /dev/shm for NCCL, store
  credentials as a read-only mounted file (never in the container's config, which `docker inspect`
  shows), a deterministic container name checked before launch, and every container removed after
  its logs are streamed into the task log (failed ones included).
- `KubernetesTrainOperator` is a deferrable `KubernetesJobOperator`: an indexed Job with one pod
  per node (completion index = node rank), a headless Service giving the index-0 pod a stable DNS
  name for the c10d rendezvous, CPU/memory/GPU requests, the shared staging PVC, credentials from
  a Kubernetes Secret; the task frees its worker slot while the Job runs (the triggerer waits).

Imported only when the deployment's launcher names them (`operators.train_operator`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.providers.cncf.kubernetes.operators.job import JOB_NAME_PREFIX, KubernetesJobOperator
from airflow.providers.docker.operators.docker import DockerOperator
from airflow.sdk.exceptions import AirflowException

from pipeline_core import uris
from plugins.mft_airflow import launchers
from plugins.mft_airflow.settings import DeploySettings
from plugins.mft_airflow.stage_base import TEMPLATED_PLAN, _EvalStage, _TrainStage, plan_field


def prefetch_base_model(cfg: Any, log: Any) -> None:
    """A hub model id cannot be downloaded by an offline container: fetch it on the worker into
    the shared hub cache (`launchers.hub_cache_env`) the container reads, before launch."""
    base = cfg.train.base_model
    if base == "tiny" or uris.scheme_of(base) or Path(base).exists():
        return
    from huggingface_hub import snapshot_download

    from training.weights import _DOWNLOAD_PATTERNS  # the files the trainer's own resolve reads

    cache = launchers.hub_cache_env(cfg)["HF_HOME"]
    log.info("prefetching %s into %s (containers run with HF_HUB_OFFLINE=1)", base, cache)
    snapshot_download(repo_id=base, cache_dir=str(Path(cache) / "hub"), allow_patterns=_DOWNLOAD_PATTERNS)


# ----------------------------------------------------------------------------------------- docker


class DockerTrainOperator(_TrainStage, DockerOperator):
    """The trainer in a GPU container on a Docker engine (one node, or one node of a rendezvous).

    :param settings: deployment settings (image, GPUs, shm, network, shared volume, credentials
        file, nodes / rendezvous)
    """

    template_fields: Sequence[str] = DockerOperator.template_fields
    ui_color = "#e6e6fa"

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        from docker.types import DeviceRequest

        gpus = [DeviceRequest(count=settings.gpus, capabilities=[["gpu"]])] if settings.gpus else None
        super().__init__(
            image=settings.image,
            command=launchers.container_command(TEMPLATED_PLAN, settings),
            container_name=plan_field("trainer_name"),
            device_requests=gpus,
            shm_size=settings.shm_size_gb * 1024**3,
            docker_url=settings.docker_url,
            network_mode=settings.docker_network,
            auto_remove="force",  # logs are streamed while it runs; a failed container is not kept
            mount_tmp_dir=False,
            tty=False,
            **kwargs,
        )
        self.settings = settings
        self._secret_file: Path | None = None

    def prepare(self, cfg: Any) -> None:
        """Mounts and environment for this run's config (called in `execute`, tests call it too)."""
        from docker.types import Mount

        s = self.settings
        mounts = [Mount(target=d, source=d, type="bind") for d in launchers.shared_dirs(cfg)]
        if s.shared_volume:  # the host directory holding the staging tree may live elsewhere on the host
            mounts[0] = Mount(target=mounts[0]["Target"], source=s.shared_volume, type="bind")
        env = {**launchers.trainer_env(cfg), **launchers.hub_cache_env(cfg), "HF_HUB_OFFLINE": "1"}
        secret = self._credentials_source(cfg)
        if secret:
            mounts.append(Mount(target=launchers.CONTAINER_CREDENTIALS, source=secret, type="bind", read_only=True))
            env["AWS_SHARED_CREDENTIALS_FILE"] = launchers.CONTAINER_CREDENTIALS
        self.mounts, self.environment, self._private_environment = mounts, env, {}

    def _credentials_source(self, cfg: Any) -> str | None:
        """Host path of the credentials file: the deployment's (a Docker secret), else one written
        for this attempt (mode 0600, removed when the task ends)."""
        if self.settings.credentials_file:
            return self.settings.credentials_file
        creds = launchers.store_credentials(cfg)
        if not creds:
            return None
        staging = uris.to_local_path(cfg.pipeline.staging_uri)
        d = staging / "secrets" / f"{self._plan.trainer_name}-{os.getpid()}"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._secret_file = d / "credentials"
        fd = os.open(self._secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(launchers.credentials_ini(creds))
        host = Path(self.settings.shared_volume) / d.relative_to(staging) if self.settings.shared_volume else d
        return str(host / "credentials")

    def _take_over_previous(self, cfg: Any) -> bool:
        """One trainer per run: a container with this run's name is the previous attempt's. A
        running one is waited for (its logs follow; True: adopted); a stopped one is removed after
        its logs. Either way the per-attempt credentials file it was started with goes with it."""
        name = self.container_name
        found = self.cli.containers(all=True, filters={"name": f"^/{name}$"})
        if not found:
            return False
        c = found[0]
        adopted = c.get("State") == "running"
        if adopted:
            self.log.warning("container %s (%s) of this run is still running: waiting for it instead of "
                             "starting a second trainer", name, c["Id"][:12])
            for chunk in self.cli.logs(c["Id"], stream=True, follow=True, tail=50):
                self.log.info("%s", chunk.decode(errors="replace").rstrip())
            self.cli.wait(c["Id"])
        else:
            tail = self.cli.logs(c["Id"], tail=50).decode(errors="replace")
            self.log.info("removing stopped container %s of a previous attempt; its last lines:\n%s", name, tail)
        self.cli.remove_container(c["Id"], force=True)
        self._remove_previous_secret(c, cfg)
        return adopted

    def _remove_previous_secret(self, container: dict[str, Any], cfg: Any) -> None:
        """The credentials file an earlier attempt wrote for `container` (under the staging's
        `secrets/`; never the deployment's own file): its writer may have died before removing it."""
        staging = uris.to_local_path(cfg.pipeline.staging_uri)
        host_root = Path(self.settings.shared_volume) if self.settings.shared_volume else staging
        for m in container.get("Mounts") or []:
            if m.get("Destination") != launchers.CONTAINER_CREDENTIALS or not m.get("Source"):
                continue
            try:
                rel = Path(m["Source"]).relative_to(host_root)
            except ValueError:
                continue  # not one this operator writes (the deployment's secret file)
            path = staging / rel
            if rel.parts[:1] != ("secrets",) or rel.name != "credentials" or path == self._secret_file:
                continue
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass
            self.log.info("removed the credentials file %s of the previous attempt's container", path)

    def execute(self, context: Any) -> dict[str, Any]:
        launched = False
        if not self._begin_training(context):
            cfg = self._config()
            self.prepare(cfg)
            self.environment.update(launchers.attempt_env(context))
            try:
                adopted = self._take_over_previous(cfg)
                self._manifest = self._store.manifest(getattr(self._plan, self.output_field))
                if self._manifest is None:  # the waited-for one may have finished
                    if self.prefetch_base:
                        prefetch_base_model(cfg, self.log)
                    launched = True
                    super().execute(context)
                elif adopted:
                    self.log.info("the adopted container of a previous attempt committed the model")
            finally:
                self._remove_secret()
        return self._finish(context, reused=not launched).to_json_dict()

    def _remove_secret(self) -> None:
        if self._secret_file is not None:
            self._secret_file.unlink(missing_ok=True)
            self._secret_file.parent.rmdir()
            self._secret_file = None


# ------------------------------------------------------------------------------------- kubernetes


class KubernetesTrainOperator(_TrainStage, KubernetesJobOperator):
    """The trainer as an indexed Kubernetes Job: `settings.nnodes` pods, one torchrun agent each.

    Why an indexed Job (not JobSet or a Kubeflow PyTorchJob): it is core Kubernetes (batch/v1,
    no controller to install), gives every pod its node rank (`JOB_COMPLETION_INDEX`) and a stable
    hostname under a headless Service, and the provider's `KubernetesJobOperator` already waits
    on it deferrably. See docs/deploy.md.

    :param settings: deployment settings (image, GPUs, CPU/memory requests, nodes, namespace,
        staging PVC, S3 Secret, placement)
    """

    template_fields: Sequence[str] = KubernetesJobOperator.template_fields
    ui_color = "#e6e6fa"

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        from kubernetes.client import models as k8s

        s = settings
        name = plan_field("trainer_name")
        # the provider names the Job job-<name>; its pods' hostnames are job-<name>-<index>
        argv = launchers.kubernetes_command(TEMPLATED_PLAN, s, job_name=JOB_NAME_PREFIX + name, service=name)
        requests = {k: v for k, v in {"cpu": s.cpu_request, "memory": s.memory_request}.items() if v}
        limits = {"memory": s.memory_limit} if s.memory_limit else {}
        if s.gpus:
            requests[s.gpu_resource] = limits[s.gpu_resource] = str(s.gpus)
        super().__init__(
            name=name,
            random_name_suffix=False,  # deterministic: a retry finds its predecessor (see create_job)
            namespace=s.namespace,
            image=s.image,
            cmds=argv[:1],
            arguments=argv[1:],
            env_from=([k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=s.s3_secret))]
                      if s.s3_secret else None),
            container_resources=k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None),
            node_selector=s.node_selector or None,
            tolerations=[k8s.V1Toleration(**t) for t in s.tolerations] or None,
            service_account_name=s.service_account,
            labels={"app": "mistral-finetune", "mft-run": name},
            completion_mode="Indexed",
            completions=s.nnodes,
            parallelism=s.nnodes,
            backoff_limit=0,  # one lost pod fails the Job; the Airflow retry resumes from a checkpoint
            wait_until_job_complete=True,
            deferrable=True,
            get_logs=True,
            on_finish_action="delete_succeeded_pod",
            startup_timeout_seconds=1800,
            # how long the Job controller may take to create the pods (they exist, Pending, even
            # when no node fits yet); the wait for them to run and finish happens in the triggerer
            schedule_timeout_seconds=300,
            startup_check_interval_seconds=2,
            **kwargs,
        )
        self.settings = settings

    def prepare(self, cfg: Any) -> None:
        """Volumes, environment and the pod's subdomain for this run's config."""
        from kubernetes.client import models as k8s

        s = self.settings
        if not uris.is_local(cfg.pipeline.store_uri) and not s.s3_secret:
            raise ValueError("kubernetes launcher: the store's credentials cannot reach a pod as plain config; set "
                             "MFT_DEPLOY__S3_SECRET to a Kubernetes Secret holding AWS_ACCESS_KEY_ID / "
                             "AWS_SECRET_ACCESS_KEY")
        if s.nnodes > 1 and not s.staging_pvc:
            raise ValueError("kubernetes launcher: nnodes > 1 needs MFT_DEPLOY__STAGING_PVC, a ReadWriteMany claim "
                             "shared by every node (checkpoints are staged there before upload)")
        staging = str(uris.to_local_path(cfg.pipeline.staging_uri))
        self.volumes = [k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(
            medium="Memory", size_limit=f"{s.shm_size_gb}Gi"))]
        self.volume_mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
        if s.staging_pvc:
            self.volumes.append(k8s.V1Volume(name="staging", persistent_volume_claim=(
                k8s.V1PersistentVolumeClaimVolumeSource(claim_name=s.staging_pvc))))
            self.volume_mounts.append(k8s.V1VolumeMount(name="staging", mount_path=staging))
        env = {**launchers.trainer_env(cfg), **launchers.hub_cache_env(cfg), "HF_HUB_OFFLINE": "1"}
        self.env_vars = [k8s.V1EnvVar(name=k, value=v) for k, v in env.items()]
        # pods of an indexed Job are <job>-<index>; with this subdomain, <job>-0.<service> resolves
        self.full_pod_spec = k8s.V1Pod(spec=k8s.V1PodSpec(containers=[], subdomain=self.name))

    def rendezvous_service(self) -> Any:
        """Headless Service selecting this Job's pods: stable DNS for the index-0 rendezvous host."""
        from kubernetes.client import models as k8s

        return k8s.V1Service(
            metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace, labels=self.labels),
            spec=k8s.V1ServiceSpec(cluster_ip="None", selector={"mft-run": self.name}, publish_not_ready_addresses=True,
                                   ports=[k8s.V1ServicePort(name="rdzv", port=self.settings.rdzv_port)]))

    def create_job(self, job_request_obj: Any) -> Any:
        """Never a second trainer: an active Job of this run is adopted; a finished one (failed,
        or interrupted) is deleted first, so the new one resumes from the run's checkpoints."""
        from kubernetes.client.exceptions import ApiException

        name, ns = job_request_obj.metadata.name, job_request_obj.metadata.namespace
        try:
            existing = self.job_client.read_namespaced_job(name, ns)
        except ApiException as e:
            if e.status != 404:
                raise
            existing = None
        if existing is not None:
            if (existing.status.active or 0) > 0:
                self.log.warning("Job %s/%s of this run is still active: waiting for it instead of starting a "
                                 "second trainer", ns, name)
                return existing
            self.log.info("deleting finished Job %s/%s of a previous attempt", ns, name)
            self.job_client.delete_namespaced_job(name, ns, propagation_policy="Foreground")
            self._wait_deleted(name, ns)
        if self.settings.nnodes > 1:
            try:
                self.hook.core_v1_client.create_namespaced_service(ns, self.rendezvous_service())
            except ApiException as e:
                if e.status != 409:  # already there from a previous attempt
                    raise
        return super().create_job(job_request_obj)

    def get_pods(self, pod_request_obj: Any, context: Any, *, exclude_checked: bool = True) -> Any:
        """All `parallelism` pods of the Job, waited for: the provider lists them a few times back
        to back and fails with "No pods running" (or defers on a partial list) when the Job
        controller has not created them yet, while the Job runs on unmonitored
        (apache/airflow#70585). Polls every `startup_check_interval_seconds` up to
        `schedule_timeout_seconds`; only pod creation is waited for here, not scheduling."""
        import time

        selector = self._build_find_pod_label_selector(context, exclude_checked=exclude_checked)
        namespace = pod_request_obj.metadata.namespace
        deadline = time.monotonic() + self.schedule_timeout_seconds
        while True:
            pods = self.client.list_namespaced_pod(namespace=namespace, label_selector=selector).items
            if len(pods) >= self.parallelism:
                for pod in pods:
                    self.log_matching_pod(pod=pod, context=context)
                return pods
            if time.monotonic() >= deadline:
                raise AirflowException(
                    f"Job {namespace}/{self.job.metadata.name}: {len(pods)} of {self.parallelism} pods created within "
                    f"{self.schedule_timeout_seconds}s (pods with labels {selector}); a quota or admission controller "
                    "may be holding them back: see `kubectl describe job`")
            time.sleep(self.startup_check_interval_seconds)

    def _wait_deleted(self, name: str, ns: str, timeout_s: float = 300) -> None:
        import time

        from kubernetes.client.exceptions import ApiException

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.job_client.read_namespaced_job(name, ns)
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            time.sleep(2)
        raise AirflowException(f"Job {ns}/{name} of a previous attempt was not deleted within {timeout_s:.0f}s")

    def execute(self, context: Any) -> Any:
        if self._begin_training(context):
            return self._finish(context, reused=True).to_json_dict()
        cfg = self._config()
        self.prepare(cfg)
        from kubernetes.client import models as k8s

        self.env_vars += [k8s.V1EnvVar(name=k, value=v) for k, v in launchers.attempt_env(context).items()]
        if self.prefetch_base:
            prefetch_base_model(cfg, self.log)
        super().execute(context)  # defers: the triggerer waits for the Job; execute_complete resumes
        return self._finish(context, reused=False).to_json_dict()

    def execute_complete(self, context: Any, event: dict, **kwargs: Any) -> Any:
        super().execute_complete(context, event, **kwargs)
        self._begin(context)
        return self._finish(context, reused=False).to_json_dict()


# ------------------------------------------------------------------------------------- benchmarks


class DockerEvalOperator(_EvalStage, DockerTrainOperator):
    """lm-evaluation-harness on the exported model in the trainer's image and GPUs (one container)."""

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        super().__init__(settings=settings, **kwargs)
        self.command = launchers.eval_argv(TEMPLATED_PLAN, ["python"])
        self.container_name = plan_field("trainer_name") + "-eval"


class KubernetesEvalOperator(_EvalStage, KubernetesTrainOperator):
    """lm-evaluation-harness as a one-pod Job in the trainer's image, resources and placement."""

    def __init__(self, *, settings: DeploySettings, **kwargs: Any):
        super().__init__(settings=settings, **kwargs)
        argv = launchers.eval_argv(TEMPLATED_PLAN, ["python"])
        self.cmds, self.arguments = argv[:1], argv[1:]
        self.name = plan_field("trainer_name") + "-eval"
        self.labels = {**(self.labels or {}), "mft-run": self.name}
        self.completions = self.parallelism = 1
