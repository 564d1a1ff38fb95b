"""The data report task and the human approval gate (before training).

`DataReportOperator` runs the report stage (`reports.data_report.build`) in the worker: it reads
committed artifacts only and commits `datasets/<version>/report/<id>/`; its XCom (and the task's
"Data report" extra link) name the page, and so does the DAG run's note. A browser cannot open the
store's URI, so the links point at the API server's route for the run's report
(`report_views.py`, `report_links.py`, Airflow's `[api] base_url`) and the run page has a "Data report" tab. The Task SDK (Execution
API) can set a note only on a run it triggers, not on its own, so the note goes through the public
REST API (`PATCH /api/v2/dags/<dag>/dagRuns/<run>?update_mask=note`) with the deployment's HTTP
connection `mft_airflow_api` (host = the API server's base URL; login/password of a user allowed to
edit runs, none with the simple auth manager's all-admins mode). Without that connection the note
is left alone and the task says so: the link is in XCom and the approval request all the same.

`ApprovalGateOperator` is Airflow's own `ApprovalOperator` (standard provider, HITL, 3.1+), on only
when `release.require_approval` is set (the `require_approval` param; off by default, so scheduled
runs never wait). It shows the report's headline numbers and link in the Required Actions UI;
"Reject" skips train and publish, and the decision (who, when, the reason typed in the form) is
written to `runs/<run_id>/approval.json` and returned in XCom. It subclasses the provider's
operator (no operator nested inside another: the Task SDK warns about that in the task log).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.exceptions import AirflowSkipException

from plugins.mft_airflow.report_links import REPORT_TASK_ID, report_view_url
from plugins.mft_airflow.run_plan import RunPlan

APPROVAL_RECORD = "approval.json"
REASON = "reason"
API_CONN_ID = "mft_airflow_api"
NOTE_MARK = "**Data report**"
NOTE_MAX_CHARS = 1000  # Airflow's dag_run_note.content is String(1000); the API refuses longer notes


def _plan(context: Any) -> RunPlan:
    from plugins.mft_airflow.stage_base import pull_plan

    return pull_plan(context)


class DataReportLink(BaseOperatorLink):
    name = "Data report"

    def get_link(self, operator: BaseOperator, *, ti_key: Any) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        value = XCom.get_value(ti_key=ti_key, key="return_value") or {}
        return value.get("view") or value.get("page") or ""


class DataReportOperator(BaseOperator):
    """Commit the data report of the run's train-ready artifact (nothing to do when committed) and
    link it from the DAG run's note."""

    ui_color = "#fff7e0"
    operator_extra_links = (DataReportLink(),)

    def __init__(self, *, api_conn_id: str = API_CONN_ID, **kwargs: Any):
        super().__init__(**kwargs)
        self.api_conn_id = api_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from pipeline_core.artifacts import read_manifest
        from plugins.mft_airflow.plan import load_plan_config
        from reports.data_report import build, report_page_uri

        plan = _plan(context)
        storage = load_plan_config(plan).storage
        if not plan.runs("filter") and read_manifest(plan.train_ready_uri, storage) is None:
            raise AirflowSkipException(f"no train-ready artifact at {plan.train_ready_uri} to report on")
        m = build(plan.train_ready_uri, storage=storage)
        self._lineage = ([plan.train_ready_uri], [(m.uri, m)])
        dag_run = context["dag_run"]
        out = {"uri": m.uri, "page": report_page_uri(m), "headline": m.extra.get("headline"),
               "view": _view_url(dag_run.dag_id, dag_run.run_id)}
        self.log.info("data report: %s (in a browser: %s)", out["page"], out["view"] or "set [api] base_url")
        note = run_note(getattr(dag_run, "note", None), out)
        if note is not None:
            set_run_note(self.api_conn_id, dag_run.dag_id, dag_run.run_id, note, self.log)
        return out

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Input: the train-ready artifact; output: the committed report (issue 19: every operator)."""
        from plugins.mft_airflow.lineage import lineage

        return lineage(*self._lineage) if getattr(self, "_lineage", None) else None


def _view_url(dag_id: str, run_id: str) -> str | None:
    """The report's address in a browser (the plugin's route on the API server), when Airflow's
    `[api] base_url` says where users reach the UI; None otherwise (the links name the store URI)."""
    from airflow.sdk.configuration import conf

    base = conf.get("api", "base_url", fallback=None)
    return report_view_url(base, dag_id, run_id) if base else None


def _report_link(report: dict[str, Any]) -> str:
    """Markdown: the store URI as the text, the browser address as the target when there is one."""
    return f"[{report['page']}]({report.get('view') or report['page']})"


def run_note(current: str | None, report: dict[str, Any]) -> str | None:
    """The run's note with the report's link and headline appended; None when it already has them
    (a retry) -- a note a person wrote stays, above."""
    if current and report["page"] in current:
        return None
    h = report.get("headline") or {}
    eff = h.get("packing_efficiency")
    line = (f"{NOTE_MARK}: {_report_link(report)}  \n"
            f"{h.get('records_in')} records → {h.get('enriched')} enriched → {h.get('kept')} kept; "
            f"tokens {', '.join(f'{k} {v:,}' for k, v in sorted((h.get('tokens') or {}).items()))}"
            + (f"; packing {eff:.1%}" if isinstance(eff, float) else ""))
    both = f"{current.rstrip()}\n\n{line}" if current else line
    return both if len(both) <= NOTE_MAX_CHARS else line[:NOTE_MAX_CHARS]


def set_run_note(conn_id: str, dag_id: str, run_id: str, note: str, log: Any) -> bool:
    """PATCH the run's note through the public REST API; a missing connection or a refusal is
    logged, never fatal (the note is a convenience, the report is committed either way)."""
    import requests
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        log.info("no connection %r: the DAG run's note is not set (the report's link is in XCom)", conn_id)
        return False
    host = (conn.host or "").rstrip("/")
    base = host if "://" in host else f"{conn.schema or 'http'}://{host}" + (f":{conn.port}" if conn.port else "")
    try:
        if conn.login:
            r = requests.post(f"{base}/auth/token", json={"username": conn.login, "password": conn.password}, timeout=30)
        else:  # the simple auth manager's all-admins mode (development)
            r = requests.get(f"{base}/auth/token", timeout=30)
        r.raise_for_status()
        r = requests.patch(f"{base}/api/v2/dags/{dag_id}/dagRuns/{run_id}", params={"update_mask": "note"},
                           json={"note": note}, timeout=30,
                           headers={"Authorization": f"Bearer {r.json()['access_token']}"})
        r.raise_for_status()
    except (requests.RequestException, KeyError, ValueError) as e:
        log.warning("the DAG run's note is not set: %s via connection %r refused or failed: %s", base, conn_id, e)
        return False
    log.info("DAG run note links the data report")
    return True


def gate_text(plan: RunPlan, report: dict[str, Any] | None) -> tuple[str, str]:
    """(subject, Markdown body) of the approval request."""
    subject = f"Train {plan.run_id} on dataset {plan.dataset_version}?"
    if not report:
        return subject, f"No data report was committed for `{plan.train_ready_uri}`."
    h = report.get("headline") or {}
    rejected = ", ".join(f"{k} {v}" for k, v in sorted((h.get("rejected") or {}).items())) or "none"
    tokens = ", ".join(f"{k} {v:,}" for k, v in sorted((h.get("tokens") or {}).items()))
    eff = h.get("packing_efficiency")
    body = "\n".join([
        f"**Data report**: {_report_link(report)}",
        "",
        "| | |", "|---|---|",
        f"| records in → enriched → kept | {h.get('records_in')} → {h.get('enriched')} → {h.get('kept')} |",
        f"| rejected | {rejected} |",
        f"| tokens | {tokens} (seq_len {h.get('seq_len')}) |",
        f"| val documents | {h.get('val_documents')} |",
        f"| packing efficiency | {eff:.1%} |" if isinstance(eff, float) else "| packing efficiency | n/a |",
        "",
        f"Approve to train `{plan.run_id}` on `{plan.train_ready_uri}`; Reject ends the run without "
        "training (give the reason).",
    ])
    return subject, body


class ApprovalGateOperator(ApprovalOperator):
    """Approve / Reject before training, when `release.require_approval` is set: the provider's own
    operator (its `execute` waits for the human, its `execute_complete` validates the answer and,
    on Reject, skips everything downstream); this subclass only fills in the subject and body from
    the run's data report and records the decision."""

    ui_color = "#fde2e2"

    def __init__(self, **kwargs: Any) -> None:
        from airflow.sdk import Param

        kwargs.setdefault("subject", "Approve training")
        kwargs.pop("params", None)  # the form asks for the reason only (DAG-level params are not the human's input)
        super().__init__(
            ignore_downstream_trigger_rules=True,  # Reject skips train and publish, whatever their trigger rules
            params={REASON: Param("", type="string", title="Reason", description="Why (kept with the decision)")},
            **kwargs)

    def _report(self, context: Any) -> dict[str, Any] | None:
        return context["ti"].xcom_pull(task_ids=REPORT_TASK_ID)

    def execute(self, context: Any) -> Any:
        from plugins.mft_airflow.plan import load_plan_config

        plan = _plan(context)
        if not plan.runs("train"):
            raise AirflowSkipException("no training in this run; nothing to approve")
        if not load_plan_config(plan).release.require_approval:
            raise AirflowSkipException("release.require_approval is off: training needs no approval")
        self.subject, self.body = gate_text(plan, self._report(context))
        return super().execute(context)  # writes the request, waits for a human

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        from plugins.mft_airflow.plan import load_plan_config

        plan = _plan(context)
        chosen = (event.get("chosen_options") or [None])[0]
        record = approval_record(plan, event, approved=chosen == self.APPROVE)
        write_approval(plan.run_uri, record, load_plan_config(plan).storage)
        self.log.info("approval: %s", json.dumps(record))
        super().execute_complete(context, event)  # validates; on Reject skips the downstream tasks
        return record


def approval_record(plan: RunPlan, event: dict[str, Any], approved: bool) -> dict[str, Any]:
    params = event.get("params_input") or {}
    reason = params.get(REASON)
    if isinstance(reason, dict):  # serialized Param form
        reason = reason.get("value")
    at = event.get("responded_at")
    return {"approved": approved, "decision": "approved" if approved else "rejected", "reason": reason or "",
            "by": event.get("responded_by_user"), "at": at.isoformat() if isinstance(at, datetime) else at,
            "timed_out": bool(event.get("timedout")), "dataset_version": plan.dataset_version,
            "train_ready_uri": plan.train_ready_uri}


def write_approval(run_uri: str, record: dict[str, Any], storage: Any) -> None:
    from pipeline_core.store import open_store

    store, key = open_store(run_uri, storage)
    store.put_bytes(f"{key.rstrip('/')}/{APPROVAL_RECORD}", json.dumps(record, indent=2, sort_keys=True).encode())
