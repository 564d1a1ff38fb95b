"""The data report task (before the approval gate): `DataReportOperator`.

It runs the report stage (`reports.data_report.build`) in the worker: it reads committed artifacts
only and commits `datasets/<version>/report/<id>/`; its XCom (and the task's "Data report" extra
link) name the page, and so does the DAG run's note. A browser cannot open the store's URI, so the
links point at the API server's route for the run's report (`report_views.py`, `report_links.py`,
Airflow's `[api] base_url`) and the run page has a "Data report" tab. The Task SDK (Execution API)
can set a note only on a run it triggers, not on its own, so the note goes through the public REST
API (`hooks.AirflowApiHook`, the http provider's `HttpHook`) with the deployment's HTTP connection
`mft_airflow_api` (host = the API server's base URL; login/password of a user allowed to edit runs,
none with the simple auth manager's all-admins mode). Without that connection the note is left
alone and the task says so: the link is in XCom and the approval request all the same.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.exceptions import AirflowSkipException

from pipeline_core.handoffs import ReportRef
from pipeline_core.names import Stage
from plugins.mft_airflow.report_links import report_view_url
from plugins.mft_airflow.run_plan import RunPlan

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
        from pipeline_core.handoffs import DataReportInfo
        from plugins.mft_airflow.plan import load_plan_config
        from reports.data_report import build, report_page_uri

        plan = _plan(context)
        storage = load_plan_config(plan).storage
        if not plan.runs(Stage.FILTER) and read_manifest(plan.train_ready_uri, storage) is None:
            raise AirflowSkipException(f"no train-ready artifact at {plan.train_ready_uri} to report on")
        m = build(plan.train_ready_uri, storage=storage)
        self._lineage = ([plan.train_ready_uri], [(m.uri, m)])
        dag_run = context["dag_run"]
        out = ReportRef(uri=m.uri, page=report_page_uri(m), headline=DataReportInfo.from_manifest(m).headline,
                        view=_view_url(dag_run.dag_id, dag_run.run_id))
        self.log.info("data report: %s (in a browser: %s)", out.page, out.view or "set [api] base_url")
        note = run_note(getattr(dag_run, "note", None), out)
        if note is not None:
            set_run_note(self.api_conn_id, dag_run.dag_id, dag_run.run_id, note, self.log)
        return out.to_json_dict()  # XCom: read back with ReportRef.read

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


def report_link(report: ReportRef) -> str:
    """Markdown: the store URI as the text, the browser address as the target when there is one."""
    return f"[{report.page}]({report.view or report.page})"


def run_note(current: str | None, report: ReportRef) -> str | None:
    """The run's note with the report's link and headline appended; None when it already has them
    (a retry) -- a note a person wrote stays, above."""
    if current and report.page in current:
        return None
    line = f"{NOTE_MARK}: {report_link(report)}"
    if (h := report.headline) is not None:
        eff = h.packing_efficiency
        line += (f"  \n{h.records_in} records → {h.enriched} enriched → {h.kept} kept; "
                 f"tokens {', '.join(f'{k} {v:,}' for k, v in sorted(h.tokens.items()))}"
                 + (f"; packing {eff:.1%}" if eff is not None else ""))
    both = f"{current.rstrip()}\n\n{line}" if current else line
    return both if len(both) <= NOTE_MAX_CHARS else line[:NOTE_MAX_CHARS]



def set_run_note(conn_id: str, dag_id: str, run_id: str, note: str, log: Any) -> bool:
    """Set the run's note through the public REST API; a missing connection or a refusal is
    logged, never fatal (the note is a convenience, the report is committed either way)."""
    import requests
    from airflow.sdk.exceptions import AirflowException, AirflowNotFoundException

    from plugins.mft_airflow.hooks import AirflowApiHook

    hook = AirflowApiHook(conn_id)
    try:
        hook.set_run_note(dag_id, run_id, note)
    except AirflowNotFoundException:
        log.info("no connection %r: the DAG run's note is not set (the report's link is in XCom)", conn_id)
        return False
    except (AirflowException, requests.RequestException, KeyError, ValueError) as e:
        log.warning("the DAG run's note is not set: connection %r refused or failed: %s", conn_id, e)
        return False
    log.info("DAG run note links the data report")
    return True
