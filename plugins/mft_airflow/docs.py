"""Per-task documentation shown in the Airflow UI (Task Instance -> Task Docs)."""

TASK_DOCS = {
    "resolve": """### resolve
Validates the trigger's Params against the deployment's config (named params and the
`config_overrides` allowlist only), derives the dataset version and run id, writes the one resolved
config file under `pipeline.staging_uri`, and returns the run's **RunPlan** (every URI) to XCom.
Fails without retries on an invalid value, naming the field.""",
    "enrich": """### enrich (Spark)
`spark_jobs/enrich.py --input <source_uri> --output <enriched_uri> --config <file>` through
`spark-submit` on connection `spark_default`: normalise conversations, embed, score context
relevance. A committed artifact is reused. Emits an asset event (rows in/out/rejected) and
OpenLineage input/output datasets.""",
    "filter": """### filter (Spark)
`spark_jobs/similarity_filter.py`: similarity filter, exact and near-duplicate removal, split,
chat-template rendering, tokenization and packing into train-ready shards. Asset event with rows
and tokens per split.""",
    "train": """### train (DeepSpeed)
`training.train` under torchrun (local subprocess, Docker container, or an indexed Kubernetes Job
with one pod per node), on the deployment's launcher. A retry keeps the run id and resumes from
the newest checkpoint; a committed model is reused.""",
    "publish": """### publish
Checks every model file against its manifest, writes `runs/<run>/pipeline_summary.json`, moves
`models/LATEST`, and emits the `mistral_finetune/model` asset event downstream DAGs schedule on.""",
}
