"""Where a DAG run's data report is served (plugins/mft_airflow/report_views.py): the addresses
only, importable by the DAG file at parse time (no web framework, no numpy)."""

from __future__ import annotations

from urllib.parse import quote

ROUTE_PREFIX = "/mft-reports"
REPORT_TASK_ID = "data_report"


def report_page() -> str:
    from reports.data_report import PAGE

    return PAGE


def page_route() -> str:
    """The run's tab in the UI: relative (no leading slash, so it works under a proxy's path
    prefix); the UI fills in {DAG_ID} and {RUN_ID}."""
    return f"{ROUTE_PREFIX.lstrip('/')}/{{DAG_ID}}/{{RUN_ID}}/{report_page()}"


def report_view_url(base_url: str, dag_id: str, run_id: str, path: str | None = None) -> str:
    """Where a browser opens the run's report page (or its file `path`); `base_url`: Airflow's
    `[api] base_url`, the address users reach the UI at."""
    return (f"{base_url.rstrip('/')}{ROUTE_PREFIX}/{quote(dag_id, safe='')}/{quote(run_id, safe='')}/"
            f"{path or report_page()}")
