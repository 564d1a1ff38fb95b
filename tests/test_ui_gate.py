"""The Airflow UI and the approval gate, for real: an API server on loopback (SQLite,
SimpleAuthManager), the DAG serialized from dags/, the system Chromium through Playwright.

- the trigger form of `mistral_finetune`: an invalid value is refused naming the param and starts
  nothing; a valid one starts a run with that conf;
- the approval gate under `airflow dags test` sharing the API server's database: the request is
  open in the Required Actions page with the report's headline and link visible (the docs'
  screenshot); the DAG run's note links the report; Reject (with a reason, answered through the
  HITL REST API, what that page calls) skips train and publish and records why; Approve trains and
  publishes.
The data comes from the bundled sample through the real enrich + filter stages (committed once;
the gated runs use `stages: ["train"]`, so they start at the data report).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
import yaml

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest
from pipeline_core.pointers import read_pointer
from plugins.mft_airflow.report_links import report_view_url
from reports.data_report import report_page_uri, report_uri
from tests.browser import browser_page, keep_screenshot, require_chromium
from tests.conftest import free_port
from tests.dag_helpers import BIN, DAG_ID, REPO, airflow, airflow_env, init_db
from tests.report_helpers import build_sample

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TINY_TRAIN = {"steps": 1, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "checkpoint_every": 1,
              "keep_last": 1, "precision": "fp32", "eval_batches": 1, "warmup_steps": 1}


class ApiServer:
    def __init__(self, root: Path, base_config: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = airflow_env(root / "home", {
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API_AUTH__JWT_SECRET": "test-jwt-secret-0123456789abcdef-0123456789abcdef-0123456789ab",
            "AIRFLOW__API__SECRET_KEY": "test-secret-key",
            # no scheduler runs here, so nothing starts by itself; `dags test` needs a start date in the past
            "MFT_DEPLOY__START_DATE": "2026-01-01",
            "MFT_DEPLOY__RETRIES": "0",
            "MFT_DEPLOY__SPARK_CONF": json.dumps({"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"}),
            "MFT_CONFIG": str(base_config),
            # what data_report PATCHes the DAG run's note through (all-admins: no login needed)
            "AIRFLOW_CONN_MFT_AIRFLOW_API": json.dumps({"conn_type": "http", "host": self.url}),
        })
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        init_db(self.env)
        airflow(["dags", "reserialize"], self.env, timeout=600)
        self.log = open(self.root / "api-server.log", "w")
        self.proc = subprocess.Popen([str(BIN / "airflow"), "api-server", "--host", "127.0.0.1", "--port",
                                      str(self.port), "--workers", "1"], env=self.env, cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.wait(lambda: requests.get(f"{self.url}/api/v2/monitor/health", timeout=10).ok, 300, "API server")
        token = requests.get(f"{self.url}/auth/token", timeout=30).json()["access_token"]
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def wait(self, ok, timeout: float, what: str):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise AssertionError(f"api-server exited\n{(self.root / 'api-server.log').read_text()[-3000:]}")
            try:
                got = ok()
                if got:
                    return got
            except requests.RequestException:
                pass
            time.sleep(2)
        raise AssertionError(f"timed out waiting for {what}")

    def runs(self) -> list[dict]:
        return self.http.get(f"{self.url}/api/v2/dags/{DAG_ID}/dagRuns", timeout=30).json()["dag_runs"]

    def run(self, run_id: str) -> dict:
        return self.http.get(f"{self.url}/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}", timeout=30).json()

    def hitl(self) -> list[dict]:
        r = self.http.get(f"{self.url}/api/v2/dags/~/dagRuns/~/hitlDetails", timeout=30)
        return r.json()["hitl_details"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_chromium()
    root = tmp_path_factory.mktemp("ui_gate")
    art = build_sample(uris.qualify(root / "store"), root / "staging")
    cfg = art.cfg.model_dump(mode="json")
    cfg["train"].update(TINY_TRAIN)
    cfg["release"]["eval_max_rows"] = 4
    base = root / "base.yaml"
    base.write_text(yaml.safe_dump(cfg))
    server = ApiServer(root, base)
    server.start()
    try:
        yield server, art
    finally:
        server.stop()


def test_trigger_form_refuses_an_invalid_value_and_starts_a_valid_run(setup, tmp_path):
    server, _ = setup
    before = {r["dag_run_id"] for r in server.runs()}
    with browser_page(1400, 1000) as page:
        page.goto(f"{server.url}/dags/{DAG_ID}", wait_until="networkidle", timeout=180_000)
        page.get_by_role("button", name="Trigger").first.click()
        form = page.locator("[role=dialog][data-state=open]")
        form.wait_for(timeout=60_000)
        form.locator("[name=element_dataset_version]").fill("sample")
        form.locator("[name=element_run_id]").fill("bad/../id")
        form.get_by_role("button", name="Trigger").click()
        refused = page.get_by_text("Invalid input for param run_id")
        refused.wait_for(timeout=60_000)
        refused.scroll_into_view_if_needed()
        keep_screenshot(page, "trigger-form-invalid.png", tmp_path, full_page=False)
        assert {r["dag_run_id"] for r in server.runs()} == before  # refused: nothing started
        page.mouse.move(5, 5)  # a hovered toast stays (and covers the button); let it go
        page.locator("[data-scope=toast][data-part=root]").first.wait_for(state="hidden", timeout=60_000)
        form.locator("[name=element_run_id]").fill("ui-form-run")
        form.get_by_role("button", name="Trigger").click()
        new = server.wait(lambda: [r for r in server.runs() if r["dag_run_id"] not in before], 120, "the new run")
    assert len(new) == 1
    assert new[0]["conf"]["run_id"] == "ui-form-run" and new[0]["conf"]["dataset_version"] == "sample"


def _gated_run(server, art, run_id: str, choice: str, reason: str, tmp_path):
    conf = {"dataset_version": "sample", "run_id": run_id, "stages": ["train"], "require_approval": True}
    log = open(tmp_path / f"dags-test-{run_id}.log", "w")
    proc = subprocess.Popen([str(BIN / "airflow"), "dags", "test", DAG_ID, "-c", json.dumps(conf)], env=server.env,
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        detail = server.wait(lambda: next((d for d in server.hitl() if d["subject"].startswith(f"Train {run_id} ")),
                                          None), 1800, f"the approval request of {run_id}")
        assert "sample" in detail["subject"] and "Data report" in detail["body"] and "packing efficiency" in detail["body"]
        ti = detail["task_instance"]
        page_uri = report_page_uri(read_manifest(report_uri(art.train_ready_uri)))
        assert page_uri in detail["body"]
        note = server.run(ti["dag_run_id"])["note"] or ""  # set by data_report, before the gate waits
        view = report_view_url(server.url, DAG_ID, ti["dag_run_id"])
        assert f"[{page_uri}]({view})" in note, note  # the store's URI as text, the API server's copy as target
        _open_served_report(server, ti["dag_run_id"], view, page_uri, tmp_path)
        _show_request(server, ti, detail["subject"], tmp_path)
        r = server.http.patch(
            f"{server.url}/api/v2/dags/{DAG_ID}/dagRuns/{ti['dag_run_id']}/taskInstances/approve/-1/hitlDetails",
            json={"chosen_options": [choice], "params_input": {"reason": reason}}, timeout=60)
        assert r.status_code == 200, r.text
        proc.wait(timeout=2400)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / f"dags-test-{run_id}.log").read_text()
    # the gate is the provider's operator itself, not one nested in ours: the Task SDK's safeguard never fires
    assert "cannot be called outside of the Task Runner" not in out
    states = airflow(["tasks", "states-for-dag-run", DAG_ID, ti["dag_run_id"], "-o", "json"], server.env, timeout=300)
    rows = json.loads(states.stdout[states.stdout.index("["):])
    return {row["task_id"]: row["state"] for row in rows}, out


def _open_served_report(server, run_id: str, view: str, page_uri: str, tmp_path: Path) -> None:
    """The note's link is served by the plugin (plugins/mft_reports_plugin.py): byte for byte the
    committed page, only files of the run's committed report; and the run's "Data report" tab
    shows it in the UI."""
    committed = uris.to_local_path(page_uri).read_bytes()
    r = server.http.get(view, timeout=60)
    assert r.status_code == 200 and r.content == committed and r.headers["content-type"].startswith("text/html")
    # (who may read it is checked where users sign in: tests/test_dag_server.py; here all are admins)
    base = view.rsplit("/data/", 1)[0]
    for path in ("_manifest.json", "data/%2E%2E/_manifest.json", "data/nothing.html"):
        assert server.http.get(f"{base}/{path}", timeout=30).status_code == 404, path  # only the listed files
    other = report_view_url(server.url, DAG_ID, "no-such-run")
    assert server.http.get(other, timeout=30).status_code == 404
    with browser_page(1400, 1100) as page:
        run = quote(run_id, safe="")
        page.goto(f"{server.url}/dags/{DAG_ID}/runs/{run}/plugin/data-report", wait_until="networkidle",
                  timeout=180_000)
        frame = page.frame_locator("iframe").first
        frame.get_by_role("heading", name="Data report", exact=False).first.wait_for(state="visible",
                                                                                     timeout=120_000)
        charts = frame.locator("img")
        assert charts.count() >= 5
        keep_screenshot(page, "data-report-tab.png", tmp_path, full_page=False)


def _show_request(server, ti: dict, subject: str, tmp_path: Path) -> None:
    """The request as a reviewer sees it: its page under the task instance, subject and headline
    rendered and visible (not only in the DOM) before the screenshot is taken."""
    run = quote(ti["dag_run_id"], safe="")
    with browser_page(1400, 1100) as page:
        page.goto(f"{server.url}/dags/{DAG_ID}/runs/{run}/tasks/approve/required_actions",
                  wait_until="networkidle", timeout=180_000)
        for text in (subject, "records in → enriched → kept", "packing efficiency", "val documents"):
            page.get_by_text(text, exact=False).first.wait_for(state="visible", timeout=120_000)
        for name in ("Approve", "Reject"):
            assert page.get_by_role("button", name=name).first.is_visible(), name
        assert page.get_by_text("Data report", exact=False).first.is_visible()
        keep_screenshot(page, "approval-gate.png", tmp_path, full_page=False)


def _approval(art, run_id: str) -> dict:
    path = uris.to_local_path(uris.join(art.cfg.pipeline.store_uri, "runs", run_id, "approval.json"))
    return json.loads(path.read_text())


def test_reject_ends_the_run_without_training_and_records_why(setup, tmp_path):
    server, art = setup
    states, out = _gated_run(server, art, "gate-reject", "Reject", "near-duplicate rate too high", tmp_path)
    assert states["data_report"] == "success" and states["approve"] == "success", (states, out[-4000:])
    assert states["train"] == "skipped" and states["publish"] == "skipped", states
    rec = _approval(art, "gate-reject")
    assert rec["decision"] == "rejected" and rec["reason"] == "near-duplicate rate too high"
    assert read_manifest(uris.join(art.cfg.pipeline.store_uri, "runs", "gate-reject", "model")) is None
    # the report the run's data_report task committed, as the gate's link opens it
    with browser_page() as page:
        page.goto(report_page_uri(read_manifest(report_uri(art.train_ready_uri))))
        widths = page.evaluate("[...document.images].map(i => i.naturalWidth)")
        keep_screenshot(page, "data-report.png", tmp_path)
    assert len(widths) == 5 and min(widths) > 0


def test_approve_trains_and_publishes(setup, tmp_path):
    server, art = setup
    states, out = _gated_run(server, art, "gate-approve", "Approve", "looks good", tmp_path)
    assert states["train"] == "success" and states["publish"] == "success", (states, out[-6000:])
    assert _approval(art, "gate-approve")["decision"] == "approved"
    models = uris.join(art.cfg.pipeline.store_uri, "models")
    assert read_pointer(models).target == uris.join(art.cfg.pipeline.store_uri, "runs", "gate-approve", "model")
