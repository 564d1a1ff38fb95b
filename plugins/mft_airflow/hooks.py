"""Hooks: how the operators talk to the pipeline's object store and to a local trainer.

`ArtifactStoreHook` reads committed artifacts (manifests) and writes a run's records through
`pipeline_core` with a run's storage settings, so no operator opens the store itself.
`AirflowApiHook` calls Airflow's public REST API (a DAG run's note) through the http provider's
`HttpHook` and an HTTP connection. `LocalTrainHook` runs the training agent
on the worker under the watchdog (`launchers.LocalTrainProcess`). Docker and Kubernetes trainers
go through the providers' own hooks, inside the operators that subclass theirs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.hook import BaseHook

if TYPE_CHECKING:
    from pipeline_core.artifacts import Manifest
    from pipeline_core.config import StorageSection


class ArtifactStoreHook(BaseHook):
    """Committed artifacts in the store a run's config names (file://, s3://)."""

    hook_name = "Pipeline artifact store"

    def __init__(self, storage: StorageSection | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.storage = storage

    def manifest(self, uri: str) -> Manifest | None:
        """The artifact's manifest if it is committed, else None."""
        from pipeline_core.artifacts import read_manifest

        return read_manifest(uri, self.storage)

    def put(self, prefix_uri: str, name: str, data: bytes) -> None:
        """Write `prefix_uri/name` (a run's record: not an artifact, so no manifest)."""
        from pipeline_core.store import open_store

        store, key = open_store(prefix_uri, self.storage)
        store.put_bytes(f"{key.rstrip('/')}/{name}", data)


class _TokenOnly:
    """HttpHook's `auth_type`: the API takes a bearer token, not Basic auth, so the connection's
    login and password only buy the token (`/auth/token`) and are never sent as Basic auth."""

    def __init__(self, *_: Any) -> None:
        pass

    def __call__(self, request: Any) -> Any:
        return request


class AirflowApiHook(BaseHook):
    """Airflow's public REST API through an HTTP connection (host = the API server's base URL;
    login/password of a user, or none with the simple auth manager's all-admins mode)."""

    hook_name = "Airflow REST API"
    timeout_s = 30

    def __init__(self, http_conn_id: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.http_conn_id = http_conn_id

    def _http(self, method: str) -> Any:
        from airflow.providers.http.hooks.http import HttpHook

        return HttpHook(method=method, http_conn_id=self.http_conn_id, auth_type=_TokenOnly)

    def token(self) -> str:
        """A JWT for the connection's user (AirflowNotFoundException without the connection)."""
        conn = self.get_connection(self.http_conn_id)
        options = {"timeout": self.timeout_s}
        if conn.login:
            r = self._http("POST").run("/auth/token", json={"username": conn.login, "password": conn.password},
                                       extra_options=options)
        else:
            r = self._http("GET").run("/auth/token", extra_options=options)
        return r.json()["access_token"]

    def set_run_note(self, dag_id: str, run_id: str, note: str) -> None:
        """PATCH the run's note; raises on a refusal (AirflowException) or a failed connection."""
        self._http("PATCH").run(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}", json={"note": note},
                                params={"update_mask": "note"}, headers={"Authorization": f"Bearer {self.token()}"},
                                extra_options={"timeout": self.timeout_s})


class LocalTrainHook(BaseHook):
    """A training agent on this worker; `stop` ends its whole process tree."""

    hook_name = "Local torchrun"

    def __init__(self, command: list[str], env: dict[str, str], cwd: str, **kwargs: Any):
        super().__init__(**kwargs)
        from plugins.mft_airflow.launchers import LocalTrainProcess

        self.process = LocalTrainProcess(command, env, cwd, self.log)

    def run(self) -> None:
        self.process.execute()

    def stop(self) -> None:
        self.process.on_kill()
