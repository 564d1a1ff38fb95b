"""The compose stack for real (`make image-test`): docker-compose.yaml + docker-compose.ci.yaml
brings up PostgreSQL, the S3 server, Spark master + worker and Airflow's API server, scheduler,
DAG processor and triggerer from the built images, with host networking and every server on
127.0.0.1; `mistral_finetune` is triggered through the REST API as the authenticated admin and
must succeed, with its artifacts in the S3 server; `docker compose down -v` must leave no
container, volume or network behind. Skipped without a built image."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests._deploy_support import (
    COMPOSE_FILE,
    IMAGE_UID,
    REPO,
    clean_env,
    compose_binary,
    docker_cli,
    free_port,
    image_under_test,
)

CI_FILE = REPO / "docker-compose.ci.yaml"
PROJECT = "mft-ci"
PORTS = ("API", "PG", "S3", "SPARK", "SPARK_UI", "SPARK_WORKER_UI", "SCHEDULER_HEALTH")
# the e2e test's tiny run (tests/test_dag_e2e.py): whole conversations of the sample fit in 512
# tokens; training is the deployment's `local` launcher on CPU (MFT_LAUNCHER in the env file)
CONF = {
    "dataset_version": "ci", "base_model": "tiny", "steps": 2, "seq_len": 512, "learning_rate": 1e-3,
    "config_overrides": {"train.precision": "fp32", "train.micro_batch_size": 1,
                         "train.gradient_accumulation_steps": 1, "train.warmup_steps": 1,
                         "train.checkpoint_every": 1, "train.keep_last": 1, "train.eval_batches": 1,
                         "enrich.shuffle_partitions": 2},
}
# generous: on the shared 2-core machine at load 20-35 the stack took 4-10 min to become healthy
UP_TIMEOUT_S = int(os.environ.get("MFT_STACK_UP_TIMEOUT_S", "1800"))
RUN_TIMEOUT_S = int(os.environ.get("MFT_STACK_RUN_TIMEOUT_S", "3600"))
pytestmark = [pytest.mark.skipif(image_under_test() is None, reason="needs a built image: make image-test"),
              pytest.mark.timeout(UP_TIMEOUT_S + RUN_TIMEOUT_S + 1200)]  # + compose up/down, parsing


class Stack:
    def __init__(self, root: Path):
        self.root = root
        self.env_file = root / "ci.env"
        self.staging = root / "staging"
        self.ports = {name: free_port() for name in PORTS}

    def write_env(self) -> dict[str, str]:
        """deploy/init-env.sh's fresh secrets + the CI settings (ports, images, CPU training)."""
        generated = self.root / "generated.env"
        subprocess.run([str(REPO / "deploy" / "init-env.sh"), str(generated)], check=True, capture_output=True, timeout=60)
        values = dict(line.split("=", 1) for line in generated.read_text().splitlines()
                      if line and not line.startswith("#"))
        self.staging.mkdir(mode=0o2775)
        values.update({
            "MFT_IMAGE": image_under_test(), "MFT_STAGING_DIR": str(self.staging),
            "MFT_CI_POSTGRES_IMAGE": os.environ.get("MFT_TEST_POSTGRES_IMAGE", "mft-postgres:ci"),
            "MFT_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.ports['S3']}",
            "MFT_LAUNCHER": "local", "MFT_DS_ACCELERATOR": "cpu", "MFT_MLFLOW_URI": "",
            "SPARK_WORKER_CORES": "2", "SPARK_WORKER_MEMORY": "2g",
            **{f"MFT_CI_{k}_PORT": str(v) for k, v in self.ports.items()},
        })
        if Path("/var/run/docker.sock").exists():
            values["DOCKER_GID"] = str(Path("/var/run/docker.sock").stat().st_gid)
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        self.env_file.chmod(0o600)
        self.values = values
        return values

    def compose(self, *args: str, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(compose_binary()), "-p", PROJECT, "--project-directory", str(REPO), "-f", str(COMPOSE_FILE),
               "-f", str(CI_FILE), "--env-file", str(self.env_file), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())
        if check:
            assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    def api(self, method: str, path: str, body: dict | None = None, token: str | None = None) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.ports['API']}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"{}")

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", timeout=120, check=False).stdout[-20000:]


def _leftovers() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    out = {}
    for kind, cmd in (("containers", ["ps", "-aq"]), ("volumes", ["volume", "ls", "-q"]),
                      ("networks", ["network", "ls", "-q"])):
        proc = subprocess.run([docker_cli(), *cmd, "--filter", label], capture_output=True, text=True, timeout=60)
        out[kind] = proc.stdout.split()
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    s.write_env()
    os.chown(s.staging, IMAGE_UID, 0)
    networks_before = subprocess.run([docker_cli(), "network", "ls", "-q"], capture_output=True, text=True).stdout.split()
    try:
        s.compose("up", "-d", "--no-build", "--pull", "never", timeout=900)
        s.networks_before = networks_before
        yield s
    finally:
        s.down = s.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout=600, check=False)
        shutil.rmtree(s.staging, ignore_errors=True)


