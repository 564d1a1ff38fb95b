"""The DAG under a real Airflow: API server, scheduler (LocalExecutor) and DAG processor on
loopback, on a throw-away PostgreSQL cluster as production runs it (several Airflow components on
one SQLite file is unsupported and flaked with "database is locked"), SimpleAuthManager with a
known user.

- a manual trigger the way the UI does it: an authenticated POST of a conf to the REST API, the
  run waited for, its task states read back; unauthenticated requests are refused;
- a backfill over two logical dates: two dataset versions under their own prefixes.

The runs use a tiny generated source (~75 records) and run only the enrich stage (`stages` param),
so each costs one real spark-submit; the full pipeline is covered by tests/test_dag_e2e.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import requests
import yaml
from airflow.sdk.serde import deserialize

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest, verify_artifact
from plugins.mft_airflow.operators import StageResult  # noqa: F401  (registers the plan for deserialization)
from plugins.mft_airflow.report_links import report_view_url
from plugins.mft_airflow.run_plan import RunPlan
from tests.conftest import free_port
from tests.dag_helpers import BIN, DAG_ID, REPO, PostgresCluster, airflow, airflow_env, init_db

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # whole pipeline runs on 2 shared cores

USER, PASSWORD = "tester", "s3cret-pw"
VIEWER, VIEWER_PASSWORD = "watcher", "view-only-pw"


class AirflowStack:
    def __init__(self, root: Path, base_config: Path, database_url: str):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pw = root / "passwords.json"
        pw.write_text(json.dumps({USER: PASSWORD, VIEWER: VIEWER_PASSWORD}))
        self.env = airflow_env(root / "home", {
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "2",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin,{VIEWER}:viewer",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(pw),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API_AUTH__JWT_SECRET": "test-jwt-secret-0123456789abcdef",
            "AIRFLOW__API__SECRET_KEY": "test-secret-key",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # no scheduled run may start by itself during the test: the first one is far away;
            # backfills and manual runs are not bound by it
            "MFT_DEPLOY__START_DATE": "2099-01-01",
            "MFT_DEPLOY__RETRIES": "0",
            "MFT_DEPLOY__SPARK_CONF": json.dumps({"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}),
            "MFT_CONFIG": str(base_config),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database_url,
        })
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        init_db(self.env)
        for name, args in [("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(self.port),
                                           "--workers", "1"]),
                           ("scheduler", ["scheduler"]), ("dag-processor", ["dag-processor"])]:
            log = open(self.root / f"{name}.log", "w")
            self.procs.append(subprocess.Popen([str(BIN / "airflow"), *args], env=self.env, cwd=REPO, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        self.wait(lambda: requests.get(f"{self.url}/api/v2/monitor/health", timeout=5).ok, 180, "API server")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.root.glob("*.log")))

    def wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            dead = [p.args[1] for p in self.procs if p.poll() is not None]
            if dead:
                raise AssertionError(f"{dead} exited\n{self.logs()}")
            try:
                if ok():
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def token(self, user: str = USER, password: str = PASSWORD) -> str:
        r = requests.post(f"{self.url}/auth/token", json={"username": user, "password": password}, timeout=30)
        assert r.status_code in (200, 201), r.text
        return r.json()["access_token"]


@pytest.fixture(scope="module")
def postgres():
    pg = PostgresCluster(free_port()).start()
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, postgres):
    root = tmp_path_factory.mktemp("airflow_stack")
    src = root / "source"
    subprocess.run([str(BIN / "python"), "-m", "samples.nemotron_v1", "--output", str(src), "--rows", "40",
                    "--seed", "1"], check=True, cwd=REPO, capture_output=True, timeout=120)
    base = root / "base.yaml"
    base.write_text(json.dumps({
        "pipeline": {"source_uri": uris.qualify(src), "store_uri": uris.qualify(root / "store"),
                     "staging_uri": uris.qualify(root / "staging")},
        "enrich": {"shuffle_partitions": 2},
    }))
    s = AirflowStack(root, base, postgres.url)
    s.source_rows = sum(pq.read_metadata(f).num_rows for f in (src / "data").glob("*.parquet"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _api(stack, token: str | None):
    session = requests.Session()
    if token:
        session.headers["Authorization"] = f"Bearer {token}"
    return session


def _wait_for_dag(stack, api) -> None:
    try:
        stack.wait(lambda: api.get(f"{stack.url}/api/v2/dags/{DAG_ID}", timeout=10).status_code == 200, 240,
                   "the DAG processor to register the DAG")
    except AssertionError as e:
        errors = api.get(f"{stack.url}/api/v2/importErrors", timeout=10).text
        raise AssertionError(f"import errors: {errors}\n{e}") from None


def _wait_for_run(stack, api, run_id: str, timeout: float = 900) -> dict:
    state: dict = {}

    def done() -> bool:
        r = api.get(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}", timeout=10)
        state.update(r.json())
        return state.get("state") in ("success", "failed")

    stack.wait(done, timeout, f"dag run {run_id}")
    return state


def _task_states(stack, api, run_id: str) -> dict[str, str]:
    r = api.get(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", timeout=10)
    r.raise_for_status()
    return {t["task_id"]: t["state"] for t in r.json()["task_instances"]}


def test_rest_trigger_as_authenticated_user(stack):
    anon = _api(stack, None)
    # unauthenticated, or with a forged token, or a wrong password: refused
    assert anon.get(f"{stack.url}/api/v2/dags/{DAG_ID}", timeout=10).status_code == 401
    assert anon.post(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns", json={"logical_date": None}, timeout=10
                     ).status_code == 401
    assert _api(stack, "not-a-jwt").get(f"{stack.url}/api/v2/dags", timeout=10).status_code in (401, 403)
    assert requests.post(f"{stack.url}/auth/token", json={"username": USER, "password": "wrong"},
                         timeout=10).status_code in (401, 403)

    api = _api(stack, stack.token())
    _wait_for_dag(stack, api)
    # a viewer can read the DAG but not trigger it
    viewer = _api(stack, stack.token(VIEWER, VIEWER_PASSWORD))
    assert viewer.get(f"{stack.url}/api/v2/dags/{DAG_ID}", timeout=10).status_code == 200
    assert viewer.post(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns", json={"logical_date": None},
                       timeout=10).status_code == 403
    # a conf the form would refuse is refused by the API too, naming the param
    bad = api.post(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns",
                   json={"logical_date": None, "conf": {"seq_len": 8}}, timeout=30)
    assert bad.status_code == 400 and "seq_len" in bad.text

    r = api.post(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns", timeout=30, json={
        "dag_run_id": "ui-trigger-1", "logical_date": None,
        "conf": {"dataset_version": "ui-v1", "stages": ["enrich"], "relevance_threshold": 0.25},
    })
    assert r.status_code == 200, r.text
    run = _wait_for_run(stack, api, "ui-trigger-1")
    states = _task_states(stack, api, "ui-trigger-1")
    assert run["state"] == "success", f"{states}\n{stack.logs()}"
    assert states == {"resolve": "success", "enrich": "success", "filter": "skipped", "data_report": "skipped",
                      "approve": "skipped", "train": "skipped", "evaluate": "skipped", "publish": "skipped"}
    # the run's plan is readable through the API too, and the enriched artifact is committed
    x = api.get(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns/ui-trigger-1/taskInstances/resolve/xcomEntries/"
                "return_value", timeout=10)
    value = x.json()["value"]
    plan = deserialize(json.loads(value) if isinstance(value, str) else value)  # the typed plan, through XCom
    assert isinstance(plan, RunPlan) and plan.dataset_version == "ui-v1"
    assert yaml.safe_load(open(plan.config_file))["enrich"]["relevance_threshold"] == 0.25
    m = read_manifest(plan.enriched_uri)
    assert m is not None and m.counts["in"] == stack.source_rows
    # the served data report (plugins/mft_reports_plugin.py) asks Airflow who may read the run's
    # report first: anonymous or forged → refused; a viewer is told this run has none (no data_report)
    view = report_view_url(stack.url, DAG_ID, "ui-trigger-1")
    assert anon.get(view, timeout=30).status_code == 401
    assert _api(stack, "not-a-jwt").get(view, timeout=30).status_code in (401, 403)
    none = viewer.get(view, timeout=30)
    assert none.status_code == 404 and "has no data report" in none.text, none.text


def test_run_note_is_set_through_the_connection_with_login(stack, monkeypatch):
    """`data_report`'s note path as a deployment configures it: the `mft_airflow_api` connection
    with a user's login and password (a token from POST /auth/token), against the signed-in stack.
    A user who may not edit runs, or a wrong password, leaves the note alone and says why."""
    import logging

    from plugins.mft_airflow.report_task import set_run_note

    run_id = "ui-trigger-1"  # test_rest_trigger_as_authenticated_user's run
    api = _api(stack, stack.token())
    note_url = f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns/{run_id}"
    assert api.get(note_url, timeout=10).status_code == 200, "the trigger test's run is missing"

    def conn(name: str, login: str, password: str) -> str:
        monkeypatch.setenv(f"AIRFLOW_CONN_{name.upper()}", json.dumps(
            {"conn_type": "http", "host": stack.url, "login": login, "password": password}))
        return name

    log = logging.getLogger("test-note")
    assert set_run_note(conn("mft_note_viewer", VIEWER, VIEWER_PASSWORD), DAG_ID, run_id, "viewer's note", log) is False
    assert set_run_note(conn("mft_note_wrong", USER, "wrong"), DAG_ID, run_id, "wrong pw's note", log) is False
    assert api.get(note_url, timeout=10).json().get("note") in (None, "")
    assert set_run_note(conn("mft_note_bot", USER, PASSWORD), DAG_ID, run_id, "**Data report**: x", log) is True
    assert api.get(note_url, timeout=10).json()["note"] == "**Data report**: x"


def test_backfill_two_dates_two_dataset_versions(stack):
    api = _api(stack, stack.token())
    _wait_for_dag(stack, api)
    # nightly at 02:00: the window holds the runs of 2026-01-01 and 2026-01-02 (both ends inclusive)
    airflow(["backfill", "create", "--dag-id", DAG_ID, "--from-date", "2026-01-01T00:00:00+00:00",
             "--to-date", "2026-01-02T02:00:00+00:00",
             "--max-active-runs", "1", "--dag-run-conf", json.dumps({"stages": ["enrich"]})], stack.env, timeout=120)

    def backfill_runs() -> list[dict]:
        r = api.get(f"{stack.url}/api/v2/dags/{DAG_ID}/dagRuns", params={"run_type": "backfill"}, timeout=10)
        return [d for d in r.json()["dag_runs"] if d["run_type"] == "backfill"]

    stack.wait(lambda: len(backfill_runs()) == 2 and all(d["state"] in ("success", "failed") for d in backfill_runs()),
               1200, "the backfill's two runs")
    runs = backfill_runs()
    assert {d["state"] for d in runs} == {"success"}, stack.logs()
    store = stack.root / "store" / "datasets"
    versions = sorted(p.name for p in store.iterdir() if p.name.startswith("2026"))
    assert versions == ["20260101", "20260102"]  # one dataset version per logical date
    manifests = [read_manifest(uris.qualify(d)) for d in sorted(store.glob("2026010*/enriched/*"))]
    assert len(manifests) == 2 and all(m is not None and m.counts["in"] == stack.source_rows for m in manifests)
    # separate prefixes, and the first is intact after the second was written
    assert "/datasets/20260101/" in manifests[0].uri and "/datasets/20260102/" in manifests[1].uri
    assert manifests[0].created_at < manifests[1].created_at
    for m in manifests:
        verify_artifact(m.uri)  # every file still matches its manifest
