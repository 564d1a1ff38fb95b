"""A DAG run's data report, served by the Airflow API server, so its link opens in a browser.

The report is committed to the object store (`s3://…` or `file://…`), which a browser cannot open.
`build_app()` is mounted by the plugin `plugins/mft_reports_plugin.py` under `ROUTE_PREFIX`:

    GET <api base>/mft-reports/<dag_id>/<run_id>/<file>     e.g. …/data/index.html, …/data/charts/x.png

- who: the caller must be allowed to read the DAG's runs (Airflow's own auth manager, the UI's
  session cookie or a bearer token; anonymous → 401, no access → 403);
- what: the report committed by that run's `data_report` task (its XCom names it); only files its
  manifest lists are served, each checked against the manifest's sha256, so the route cannot read
  anything else in the store. A report outside the deployment's `pipeline.store_uri` is refused.
- where the store is: the deployment's config (`MFT_CONFIG` / `MFT_DEPLOY__CONFIG_FILE`, storage
  settings and credentials as the workers have them); a trigger cannot change it.

The DAG run page gets a "Data report" tab (an external view), and `data_report` links the note here.
"""

from __future__ import annotations

import mimetypes
from dataclasses import dataclass

from fastapi import Depends, FastAPI, HTTPException, Response
from pydantic import ValidationError

from pipeline_core.handoffs import ReportRef
from plugins.mft_airflow.report_links import REPORT_TASK_ID


@dataclass(frozen=True)
class ReportFile:
    data: bytes
    media_type: str


def _run_report_uri(dag_id: str, run_id: str) -> str | None:
    """The report artifact the run's `data_report` task returned (None: it did not run or skipped)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(XComModel.get_many(run_id=run_id, dag_ids=dag_id, task_ids=REPORT_TASK_ID,
                                                 key="return_value", limit=1)).first()
        value = XComModel.deserialize_value(row) if row is not None else None
    try:
        return ReportRef.read(value).uri
    except ValidationError:  # no report, or not the report task's XCom
        return None


def read_report_file(dag_id: str, run_id: str, path: str) -> ReportFile:
    """The committed file `path` of the run's report; HTTPException(404) for anything else."""
    from pipeline_core.artifacts import read_artifact_file, read_manifest
    from pipeline_core.config import load_config
    from plugins.mft_airflow.settings import load_settings

    uri = _run_report_uri(dag_id, run_id)
    if uri is None:
        raise HTTPException(404, f"run {run_id!r} of {dag_id!r} has no data report (its data_report task "
                                 "did not run, was skipped, or has not finished)")
    cfg = load_config(load_settings().config_file)
    store_root = cfg.pipeline.store_uri.rstrip("/") + "/"
    if not uri.startswith(store_root):
        raise HTTPException(404, f"the report {uri} is outside this deployment's store {store_root}")
    manifest = read_manifest(uri, cfg.storage)
    if manifest is None:
        raise HTTPException(404, f"the report {uri} is not committed")
    try:
        data = read_artifact_file(manifest, path, cfg.storage)
    except FileNotFoundError:
        raise HTTPException(404, f"{path!r} is not a file of the committed report {uri}") from None
    return ReportFile(data, mimetypes.guess_type(path)[0] or "application/octet-stream")


def _authorized_reader():
    """Airflow's own check: the caller may read this DAG's runs (`dag_id` from the path)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    return Depends(requires_access_dag("GET", DagAccessEntity.RUN))


def build_app() -> FastAPI:
    app = FastAPI(title="MFT data reports", description=__doc__)

    @app.get("/{dag_id}/{run_id}/{path:path}", dependencies=[_authorized_reader()])
    def report_file(dag_id: str, run_id: str, path: str) -> Response:
        f = read_report_file(dag_id, run_id, path)
        # committed files never change; "private": the page is behind the user's session
        return Response(f.data, media_type=f.media_type, headers={"Cache-Control": "private, max-age=3600",
                                                                  "X-Content-Type-Options": "nosniff"})

    return app
