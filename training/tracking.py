"""MLflow tracking of a run: params, per-step metrics, eval results, data manifests, registry.

One job: forward what the pipeline already records (the resolved config, `MetricsLog` rows, the
eval artifact's scores, the train-ready manifest, the promotion decision) to an MLflow server, off
the critical path. Every call goes through one background thread (`Tracker`): a slow server never
stalls a training step; a failing one is logged, retried with backoff `tracking.max_attempts` times
and then given up on quietly. Nothing here raises into training or publish.

The MLflow run of a pipeline run is found by its tag `mft.run_id` in `tracking.experiment` (created
on first use), so a resumed trainer and the later publish task log into the same MLflow run.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pipeline_core.config import Config, TrackingSection

log = logging.getLogger("training.tracking")

RUN_TAG = "mft.run_id"
ORDER_KEY_TAG = "mft.order_key"
MODEL_URI_TAG = "mft.model_uri"
CHAMPION = "champion"
_STOP = object()


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"section.field": "value"} (lists and None as their JSON-ish str)."""
    if isinstance(obj, Mapping):
        out: dict[str, str] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: str(obj)[:6000]}  # MLflow's param value limit


class Tracker:
    """A queue of tracking calls executed in order by one daemon thread, each retried with backoff."""

    def __init__(self, settings: TrackingSection, run_id: str, run_name: str | None = None):
        self.settings = settings
        self.run_id = run_id
        self.run_name = run_name or run_id
        self.failures = 0  # calls given up on
        self._mlflow_run: str | None = None
        self._client = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="mlflow-tracking", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, settings: TrackingSection | None, run_id: str) -> Tracker | None:
        """A tracker when `tracking.mlflow_uri` is set, else None (tracking off)."""
        return None if settings is None or settings.mlflow_uri is None else cls(settings, run_id)

    # ------------------------------------------------------------------ what is logged
    def log_config(self, cfg: Config) -> None:
        params = flatten(cfg.model_dump(mode="json"))
        self.submit("params", lambda c, r: _batches(c, r, params=params))

    def log_step(self, row: Mapping[str, Any]) -> None:
        """A `MetricsLog.add` row: every numeric field as metric `train/<field>` at its step."""
        self._metrics(row, "train/")

    def log_eval(self, row: Mapping[str, Any]) -> None:
        """A `MetricsLog.add_eval` row (validation during training)."""
        self._metrics(row, "")

    def log_manifest(self, role: str, manifest: Any) -> None:
        """A data manifest's identity as tags: `data.<role>.sha256` (of the manifest's bytes as stored),
        `.content_sha256`, and its counts flattened (`data.<role>.in`, `data.<role>.rejected.<reason>`)."""
        tags = {f"data.{role}.sha256": manifest.sha256, f"data.{role}.content_sha256": manifest.content_sha256,
                f"data.{role}.kind": manifest.kind}
        tags.update(flatten(manifest.counts or {}, f"data.{role}"))  # e.g. data.enriched.rejected.empty_answer
        self.set_tags(tags)

    def log_benchmarks(self, results: Any) -> None:
        """The eval artifact's scores (`BenchmarkResults`): metric `eval/<task>/<metric>`."""
        metrics = {}
        for task in results.tasks:
            for name, score in task.metrics.items():
                if score.value is not None:
                    metrics[f"eval/{task.task}/{name.replace(',', '_')}"] = float(score.value)
        self.submit("benchmarks", lambda c, r: _batches(c, r, metrics=[(k, v, 0) for k, v in metrics.items()]))

    def log_values(self, values: Mapping[str, float], step: int = 0) -> None:
        items = [(k, float(v), step) for k, v in values.items()]
        self.submit("metrics", lambda c, r: _batches(c, r, metrics=items))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        tags = {k: str(v)[:5000] for k, v in tags.items()}
        self.submit("tags", lambda c, r: _batches(c, r, tags=tags))

    def register(self, name: str, model_uri: str, order_key: str) -> None:
        """A version of registered model `name` for this run's model; alias `champion` moves to it
        only when no newer run (larger order key) holds it."""
        self.submit("register", lambda c, r: register_version(c, r, name, model_uri, order_key))

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the MLflow run ended (publish may still add to it later)."""
        self.submit("finish", lambda c, r: c.set_terminated(r, status))

    def _metrics(self, row: Mapping[str, Any], prefix: str) -> None:
        step = int(row["step"])
        items = [(f"{prefix}{k}", float(v), step) for k, v in row.items()
                 if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]
        self.submit("metrics", lambda c, r: _batches(c, r, metrics=items))

    # ------------------------------------------------------------------ the queue
    def submit(self, what: str, call: Callable[[Any, str], None]) -> None:
        if self._thread.is_alive():
            self._queue.put((what, call))

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded) for the queued calls; True when all were sent. Never raises."""
        timeout_s = self.settings.flush_timeout_s if timeout_s is None else timeout_s
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("MLflow tracking: %d calls still queued after %.0f s; dropped", self._queue.qsize(), timeout_s)
            return False
        return self.failures == 0

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            what, call = item
            delay = self.settings.backoff_s
            for attempt in range(1, self.settings.max_attempts + 1):
                try:
                    client = self._connect()
                    call(client, self._ensure_run(client))
                    break
                except Exception as e:  # noqa: BLE001 - tracking must never fail the run
                    if attempt == self.settings.max_attempts or _refused(e):
                        self.failures += 1
                        log.warning("MLflow tracking (%s) at %s: giving up after %d attempts: %s", what,
                                    self.settings.mlflow_uri, attempt, _short(e))
                    else:
                        log.info("MLflow tracking (%s) attempt %d failed, retrying in %.1f s: %s", what, attempt,
                                 delay, _short(e))
                        time.sleep(delay)
                        delay = min(delay * 2, 60.0)

    def _connect(self):
        if self._client is None:
            # our own retries and timeout: the client's defaults (7 retries, 120 s) would stall the queue for minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(self.settings.request_timeout_s)))
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.settings.mlflow_uri,
                                        registry_uri=self.settings.mlflow_uri)
        return self._client

    def _ensure_run(self, client) -> str:
        if self._mlflow_run is None:
            self._mlflow_run = find_or_create_run(client, self.settings.experiment, self.run_id, self.run_name)
        return self._mlflow_run


