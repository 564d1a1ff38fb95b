"""What the training launchers run and with which environment: argv/environment builders (no provider
import) and the local launcher's supervised subprocess (`LocalTrainProcess`).

The trainer is always the same entry point (`-m training.train --input --output --config`) under a
distributed agent:
- one node: `torchrun --standalone`;
- several nodes with a rendezvous: one `torchrun --nnodes N --node-rank R --rdzv-backend c10d
  --rdzv-endpoint host:port --rdzv-id <run_id>` agent per node (docker: one container per node;
  kubernetes: one pod per index of an indexed Job, node rank = the pod's completion index);
- several nodes over SSH: `deepspeed --hostfile H` (local launcher only), which starts the others.

The operators in `operators.py` put these specs into the provider operators they subclass.
Least secret: the local launcher passes an allowlisted environment (an Airflow worker's holds the
metadata DB URL, the Fernet key, the JWT secret); containers get store credentials as a mounted
file (docker) or a Kubernetes Secret, never in their visible config.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_core import uris
from pipeline_core.settings_loader import ProcessSettings
from plugins.mft_airflow.run_plan import RunPlan
from plugins.mft_airflow.settings import DeploySettings
from training import launch

if TYPE_CHECKING:
    from pipeline_core.config import Config

_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")
CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
# what a trainer needs from the worker's environment, and nothing else (names or prefixes)
ENV_ALLOWLIST = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
                 "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED",
                 "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE", "AWS_DEFAULT_REGION", "AWS_REGION",
                 "LD_LIBRARY_PATH",
                 # checkpoint signing key (training/checkpoints.py) and the attempt id: resume needs them
                 *map(ProcessSettings.env_name, ("checkpoint_hmac_key", "checkpoint_hmac_key_file", "attempt_id")))
ENV_ALLOWED_PREFIXES = ("HF_", "TRANSFORMERS_", "TORCH_", "CUDA_", "NCCL_", "NVIDIA_", "DS_", "LC_", "GLOO_",
                        "PYTORCH_", "NVSHMEM_")  # allocator settings; NVLink-multicast-off switches
CONTAINER_CREDENTIALS = "/run/secrets/aws_credentials"


def train_args(plan: RunPlan) -> list[str]:
    """The trainer's own arguments (the stage contract, training/launch.py)."""
    return launch.train_args(plan.train_ready_uri, plan.run_uri, plan.config_file)


def eval_argv(plan: RunPlan, python: list[str]) -> list[str]:
    """The benchmark runner (lm-evaluation-harness on the exported model): one process, no agent."""
    return [*python, "-m", "training.benchmarks", "--input", plan.model_uri, "--output", plan.eval_uri,
            "--config", plan.config_file]


def agent_argv(plan: RunPlan, settings: DeploySettings, *, launcher: list[str], nproc: int,
               node_rank: int | str | None = None, rdzv_endpoint: str | None = None) -> list[str]:
    """The distributed agent's argv: standalone, rendezvous (one agent per node) or a hostfile."""
    module = ["-m", settings.train_module, *train_args(plan)]
    if settings.hostfile:
        return ["deepspeed", f"--hostfile={settings.hostfile}", f"--num_nodes={settings.nnodes}",
                f"--num_gpus={nproc}", "--module", settings.train_module, *train_args(plan)]
    if settings.nnodes == 1:  # the same command the tests and benchmarks start (training/launch.py)
        return launch.standalone_argv(plan.train_ready_uri, plan.run_uri, plan.config_file, nproc,
                                      launcher=launcher, module=settings.train_module)
    return [*launcher, f"--nnodes={settings.nnodes}", f"--nproc-per-node={nproc}",
            f"--node-rank={settings.node_rank if node_rank is None else node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint or settings.rdzv_endpoint}",
            f"--rdzv-id={plan.run_id}", *module]


def attempt_env(context: Any) -> dict[str, str]:
    """MFT_ATTEMPT_ID for this Airflow try: `<dag run id>-try<N>`. Every launcher passes it to every
    node of the launch, so each try gets its own staging directory and per-rank checkpoint markers
    (the trainer adds torchrun's restart count; training/lease.py `attempt_id`). Without it every
    try of a multi-node run had the rendezvous id `<run_id>-r0`."""
    ti = context["ti"]
    run_id = getattr(ti, "run_id", None) or context.get("run_id") or "run"
    return {ProcessSettings.env_name("attempt_id"): f"{run_id}-try{ti.try_number}"}


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


def credentials_ini(creds: Mapping[str, str]) -> str:
    """An AWS shared-credentials file (what boto3 reads through AWS_SHARED_CREDENTIALS_FILE)."""
    lines = ["[default]", f"aws_access_key_id = {creds['AWS_ACCESS_KEY_ID']}",
             f"aws_secret_access_key = {creds['AWS_SECRET_ACCESS_KEY']}"]
    if creds.get("AWS_SESSION_TOKEN"):
        lines.append(f"aws_session_token = {creds['AWS_SESSION_TOKEN']}")
    return "\n".join(lines) + "\n"


