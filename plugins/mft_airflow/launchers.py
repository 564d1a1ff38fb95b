"""Training launchers: the same entry point (`torchrun -m training.train --input --output --config`)
run three ways, chosen per run by the `launcher` param.

- local: a torchrun subprocess on the worker (CPU ranks or the worker's GPUs): the embedded default;
- docker: `DockerOperator` with GPU `DeviceRequest`s, shared volumes bind-mounted at the same
  path (so `file://` URIs mean the same inside), a large /dev/shm for NCCL, credentials only in
  `private_environment` (never rendered, never logged);
- kubernetes: `KubernetesPodOperator` with GPU resource limits, the staging PVC, a memory-backed
  /dev/shm, credentials from a Kubernetes Secret.

Provider imports happen inside the builders, which run at execute time, never at DAG parse time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_core import uris
from plugins.mft_airflow.settings import DeploySettings

if TYPE_CHECKING:
    from pipeline_core.config import Config

_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")
CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def train_args(plan: dict[str, Any]) -> list[str]:
    """The trainer's own arguments (the stage contract: --input --output --config)."""
    return ["--input", plan["train_ready_uri"], "--output", plan["run_uri"], "--config", plan["config_file"]]


def torchrun_command(plan: dict[str, Any], settings: DeploySettings, nproc: int, torchrun: list[str]) -> list[str]:
    return [*torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", settings.train_module, *train_args(plan)]


def _shared_dirs(plan: dict[str, Any], cfg: Config) -> list[str]:
    """Local directories a container must see at the same path: staging, and a file:// store."""
    dirs = [str(uris.to_local_path(cfg.pipeline.staging_uri))]
    if uris.is_local(cfg.pipeline.store_uri):
        dirs.append(str(uris.to_local_path(cfg.pipeline.store_uri)))
    return dirs


def _container_env(cfg: Config) -> dict[str, str]:
    """Non-secret environment for a container. An Airflow connection does not exist in the
    container, so the trainer there gets credentials as environment instead of `aws_conn_id`."""
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if cfg.storage.aws_conn_id:
        env["MFT__STORAGE__AWS_CONN_ID"] = ""
    return env


def store_credentials(cfg: Config) -> dict[str, str]:
    """Object-store credentials from the Airflow connection if the config names one, else from
    the worker's environment; empty for a local store."""
    if uris.is_local(cfg.pipeline.store_uri):
        return {}
    if cfg.storage.aws_conn_id:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

        creds = AwsBaseHook(aws_conn_id=cfg.storage.aws_conn_id, client_type="s3").get_credentials()
        out = {"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key}
        if creds.token:
            out["AWS_SESSION_TOKEN"] = creds.token
        return out
    return {k: os.environ[k] for k in CREDENTIAL_VARS if os.environ.get(k)}


# --------------------------------------------------------------------------------------- local


class LocalTrainProcess:
    """torchrun as a subprocess of the worker, its output streamed into the task log. It runs in
    its own process group so that `on_kill` (task timeout, mark-failed) stops every rank."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: str, log: Any):
        self.command, self.env, self.cwd, self.log = command, env, cwd, log
        self._proc: subprocess.Popen[str] | None = None

    def execute(self, context: Any = None) -> None:
        self.log.info("launching: %s", " ".join(self.command))
        self._proc = subprocess.Popen(
            self.command, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True,
        )
        tail: list[str] = []
        errors: list[str] = []  # torchrun's own summary hides the ranks' exceptions: keep them
        if self._proc.stdout is None:  # stdout=PIPE always gives one; an explicit check survives -O
            raise RuntimeError("training launcher: no output pipe from the torchrun process")
        for line in self._proc.stdout:
            line = line.rstrip()
            self.log.info("%s", line)
            tail = (tail + [line])[-20:]
            if _ERROR_LINE.search(line) and "ChildFailedError" not in line:
                errors = (errors + [line])[-10:]
        rc = self._proc.wait()
        if rc != 0:
            raise RuntimeError(f"training exited with status {rc}; errors:\n" + "\n".join(errors)
                               + "\nlast lines:\n" + "\n".join(tail))

    def on_kill(self, grace_s: float = 30) -> None:
        """SIGTERM first: torchrun forwards it to its ranks and waits for them. Then SIGKILL whatever
        is left after `grace_s`. The ranks run in their own sessions (torchrun starts them so) and
        may have children of their own, which a process-group signal does not reach and which
        would keep the output pipe, the GPUs and the lease: every descendant seen is signalled."""
        import psutil

        if self._proc is None or self._proc.poll() is not None:
            return
        tree = _descendants(self._proc.pid)
        os.killpg(self._proc.pid, signal.SIGTERM)
        _signal_all(tree, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(tree, timeout=max(0.0, deadline - time.monotonic()))
        if self._proc.poll() is None or alive:
            tree = list({p.pid: p for p in tree + _descendants(self._proc.pid)}.values())
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
            _signal_all(tree, signal.SIGKILL)
            self._proc.wait()
            psutil.wait_procs(tree, timeout=10)


def _descendants(pid: int) -> list[Any]:
    """Every live descendant of `pid` (psutil.Process objects: a reused pid is not mistaken for it)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal_all(procs: list[Any], sig: int) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def local_launcher(plan: dict[str, Any], cfg: Config, settings: DeploySettings, log: Any) -> LocalTrainProcess:
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    command = torchrun_command(plan, settings, settings.local_nproc_per_node, torchrun)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # the trainer reads the resolved file; nothing from the worker's MFT__ env may change it
    for k in [k for k in env if k.startswith("MFT__")]:
        del env[k]
    cwd = str(Path(__file__).resolve().parents[2])
    return LocalTrainProcess(command, env, cwd, log)


# -------------------------------------------------------------------------------------- docker


def docker_operator(plan: dict[str, Any], cfg: Config, settings: DeploySettings, task_id: str) -> Any:
    from airflow.providers.docker.operators.docker import DockerOperator
    from docker.types import DeviceRequest, Mount

    mounts = [Mount(target=d, source=d, type="bind") for d in _shared_dirs(plan, cfg)]
    if settings.shared_volume:
        # the host directory holding the staging tree may live elsewhere on the host
        mounts[0] = Mount(target=mounts[0]["Target"], source=settings.shared_volume, type="bind")
    gpus = [DeviceRequest(count=settings.gpus, capabilities=[["gpu"]])] if settings.gpus else None
    return DockerOperator(
        task_id=task_id,
        image=settings.image,
        command=torchrun_command(plan, settings, settings.gpus or settings.local_nproc_per_node, ["torchrun"]),
        environment=_container_env(cfg),
        private_environment=store_credentials(cfg),
        device_requests=gpus,
        mounts=mounts,
        shm_size=settings.shm_size_gb * 1024**3,
        docker_url=settings.docker_url,
        network_mode=settings.docker_network,
        auto_remove="success",
        mount_tmp_dir=False,
        tty=False,
        container_name=None,
    )


# ---------------------------------------------------------------------------------- kubernetes


def kubernetes_operator(plan: dict[str, Any], cfg: Config, settings: DeploySettings, task_id: str) -> Any:
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from kubernetes.client import models as k8s

    if not uris.is_local(cfg.pipeline.store_uri) and cfg.storage.aws_conn_id and not settings.s3_secret:
        raise ValueError("kubernetes launcher: storage.aws_conn_id cannot reach a pod; set MFT_DEPLOY__S3_SECRET "
                         "to a Kubernetes Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    staging = str(uris.to_local_path(cfg.pipeline.staging_uri))
    volumes = [k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(
        medium="Memory", size_limit=f"{settings.shm_size_gb}Gi"))]
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    if settings.staging_pvc:
        volumes.append(k8s.V1Volume(name="staging", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=settings.staging_pvc)))
        mounts.append(k8s.V1VolumeMount(name="staging", mount_path=staging))
    gpu = {settings.gpu_resource: str(settings.gpus)} if settings.gpus else {}
    env_from = ([k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=settings.s3_secret))]
                if settings.s3_secret else None)
    argv = torchrun_command(plan, settings, settings.gpus or settings.local_nproc_per_node, ["torchrun"])
    return KubernetesPodOperator(
        task_id=task_id,
        name=f"mft-train-{plan['run_id']}".lower().replace("_", "-").replace(".", "-")[:60].rstrip("-"),
        namespace=settings.namespace,
        image=settings.image,
        cmds=argv[:1],
        arguments=argv[1:],
        env_vars={**_container_env(cfg)},
        env_from=env_from,
        container_resources=k8s.V1ResourceRequirements(limits=gpu or None, requests=gpu or None),
        volumes=volumes,
        volume_mounts=mounts,
        node_selector=settings.node_selector or None,
        tolerations=[k8s.V1Toleration(**t) for t in settings.tolerations] or None,
        service_account_name=settings.service_account,
        labels={"app": "mistral-finetune", "dataset-version": plan["dataset_version"][:63]},
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        startup_timeout_seconds=1800,
    )


def build_launcher(plan: dict[str, Any], cfg: Config, settings: DeploySettings, task_id: str, log: Any) -> Any:
    """Something with `execute(context)` and `on_kill()` that runs the training stage."""
    launcher = plan["launcher"]
    if launcher == "local":
        return local_launcher(plan, cfg, settings, log)
    if launcher == "docker":
        return docker_operator(plan, cfg, settings, f"{task_id}-docker")
    if launcher == "kubernetes":
        return kubernetes_operator(plan, cfg, settings, f"{task_id}-pod")
    raise ValueError(f"launcher: unknown launcher {launcher!r}")