def find_or_create_run(client, experiment: str, run_id: str, run_name: str) -> str:
    """The MLflow run tagged with this pipeline run id (a resume or the publish task finds the trainer's)."""
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1)
    if found:
        return found[0].info.run_id
    return client.create_run(exp_id, run_name=run_name, tags={RUN_TAG: run_id}).info.run_id


def register_version(client, mlflow_run: str, name: str, model_uri: str, order_key: str) -> None:
    """Register (idempotently per run) and move `champion` forward only: the alias's version carries
    its run's order key (the one `pointers.advance` orders models/LATEST by) and is replaced only by a
    larger one. The source is the model artifact itself where MLflow can read it (s3://), else the
    run (`runs:/`, the MLflow server refuses local paths outside its artifact root); the artifact URI is
    always the version's tag `mft.model_uri`."""
    from mlflow.exceptions import MlflowException

    source = model_uri if model_uri.startswith(("s3://", "gs://", "https://")) else f"runs:/{mlflow_run}/model"

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
            raise
    mine = [v for v in client.search_model_versions(f"name = '{name}' and run_id = '{mlflow_run}'")]
    version = mine[0] if mine else client.create_model_version(
        name, source, run_id=mlflow_run, tags={ORDER_KEY_TAG: order_key, MODEL_URI_TAG: model_uri})
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        champion = None
    held = (champion.tags or {}).get(ORDER_KEY_TAG, "") if champion is not None else ""
    if champion is not None and held >= order_key:
        log.info("MLflow: %s version %s (order key %s) registered; alias %s stays on version %s (order key %s)",
                 name, version.version, order_key, CHAMPION, champion.version, held)
        return
    client.set_registered_model_alias(name, CHAMPION, version.version)
    log.info("MLflow: %s version %s is %s", name, version.version, CHAMPION)


def _batches(client, mlflow_run: str, *, params: Mapping[str, str] | None = None,
             metrics: Iterable[tuple[str, float, int]] = (), tags: Mapping[str, str] | None = None) -> None:
    """log_batch within MLflow's per-request limits (100 params, 1000 metrics, 100 tags)."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    p = [Param(k, v) for k, v in (params or {}).items()]
    m = [Metric(k, v, now, s) for k, v, s in metrics]
    t = [RunTag(k, v) for k, v in (tags or {}).items()]
    for i in range(0, len(p), 100):
        client.log_batch(mlflow_run, params=p[i:i + 100])
    for i in range(0, len(m), 1000):
        client.log_batch(mlflow_run, metrics=m[i:i + 1000])
    for i in range(0, len(t), 100):
        client.log_batch(mlflow_run, tags=t[i:i + 100])


def _refused(e: BaseException) -> bool:
    """The server answered and said no (a bad request): retrying cannot help."""
    code = getattr(e, "error_code", "")
    return str(code) in ("INVALID_PARAMETER_VALUE", "BAD_REQUEST", "PERMISSION_DENIED", "INVALID_STATE")


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 300 else text[:300] + "..."
