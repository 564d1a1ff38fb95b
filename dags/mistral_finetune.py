"""mistral_finetune: enrich (Spark) -> similarity filter + pack (Spark) -> data report -> [approval] -> train
(DeepSpeed) -> evaluate (lm-evaluation-harness) -> publish (evaluation-gated, forward-only models/LATEST).

Thin on purpose: the logic lives in `plugins.mft_airflow` and in the stage commands. Scheduled runs
and backfills take their dataset version from the logical date; manual runs from the
`dataset_version` param (else the trigger date). `resolve` validates every param before any
compute and returns the typed `RunPlan` every later task reads from XCom. The provider modules are
imported here by name so the DAG processor pre-imports them once (`parsing_pre_import_modules`)
instead of in every parse.
"""

from __future__ import annotations

from datetime import timedelta

import airflow.providers.apache.spark.operators.spark_submit  # noqa: F401  (pre-imported by the DAG processor)
import airflow.providers.standard.decorators.python  # noqa: F401  (@task's operator, pre-imported too)
import pendulum
from airflow.sdk import DAG, AssetAlias, Param, TriggerRule

from plugins.mft_airflow.approval import ApprovalGateOperator
from plugins.mft_airflow.docs import TASK_DOCS
from plugins.mft_airflow.operators import SparkStageOperator, eval_operator, log_failure, train_operator
from plugins.mft_airflow.params import param_specs
from plugins.mft_airflow.report_task import DataReportOperator
from plugins.mft_airflow.settings import load_settings
from plugins.mft_airflow.tasks import publish, resolve

settings = load_settings()
spark_timeout = timedelta(minutes=settings.spark_timeout_min)

with DAG(
    dag_id="mistral_finetune",
    description="Refresh the Nemotron post-training set, filter by similarity, fine-tune Mistral, publish",
    schedule=settings.schedule,
    start_date=pendulum.parse(settings.start_date),
    catchup=False,
    max_active_runs=settings.max_active_runs,
    params={name: Param(**spec) for name, spec in param_specs().items()},
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
    plan = resolve.override(execution_timeout=timedelta(minutes=5), doc_md=TASK_DOCS["resolve"])()
    enrich = SparkStageOperator(task_id="enrich", stage="enrich", application="enrich/job.py", input_field="source_uri", output_field="enriched_uri", settings=settings, outlets=[AssetAlias("mistral_finetune/enriched")], execution_timeout=spark_timeout, doc_md=TASK_DOCS["enrich"])
    filter_ = SparkStageOperator(task_id="filter", stage="filter", application="filter/job.py", input_field="enriched_uri", output_field="train_ready_uri", settings=settings, outlets=[AssetAlias("mistral_finetune/train_ready")], trigger_rule=TriggerRule.NONE_FAILED, execution_timeout=spark_timeout, doc_md=TASK_DOCS["filter"])
    report = DataReportOperator(task_id="data_report", trigger_rule=TriggerRule.NONE_FAILED, doc_md=TASK_DOCS["data_report"])
    approve = ApprovalGateOperator(task_id="approve", trigger_rule=TriggerRule.NONE_FAILED, retries=0, doc_md=TASK_DOCS["approve"])
    train = train_operator(settings, task_id="train", pool=settings.gpu_pool, trigger_rule=TriggerRule.NONE_FAILED, execution_timeout=timedelta(minutes=settings.train_timeout_min), doc_md=TASK_DOCS["train"])
    evaluate = eval_operator(settings, task_id="evaluate", pool=settings.gpu_pool, execution_timeout=timedelta(minutes=settings.train_timeout_min), doc_md=TASK_DOCS["evaluate"])
    published = publish.override(execution_timeout=timedelta(minutes=settings.publish_timeout_min), doc_md=TASK_DOCS["publish"])(plan)

    plan >> enrich >> filter_ >> report >> approve >> train >> published
    train >> evaluate >> published  # benchmarks on the exported model before the promotion gate