def _wait_healthy(stack: Stack, deadline: float) -> None:
    want = {"postgres", "minio", "spark-master", "spark-worker", "airflow-apiserver", "airflow-scheduler",
            "airflow-dag-processor", "airflow-triggerer"}
    one_shot = {"minio-init", "staging-init", "airflow-init"}
    while True:
        rows = [json.loads(line) for line in stack.compose("ps", "-a", "--format", "json", timeout=60).stdout.splitlines()
                if line.strip()]
        state = {r["Service"]: r for r in rows}
        failed = [n for n in one_shot if n in state and state[n]["State"] == "exited" and state[n]["ExitCode"] != 0]
        assert not failed, f"one-shot services failed: {failed}\n{stack.logs()}"
        healthy = {n for n, r in state.items() if r["State"] == "running" and r.get("Health") in ("healthy", "")}
        done = {n for n in one_shot if n in state and state[n]["State"] == "exited"}
        if want <= healthy and done == one_shot:
            return
        assert time.monotonic() < deadline, f"not healthy: {sorted(want - healthy)}, one-shots done {sorted(done)}\n{stack.logs()}"
        time.sleep(5)


def test_stack_runs_the_dag_through_the_rest_api_and_leaves_nothing_behind(stack):
    _wait_healthy(stack, time.monotonic() + UP_TIMEOUT_S)
    # no bridge: every service shares the host's network namespace, nothing was created
    assert _leftovers()["networks"] == [], "compose created a network"
    # every listening socket of the stack is on loopback
    ss = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
    for port in stack.ports.values():
        addrs = [line.split()[3] for line in ss.splitlines() if line.split()[3].endswith(f":{port}")]
        assert addrs and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in addrs), (port, addrs)

    # authenticated: no token, no API
    with pytest.raises(urllib.error.HTTPError) as denied:
        stack.api("GET", "/api/v2/dags/mistral_finetune")
    assert denied.value.code == 401
    token = stack.api("POST", "/auth/token", {"username": stack.values["AIRFLOW_ADMIN_USER"],
                                              "password": stack.values["AIRFLOW_ADMIN_PASSWORD"]})["access_token"]
    deadline = time.monotonic() + 300
    while True:  # the DAG processor has to parse the file first
        try:
            stack.api("GET", "/api/v2/dags/mistral_finetune", token=token)
            break
        except urllib.error.HTTPError as e:
            assert e.code == 404 and time.monotonic() < deadline, f"DAG not parsed: {e}\n{stack.logs()}"
            time.sleep(5)
    # every component heartbeats (the CI override checks the DAG processor and triggerer here,
    # not with their CLI health checks)
    health = stack.api("GET", "/api/v2/monitor/health")
    for component in ("metadatabase", "scheduler", "dag_processor", "triggerer"):
        assert health[component]["status"] == "healthy", health
    errors = stack.api("GET", "/api/v2/importErrors", token=token)
    assert errors["total_entries"] == 0, errors
    stack.api("PATCH", "/api/v2/dags/mistral_finetune", {"is_paused": False}, token=token)
    run = stack.api("POST", "/api/v2/dags/mistral_finetune/dagRuns", {"logical_date": None, "conf": CONF}, token=token)

    deadline = time.monotonic() + RUN_TIMEOUT_S
    state = "queued"
    while True:
        try:
            state = stack.api("GET", f"/api/v2/dags/mistral_finetune/dagRuns/{run['dag_run_id']}", token=token)["state"]
        except (TimeoutError, ConnectionError, urllib.error.URLError) as e:  # an API server busy on 2 shared cores
            if isinstance(e, urllib.error.HTTPError) and e.code not in (502, 503, 504):
                raise
        if state in ("success", "failed"):
            break
        assert time.monotonic() < deadline, f"run still {state} after {RUN_TIMEOUT_S}s\n{stack.logs()}"
        time.sleep(10)
    # the stack schedules nothing of its own (no nightly run on unpause): the one run is the test's
    runs = stack.api("GET", "/api/v2/dags/mistral_finetune/dagRuns", token=token)["dag_runs"]
    assert [r["dag_run_id"] for r in runs] == [run["dag_run_id"]], runs
    tasks = stack.api("GET", f"/api/v2/dags/mistral_finetune/dagRuns/{run['dag_run_id']}/taskInstances", token=token)
    summary = {t["task_id"]: t["state"] for t in tasks["task_instances"]}
    assert state == "success", f"run {state}: {summary}\n{stack.logs()}"

    # the artifacts are in the S3 server, committed (manifest last)
    import boto3

    s3 = boto3.client("s3", endpoint_url=stack.values["MFT_S3_ENDPOINT_URL"],
                      aws_access_key_id=stack.values["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=stack.values["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=stack.values["MFT_BUCKET"])
            for o in page.get("Contents", [])]
    manifests = [k for k in keys if k.endswith("/_manifest.json")]
    for prefix in ("datasets/ci/enriched/", "datasets/ci/train/"):
        assert any(k.startswith(prefix) for k in manifests), (prefix, manifests)
    assert any(k.startswith("runs/") and k.endswith("/model/_manifest.json") for k in manifests), manifests

    # down -v: nothing left
    stack.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout=600)
    assert _leftovers() == {"containers": [], "volumes": [], "networks": []}
    after = subprocess.run([docker_cli(), "network", "ls", "-q"], capture_output=True, text=True).stdout.split()
    assert sorted(after) == sorted(stack.networks_before)
