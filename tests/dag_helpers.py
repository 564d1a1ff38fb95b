"""Helpers for the DAG tests: an isolated Airflow home (SQLite) per test session, the Airflow CLI
in subprocesses, a throw-away PostgreSQL cluster, and the task context an operator gets from the
Task Runner (its `ti` and `outlet_events`) for tests that call an operator without a scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DAG_ID = "mistral_finetune"


def airflow_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for Airflow processes: own AIRFLOW_HOME, our dags/ and plugins/, no examples,
    local Spark through `spark_default`, CPU DeepSpeed with the repo's compiled-op cache."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MFT__", "MFT_DEPLOY__"))}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"),
    })
    env.update(extra or {})
    return env


def airflow(args: list[str], env: dict[str, str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "airflow"), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"airflow {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}")
    return proc


def init_db(env: dict[str, str]) -> None:
    airflow(["db", "migrate"], env, timeout=300)
    airflow(["pools", "set", "gpu", "1", "concurrent training runs"], env, timeout=120)


class FakeTI:
    """The task instance as an operator sees it: `xcom_pull` of the `resolve` task's plan."""

    dag_id, task_id, map_index, try_number = DAG_ID, "train", -1, 1

    def __init__(self, plan):
        self.plan = plan
        self.pushed: dict[str, object] = {}

    def xcom_pull(self, task_ids):
        assert task_ids == "resolve"
        return self.plan

    def xcom_push(self, key, value):
        self.pushed[key] = value


class FakeAccessor:
    """One outlet's event accessor: records what `add` was given."""

    def __init__(self):
        self.added = []

    def add(self, asset, extra=None):
        self.added.append((asset, extra))


class FakeOutletEvents(dict):
    def __missing__(self, key):
        self[key] = FakeAccessor()
        return self[key]


def task_context(plan) -> dict:
    """The context keys the stage operators read: `ti` and `outlet_events`."""
    return {"ti": FakeTI(plan), "outlet_events": FakeOutletEvents()}


PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PostgresCluster:
    """A throw-away PostgreSQL cluster on a loopback port (`initdb` + `pg_ctl`), the metadata
    database of the multi-component tests: Airflow supports one SQLite file for one process only.
    As root, the server runs as `nobody` (PostgreSQL refuses to run as root)."""

    def __init__(self, port: int):
        import tempfile

        self.port = port
        # not under pytest's tmp dir: its 0700 parents would lock the unprivileged server out
        self.root = Path(tempfile.mkdtemp(prefix="mft-pg-"))
        self.root.chmod(0o755)
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.url = f"postgresql+psycopg2://airflow@127.0.0.1:{port}/airflow"

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "nobody", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True, cwd=self.root)

    def start(self) -> PostgresCluster:
        if os.geteuid() == 0:
            import pwd

            nobody = pwd.getpwnam("nobody")
            for p in (self.root,):
                os.chown(p, nobody.pw_uid, nobody.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "airflow", "--auth=trust", "-E", "UTF8", "--no-sync")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start", "-o",
                  f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{self.root}' "
                  "-c fsync=off -c max_connections=200")
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="airflow", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute("CREATE DATABASE airflow")
        return self

    def stop(self) -> None:
        import shutil

        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        except subprocess.CalledProcessError:
            pass
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
