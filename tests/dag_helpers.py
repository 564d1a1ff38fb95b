"""Helpers for the DAG tests: an isolated Airflow home (SQLite) per test session, the Airflow CLI
in subprocesses, the committed artifacts a run produced."""

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
