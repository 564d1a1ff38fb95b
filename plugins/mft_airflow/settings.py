"""Deployment settings of the Airflow side: how stages are launched, not what they compute.

What a stage computes lives in `pipeline_core.config` (one typed config, Params map onto it).
How it is launched (Spark connection and resources, image, GPUs, namespace, timeouts, schedule)
is a property of the deployment, read from environment variables `MFT_DEPLOY__<FIELD>` (values
parsed as YAML; `pipeline_core.settings_loader`, the loader `load_config` uses too). Reading the
environment is cheap, so the DAG file can do it at parse time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import date, datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline_core import settings_loader, uris
from pipeline_core.config import LOSSY_SPARK_SETTINGS, PROJECT_ROOT
from pipeline_core.settings_loader import PrefixedEnvSource, ValuesSource, yaml_value

ENV_PREFIX = "MFT_DEPLOY__"
Launcher = Literal["local", "docker", "kubernetes"]

# A Kubernetes resource quantity ("8", "0.5", "500m", "64Gi", "1e3"), as the API server parses it
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][-+]?[0-9]+)?$")
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "n": Decimal("1e-9"),
           "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "E": 10**18, None: 1}


def quantity_value(q: str) -> Decimal:
    """The number a Kubernetes quantity stands for (bytes, cores)."""
    m = _QUANTITY.match(q)
    if m is None:
        raise ValueError(f"{q!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    number, suffix = Decimal(m.group(1)), m.group(2)
    if suffix and suffix[0] in "eE" and len(suffix) > 1:
        return number * Decimal(10) ** int(suffix[1:])
    return number * Decimal(_SUFFIX[suffix])


def _as_quantity(v: Any) -> Any:
    """`MFT_DEPLOY__CPU_REQUEST=8` arrives as YAML's int 8: a quantity is its text."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = str(v)
    if isinstance(v, str):
        quantity_value(v)
    return v


Quantity = Annotated[str, BeforeValidator(_as_quantity)]


class DeploySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- the DAG
    config_file: str | None = Field(None, description="Base pipeline config (YAML/JSON); Params override it")
    schedule: str | None = Field("0 2 * * *", description="Cron or preset; nightly by default; None = manual only")
    start_date: str = "2026-01-01"
    max_active_runs: int = Field(1, ge=1)
    retries: int = Field(2, ge=0)
    retry_delay_s: int = Field(60, ge=1)
    max_retry_delay_s: int = Field(1800, ge=1)
    spark_timeout_min: int = Field(240, ge=1)
    train_timeout_min: int = Field(24 * 60, ge=1)
    publish_timeout_min: int = Field(30, ge=1)
    gpu_pool: str = "gpu"
    launcher: Launcher = Field("local", description="How the train task runs: a deployment property, not a trigger's")

    # --- Spark (SparkSubmitOperator; master and deploy mode come from the connection)
    spark_conn_id: str = "spark_default"
    spark_app_dir: str = str(PROJECT_ROOT / "spark_jobs")
    spark_executor_memory: str | None = None
    spark_executor_cores: int | None = None
    spark_driver_memory: str | None = "2g"
    spark_num_executors: int | None = None
    spark_py_files: str | None = Field(None, description="Comma-separated zips/eggs shipped to executors")
    spark_archives: str | None = Field(None, description="e.g. a packed venv: 'env.tar.gz#env'")
    spark_conf: dict[str, str] = Field(default_factory=dict)
    spark_python: str | None = Field(None, description="PYSPARK_PYTHON for driver and executors (default: this interpreter)")

    # --- training launchers
    train_module: str = "training.train"
    local_nproc_per_node: int = Field(
        2, ge=1, description="torchrun processes: local launcher, and containers without GPUs (CPU ranks)")
    image: str = "mistral-finetune:latest"
    gpus: int = Field(8, ge=0, description="GPUs per training container/pod")
    gpu_resource: str = "nvidia.com/gpu"
    shm_size_gb: int = Field(64, ge=1)
    docker_url: str = "unix://var/run/docker.sock"
    docker_network: str | None = None
    shared_volume: str | None = Field(
        None, description="Host dir (docker) holding pipeline.staging_uri, mounted at the same path"
    )
    namespace: str = "default"
    service_account: str | None = None
    staging_pvc: str | None = Field(None, description="PVC (kubernetes) holding pipeline.staging_uri")
    s3_secret: str | None = Field(
        None, description="Kubernetes Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the store"
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    cpu_request: Quantity | None = Field("8", description="CPU request per training pod (kubernetes)")
    memory_request: Quantity | None = Field("64Gi", description="Memory request per training pod (kubernetes)")
    memory_limit: Quantity | None = Field(None, description="Memory limit per training pod (kubernetes); None = none")

    # --- several nodes (one torchrun agent per node, a shared c10d rendezvous)
    nnodes: int = Field(1, ge=1, le=4096, description="Training nodes; kubernetes: pods of the indexed Job")
    node_rank: int = Field(0, ge=0, description="This worker's node (local/docker launchers with nnodes > 1)")
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the c10d rendezvous (local/docker with nnodes > 1); kubernetes: derived")
    rdzv_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port (kubernetes: on the index-0 pod)")
    hostfile: str | None = Field(
        None, description="DeepSpeed hostfile (local launcher): `deepspeed --hostfile` starts every node over SSH")

    # --- least secret
    env_passthrough: tuple[str, ...] = Field(
        (), description="Extra worker environment variables the local launcher passes to torchrun (names)")
    credentials_file: str | None = Field(
        None, description="docker: host path of an AWS shared-credentials file (a Docker secret), mounted read-only")

    # --- what a trigger may choose (issue 26.5, 26.8b; docs/orchestration.md "Trigger policy"). The
    # deployment's own config values are always allowed; a trigger's other values must be listed here.
    allowed_source_prefixes: tuple[str, ...] = Field(
        default_factory=lambda: (uris.qualify(PROJECT_ROOT / "sample_data"),),
        description="URI prefixes a trigger's source_uri may name (whole path components); default: the embedded sample")
    allowed_base_models: tuple[str, ...] = Field(
        ("tiny",), description="base_model values a trigger may name: exact ids, or prefixes ending in '/' "
                               "(a hub organisation, a model directory); default: the embedded tiny model")
    force_promote_users: tuple[str, ...] = Field(
        (), description="Airflow user names whose triggers may set force_promote (the triggering user of the run); "
                        "empty: nobody, a forced promotion is then a deployment setting (release.force_promote)")

    @field_validator("spark_conf")
    @classmethod
    def _no_lossy_reads(cls, v: dict[str, str]) -> dict[str, str]:
        lossy = [k for k in LOSSY_SPARK_SETTINGS if str(v.get(k, "false")).strip().lower() == "true"]
        if lossy:
            raise ValueError(f"{lossy}=true would drop unreadable input files silently; set it in enrich.spark_conf "
                             "with enrich.accept_corrupt_file_loss, so the manifest records the rows lost per file")
        return v

    @field_validator("allowed_source_prefixes")
    @classmethod
    def _source_prefixes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(p if p.startswith("hf://") else uris.require_uri(p) for p in v)

    @model_validator(mode="after")
    def _multi_node(self) -> DeploySettings:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        if self.nnodes > 1 and self.launcher != "kubernetes" and not (self.rdzv_endpoint or self.hostfile):
            raise ValueError(f"nnodes={self.nnodes} with the {self.launcher} launcher needs rdzv_endpoint (host:port "
                             "of the rendezvous, one agent per node) or hostfile (DeepSpeed launcher over SSH)")
        if self.memory_limit and self.memory_request and \
                quantity_value(self.memory_limit) < quantity_value(self.memory_request):
            # the API server refuses such a pod ("must be less than or equal to memory limit")
            raise ValueError(f"memory_limit={self.memory_limit} is below memory_request={self.memory_request}: raise "
                             "MFT_DEPLOY__MEMORY_LIMIT or unset it")
        if self.hostfile and self.launcher != "local":
            raise ValueError("hostfile: only the local launcher starts nodes over SSH; containers use a rendezvous")
        return self

    def procs_per_node(self) -> int:
        """Ranks per node: one per GPU, else CPU ranks."""
        return self.gpus if self.launcher != "local" and self.gpus else self.local_nproc_per_node

    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node()


def _yaml_or_text(raw: str) -> Any:
    """A deployment value as YAML, else its text (`@daily`); a date-like value stays text (2026-01-01)."""
    try:
        value = yaml_value(raw)
    except yaml.YAMLError:
        return raw
    return raw if isinstance(value, (date, datetime)) else value


def load_settings(env: Mapping[str, str] | None = None, **overrides: Any) -> DeploySettings:
    """Settings from `env` (default `os.environ`): `MFT_CONFIG` < `MFT_DEPLOY__*` < keyword overrides."""
    env = os.environ if env is None else env
    sources = [ValuesSource(DeploySettings, {"config_file": env["MFT_CONFIG"]} if env.get("MFT_CONFIG") else {}),
               PrefixedEnvSource(DeploySettings, env, ENV_PREFIX, parse=_yaml_or_text),
               ValuesSource(DeploySettings, overrides)]
    try:
        return settings_loader.load(DeploySettings, sources)
    except ValidationError as e:
        fields = "; ".join(f"{ENV_PREFIX}{'.'.join(map(str, x['loc'])).upper()}: {x['msg']}" for x in e.errors())
        raise ValueError(f"invalid deployment settings: {fields}") from None
