"""The stack's commands run for real where they can without Docker: the Spark master and worker
start from the compose commands (loopback and free ports substituted for the service names),
answer their health checks, and the worker registers with the master URL the compose file gives
it. The API server's health check path is one the installed Airflow serves without auth."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests._deploy_support import compose_model, service_argv, venv_bin


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _swap(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def _get_json(url: str, deadline: float, procs: list[subprocess.Popen]) -> dict:
    last: Exception | None = None
    while time.monotonic() < deadline:
        dead = [p.args[1] for p in procs if p.poll() is not None]
        assert not dead, f"{dead} exited early"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except Exception as e:  # not up yet
            last = e
            time.sleep(1)
    raise AssertionError(f"{url} did not answer: {last}")


def _health_path(service: dict, port: int) -> str:
    test = service["healthcheck"]["test"]
    url = next(w for w in test if w.startswith("http://localhost:"))
    container_port = url.split(":")[2].split("/")[0]
    return url.replace(f"localhost:{container_port}", f"127.0.0.1:{port}")


@pytest.mark.slow
def test_spark_master_and_worker_start_and_register(tmp_path):
    services = compose_model()["services"]
    master_svc, worker_svc = services["spark-master"], services["spark-worker"]
    port, ui, wui = _free_port(), _free_port(), _free_port()
    spark_class = str(venv_bin("spark-class"))

    master = service_argv(master_svc)
    assert master[0] == "spark-class"
    master = _swap(_swap(_swap(master, "--host", "127.0.0.1"), "--port", str(port)), "--webui-port", str(ui))
    worker = service_argv(worker_svc)
    master_url = f"spark://{master_svc['command'][3]}:{master_svc['command'][5]}"
    assert master_url in worker, "the worker must join the master the compose file starts"
    worker[worker.index(master_url)] = f"spark://127.0.0.1:{port}"
    worker = _swap(_swap(_swap(worker, "--cores", "1"), "--memory", "512m"), "--webui-port", str(wui))
    worker += ["--work-dir", str(tmp_path / "work"), "--host", "127.0.0.1"]

    import pyspark

    # as in the image, SPARK_HOME points at the pyspark package (spark-class needs it)
    env = {**os.environ, "SPARK_HOME": str(Path(pyspark.__file__).parent), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(tmp_path),
           "SPARK_DAEMON_MEMORY": "256m", "SPARK_NO_DAEMONIZE": "true"}
    procs = []
    try:
        for argv, name in ((master, "master"), (worker, "worker")):
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen([spark_class, *argv[1:]], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + 150
        status = _get_json(_health_path(master_svc, ui), deadline, procs)
        _get_json(_health_path(worker_svc, wui), deadline, procs)  # the worker's health check answers
        # the master answers STANDBY until it has recovered, then ALIVE with the worker registered
        while time.monotonic() < deadline and (status["status"] != "ALIVE" or status.get("aliveworkers", 0) < 1):
            time.sleep(1)
            status = _get_json(_health_path(master_svc, ui), deadline, procs)
        assert status["status"] == "ALIVE" and status["url"] == f"spark://127.0.0.1:{port}", status
        assert status["aliveworkers"] == 1, status
        worker_status = _get_json(_health_path(worker_svc, wui), deadline, procs)
        assert worker_status["masterurl"] == f"spark://127.0.0.1:{port}", worker_status
    except AssertionError:
        for name in ("master", "worker"):
            print(name, (tmp_path / f"{name}.log").read_text()[-3000:])
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_api_server_health_check_is_public():
    import airflow.api_fastapi.core_api as core_api

    spec = yaml.safe_load((Path(core_api.__file__).parent / "openapi" / "v2-rest-api-generated.yaml").read_text())
    test = compose_model()["services"]["airflow-apiserver"]["healthcheck"]["test"]
    path = "/" + next(w for w in test if w.startswith("http://localhost:")).split("/", 3)[3]
    operation = spec["paths"][path]["get"]
    assert not operation.get("security"), f"{path} needs auth; a health check cannot log in"


def test_airflow_init_sets_the_admin_password_the_api_server_uses(tmp_path):
    """Run airflow-init's own script, as compose resolves it, with `airflow` stubbed (it records
    its arguments): the password file it writes is private (its own umask, nothing added here),
    it creates the pool the DAG's training tasks use; then the real SimpleAuthManager starts on
    that file: the admin keeps the password from .env (no generated one) and it is what login checks."""
    from plugins.mft_airflow.settings import load_settings

    services = compose_model()["services"]
    init = services["airflow-init"]
    assert init["command"][:2] == ["bash", "-ec"]
    target = init["environment"]["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]
    pw_file = tmp_path / "passwords.json"
    # `compose config` keeps `$$` escaped; the container gets a single `$`
    script = init["command"][2].replace("$$", "$").replace(target, str(pw_file))
    stubs, calls = tmp_path / "bin", tmp_path / "airflow-calls.jsonl"
    stubs.mkdir()
    (stubs / "airflow").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                   f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (stubs / "airflow").chmod(0o755)
    (stubs / "python").symlink_to(sys.executable)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path), "AIRFLOW_ADMIN_USER": "admin",
           "AIRFLOW_ADMIN_PASSWORD": "s3cret-from-env",
           "MFT_GPU_POOL_SLOTS": init["environment"]["MFT_GPU_POOL_SLOTS"]}
    subprocess.run(["bash", "-ec", script], env=env, check=True, timeout=60, cwd=tmp_path)
    assert oct(pw_file.stat().st_mode & 0o777) == "0o600"
    argvs = [json.loads(line) for line in calls.read_text().splitlines()]
    assert ["db", "migrate"] in argvs, argvs
    pools = [a for a in argvs if a[:2] == ["pools", "set"]]
    gpu_pool = load_settings(env=services["airflow-scheduler"]["environment"]).gpu_pool
    assert [a[2] for a in pools] == [gpu_pool], f"the DAG's training tasks use pool {gpu_pool!r}; init creates {pools}"
    assert int(pools[0][3]) >= 1

    api_env = services["airflow-apiserver"]["environment"]
    check = (
        "from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager as M\n"
        "m = M(); m.init()\n"
        "users = [u.username for u in M.get_users()]\n"
        "assert users == ['admin'], users\n"
        "assert M.get_passwords() == {'admin': 's3cret-from-env'}, M.get_passwords()\n"
    )
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path),
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": api_env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"],
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(pw_file)}
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
