"""mistral_finetune: enrich (Spark) -> similarity filter + pack (Spark) -> data report -> [approval] -> train
(DeepSpeed) -> publish (evaluation-gated, forward-only models/LATEST).

Thin on purpose: the logic lives in `plugins.mft_airflow` and in the stage commands. Nothing here
does I/O or imports a provider at parse time (tests/test_dag_parse.py bounds the parse time).
Scheduled runs and backfills take their dataset version from the logical date; manual runs from
the `dataset_version` param (else the trigger date). `resolve` validates every param before any
compute and writes the one config file every stage gets.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, AssetAlias, Param, TriggerRule

from plugins.mft_airflow.gates import ApprovalGateOperator, DataReportOperator
from plugins.mft_airflow.operators import (
    PublishModelOperator,
    ResolvePlanOperator,
    SparkStageOperator,
    TrainOperator,
    log_failure,
)
from plugins.mft_airflow.params import param_specs
from plugins.mft_airflow.settings import load_settings

settings = load_settings()

ENRICHED = AssetAlias("mistral_finetune/enriched")
TRAIN_READY = AssetAlias("mistral_finetune/train_ready")

with DAG(
    dag_id="mistral_finetune",
    description="Refresh the Nemotron post-training set, filter by similarity, fine-tune Mistral, publish",
    schedule=settings.schedule,
    start_date=pendulum.parse(settings.start_date),
    catchup=False,
    max_active_runs=settings.max_active_runs,
    params={name: Param(**spec) for name, spec in param_specs(settings.launcher).items()},
    default_args={
        "retries": settings.retries,
        "retry_delay": timedelta(seconds=settings.retry_delay_s),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(seconds=settings.max_retry_delay_s),
        "on_failure_callback": log_failure,
    },
    tags=["mistral", "spark", "deepspeed"],
    doc_md=__doc__,
) as dag:
    resolve = ResolvePlanOperator(
        task_id="resolve", settings=settings, retries=0, execution_timeout=timedelta(minutes=5)
    )
    enrich = SparkStageOperator(
        task_id="enrich", stage="enrich", application="enrich.py", input_key="source_uri",
        output_key="enriched_uri", settings=settings, outlets=[ENRICHED],
        execution_timeout=timedelta(minutes=settings.spark_timeout_min),
    )
    filter_ = SparkStageOperator(
        task_id="filter", stage="filter", application="similarity_filter.py", input_key="enriched_uri",
        output_key="train_ready_uri", settings=settings, outlets=[TRAIN_READY],
        trigger_rule=TriggerRule.NONE_FAILED, execution_timeout=timedelta(minutes=settings.spark_timeout_min),
    )
    report = DataReportOperator(task_id="data_report", trigger_rule=TriggerRule.NONE_FAILED)
    approve = ApprovalGateOperator(task_id="approve", trigger_rule=TriggerRule.NONE_FAILED, retries=0)
    train = TrainOperator(
        task_id="train", settings=settings, pool=settings.gpu_pool, trigger_rule=TriggerRule.NONE_FAILED,
        execution_timeout=timedelta(minutes=settings.train_timeout_min),
    )
    publish = PublishModelOperator(
        task_id="publish", execution_timeout=timedelta(minutes=settings.publish_timeout_min),
    )

    resolve >> enrich >> filter_ >> report >> approve >> train >> publish
