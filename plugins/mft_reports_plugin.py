"""The Airflow plugin of this project: a DAG run's data report, served by the API server and shown
as the run's "Data report" tab (`plugins/mft_airflow/report_views.py` says how and to whom).

Airflow's plugin manager imports each top-level .py file of the plugins folder; the package
`mft_airflow` itself is ignored there (`.airflowignore`) and imported as `plugins.mft_airflow`.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from plugins.mft_airflow.report_links import ROUTE_PREFIX, page_route
from plugins.mft_airflow.report_views import build_app


class MftReportsPlugin(AirflowPlugin):
    name = "mft_reports"
    fastapi_apps = [{"app": build_app(), "url_prefix": ROUTE_PREFIX, "name": "MFT data reports"}]
    external_views = [{"name": "Data report", "href": page_route(), "destination": "dag_run",
                       "url_route": "data-report"}]
