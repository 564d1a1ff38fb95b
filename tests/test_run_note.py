"""The DAG run's note (`report_task.set_run_note` through `hooks.AirflowApiHook`, the http
provider's `HttpHook`) against a real HTTP server on loopback that speaks the two calls of
Airflow's public API it uses: a token from `/auth/token`, then `PATCH .../dagRuns/<run>?update_mask=note`
with that token. The full signed-in API server is exercised in tests/test_dag_server.py (slow)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from plugins.mft_airflow.report_task import set_run_note

USER, PASSWORD, TOKEN = "bot", "s3cret", "jwt-for-bot"
ADMIN_TOKEN = "jwt-all-admins"
LOG = logging.getLogger("test-run-note")


class _Api(BaseHTTPRequestHandler):
    notes: dict[str, str]
    seen: list[tuple[str, str, str | None]]

    def log_message(self, *_: object) -> None:
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")

    def do_GET(self) -> None:  # the simple auth manager's all-admins mode hands out a token
        self.seen.append(("GET", self.path, self.headers.get("Authorization")))
        self._reply(200, {"access_token": ADMIN_TOKEN}) if self.path == "/auth/token" else self._reply(404, {})

    def do_POST(self) -> None:
        self.seen.append(("POST", self.path, self.headers.get("Authorization")))
        body = self._body()
        if self.path != "/auth/token":
            return self._reply(404, {})
        if (body.get("username"), body.get("password")) != (USER, PASSWORD):
            return self._reply(401, {"detail": "Invalid credentials"})
        self._reply(201, {"access_token": TOKEN})

    def do_PATCH(self) -> None:
        auth = self.headers.get("Authorization")
        self.seen.append(("PATCH", self.path, auth))
        url = urlsplit(self.path)
        if auth not in (f"Bearer {TOKEN}", f"Bearer {ADMIN_TOKEN}"):
            return self._reply(401, {"detail": "Not authenticated"})
        if parse_qs(url.query).get("update_mask") != ["note"] or not url.path.startswith("/api/v2/dags/"):
            return self._reply(400, {"detail": "bad request"})
        self.notes[url.path] = self._body()["note"]
        self._reply(200, {"note": self.notes[url.path]})


@pytest.fixture()
def api():
    handler = type("Api", (_Api,), {"notes": {}, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _conn(monkeypatch, name: str, host: str, login: str | None = None, password: str | None = None) -> str:
    conn = {"conn_type": "http", "host": host} | ({"login": login, "password": password} if login else {})
    monkeypatch.setenv(f"AIRFLOW_CONN_{name.upper()}", json.dumps(conn))
    return name


def test_the_note_is_set_with_a_token_bought_by_the_connections_login(api, monkeypatch):
    handler, url = api
    assert set_run_note(_conn(monkeypatch, "mft_note_bot", url, USER, PASSWORD), "dag", "run-1", "**Data report**: x",
                        LOG) is True
    assert handler.notes == {"/api/v2/dags/dag/dagRuns/run-1": "**Data report**: x"}
    # the login and password go to /auth/token only: never as Basic auth on any call
    assert [(m, p.split("?")[0], a) for m, p, a in handler.seen] == [
        ("POST", "/auth/token", None), ("PATCH", "/api/v2/dags/dag/dagRuns/run-1", f"Bearer {TOKEN}")]


def test_without_a_login_the_all_admins_token_is_used(api, monkeypatch):
    handler, url = api
    assert set_run_note(_conn(monkeypatch, "mft_note_dev", url), "dag", "run-2", "note", LOG) is True
    assert handler.notes == {"/api/v2/dags/dag/dagRuns/run-2": "note"}
    assert handler.seen[0][:2] == ("GET", "/auth/token")


def test_a_refusal_a_missing_connection_or_a_dead_server_leave_the_note_alone(api, monkeypatch, caplog):
    handler, url = api
    caplog.set_level(logging.INFO, logger=LOG.name)
    assert set_run_note(_conn(monkeypatch, "mft_note_wrong", url, USER, "wrong"), "dag", "run-3", "n", LOG) is False
    assert handler.notes == {} and [m for m, _, _ in handler.seen] == ["POST"]  # no PATCH without a token
    assert "refused or failed" in caplog.text and "401" in caplog.text
    assert set_run_note("mft_note_missing", "dag", "run-3", "n", LOG) is False
    assert "no connection 'mft_note_missing'" in caplog.text
    dead = _conn(monkeypatch, "mft_note_dead", "http://127.0.0.1:9", USER, PASSWORD)  # discard port: refused
    assert set_run_note(dead, "dag", "run-3", "n", LOG) is False
    assert handler.notes == {}
