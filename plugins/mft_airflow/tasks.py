"""The DAG's TaskFlow tasks: `resolve` (Params -> `RunPlan`) and `publish` (model -> `models/LATEST`
and a model asset event). Plain functions of the plan; the stage operators are in `operators.py`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from airflow.sdk import Asset, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from pipeline_core.names import Stage
from plugins.mft_airflow.run_plan import RunPlan
from plugins.mft_airflow.stage_base import PLAN_TASK_ID

log = logging.getLogger(__name__)

# Downstream DAGs (evaluation, serving) schedule on this; each event's `extra` names the model.
MODEL_ASSET = Asset(name="mistral_finetune/model", group="model")


@task(task_id=PLAN_TASK_ID, retries=0)
def resolve(**context: Any) -> RunPlan:
    """Validate the Params and the deployment's config before any compute (an invalid value fails
    here, naming the field, without retries), write the one resolved config file every stage gets,
    and return the run's plan: every URI it reads and writes."""
    from plugins.mft_airflow.plan import PlanError, resolve_plan
    from plugins.mft_airflow.settings import load_settings

    settings = load_settings()
    dag_run = context["dag_run"]
    try:
        plan = resolve_plan(
            dict(context["params"]), dag_id=dag_run.dag_id, airflow_run_id=dag_run.run_id,
            run_date=context.get("logical_date") or dag_run.run_after, config_file=settings.config_file,
            world_size=settings.world_size(), settings=settings,
            triggered_by=getattr(dag_run, "triggering_user_name", None),
        )
    except (PlanError, ValueError) as e:
        raise AirflowFailException(str(e)) from None  # a bad parameter is not transient
    log.info("plan:\n%s", json.dumps(plan.model_dump(mode="json"), indent=2))
    return plan


@task(outlets=[MODEL_ASSET])
def publish(plan: RunPlan, **context: Any) -> dict[str, Any]:
    """Evaluation-gated promotion (`summary.publish_model`): sha256 of every model file, val loss vs
    the current LATEST on the same rows, the run's summary, `models/LATEST` forward only; and emit a model asset event (model URI, run, dataset version, eval loss)."""
    from pipeline_core.pointers import order_key_from_date
    from plugins.mft_airflow.plan import load_plan_config
    from plugins.mft_airflow.summary import format_summary, publish_model

    if not plan.runs(Stage.TRAIN):
        raise AirflowSkipException("no training in this run; nothing to publish")
    cfg = load_plan_config(plan)
    # runs are ordered by logical date (trigger time for manual runs): LATEST never moves back
    order_key = order_key_from_date(context.get("logical_date") or context["dag_run"].run_after)
    summary = publish_model(plan, cfg.storage, order_key, cfg.release, cfg.tracking, dpo=cfg.train.dpo)
    log.info("\n%s", format_summary(summary))
    context["outlet_events"][MODEL_ASSET].extra = {
        "model_uri": plan.model_uri, "run_id": plan.run_id, "dataset_version": plan.dataset_version,
        "manifest_sha256": summary.model.manifest_sha256, "eval_loss": summary.train.eval_loss,
        "train_tokens": summary.train.tokens, "latest": summary.latest,
        "promoted": summary.promotion is not None and summary.promotion.promoted, "data_report": summary.data_report,
    }
    return summary.to_json_dict()  # the XCom: RunSummary.read gives the model back