def trainer_env(cfg: Config) -> dict[str, str]:
    """Non-secret settings every trainer gets. No Airflow connection exists where the trainer runs
    (a container, or a subprocess outside the Task SDK), so it reads credentials itself."""
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if cfg.storage.aws_conn_id:
        env["MFT__STORAGE__AWS_CONN_ID"] = ""
    return env


def shared_dirs(cfg: Config) -> list[str]:
    """Local directories a container must see at the same path: staging, and a file:// store."""
    dirs = [str(uris.to_local_path(cfg.pipeline.staging_uri))]
    if uris.is_local(cfg.pipeline.store_uri):
        dirs.append(str(uris.to_local_path(cfg.pipeline.store_uri)))
    return dirs


def hub_cache_env(cfg: Config) -> dict[str, str]:
    """Containers resolve hub model ids from a cache on the shared staging volume, filled before the
    trainer goes offline (`training.prefetch`-style: `huggingface_hub.snapshot_download`)."""
    return {"HF_HOME": str(uris.to_local_path(cfg.pipeline.staging_uri) / "hf-home")}


# --------------------------------------------------------------------------------------- local


def local_env(cfg: Config, settings: DeploySettings, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The local trainer's environment: the allowlist of the worker's own, plus credentials."""
    environ = os.environ if environ is None else environ
    allowed = set(ENV_ALLOWLIST) | set(settings.env_passthrough)
    env = {k: v for k, v in environ.items() if k in allowed or k.startswith(ENV_ALLOWED_PREFIXES)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(trainer_env(cfg))
    env.update(store_credentials(cfg))
    return env


def local_command(plan: RunPlan, settings: DeploySettings) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    return agent_argv(plan, settings, launcher=torchrun, nproc=settings.local_nproc_per_node)


class LocalTrainProcess:
    """The agent as a subprocess of the task, output streamed into the task log, under a watchdog
    (`watchdog.py`): the watchdog is a child subreaper with a parent-death signal, so every rank
    dies with the task even when the task is SIGKILLed, and `on_kill` ends the whole tree."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: str, log: Any, grace_s: float = 30):
        self.command, self.env, self.cwd, self.log, self.grace_s = command, env, cwd, log, grace_s
        self._proc: subprocess.Popen[str] | None = None

    def watched_command(self) -> list[str]:
        watchdog = str(Path(__file__).with_name("watchdog.py"))
        return [sys.executable, watchdog, "--parent", str(os.getpid()), "--grace", str(self.grace_s), "--",
                *self.command]

    def execute(self, context: Any = None) -> None:
        self.log.info("launching: %s", " ".join(self.command))
        self._proc = subprocess.Popen(
            self.watched_command(), cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True, preexec_fn=_die_with_parent,
        )
        tail: list[str] = []
        errors: list[str] = []  # torchrun's own summary hides the ranks' exceptions: keep them
        if self._proc.stdout is None:  # Popen was asked for a pipe: never, but never silently
            raise RuntimeError("training launcher: the agent's stdout pipe is missing")
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

    def on_kill(self, grace_s: float | None = None) -> None:
        """SIGTERM the watchdog: it forwards to the agent (which stops its ranks) and SIGKILLs every
        remaining descendant after its grace period; SIGKILL the watchdog's group if it hangs."""
        if self._proc is None or self._proc.poll() is not None:
            return
        grace = self.grace_s if grace_s is None else grace_s
        os.kill(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=grace + 10)
        except subprocess.TimeoutExpired:  # the watchdog hangs: end its tree from here
            from plugins.mft_airflow.watchdog import descendants

            for pid in [*descendants(self._proc.pid), self._proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._proc.wait()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the task process dies (Linux); the watchdog turns it
    into the end of every descendant."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# ---------------------------------------------------------------------------- docker / kubernetes


def container_command(plan: RunPlan, settings: DeploySettings) -> list[str]:
    return agent_argv(plan, settings, launcher=["torchrun"], nproc=settings.procs_per_node())


def kubernetes_command(plan: RunPlan, settings: DeploySettings, job_name: str, service: str) -> list[str]:
    """Every pod of the indexed Job runs one agent; the index-0 pod hosts the rendezvous, reached by
    its stable DNS name through the headless Service; the node rank is the completion index."""
    endpoint = f"{job_name}-0.{service}:{settings.rdzv_port}"
    return agent_argv(plan, settings, launcher=["torchrun"], nproc=settings.procs_per_node(),
                      node_rank="$(JOB_COMPLETION_INDEX)", rdzv_endpoint=endpoint)
