"""Per-task documentation shown in the Airflow UI (Task Instance -> Task Docs)."""

TASK_DOCS = {
    "resolve": """### resolve
Validates the trigger's Params against the deployment's config (named params and the
`config_overrides` allowlist only), derives the dataset version and run id, writes the one resolved
config file under `pipeline.staging_uri`, and returns the run's **RunPlan** (every URI) to XCom.
Fails without retries on an invalid value, naming the field.""",
    "enrich": """### enrich (Spark)
`spark_jobs/enrich/job.py --input <source_uri> --output <enriched_uri> --config <file>` through
`spark-submit` on connection `spark_default`: normalise conversations, embed, score context
relevance. A committed artifact is reused. Emits an asset event (rows in/out/rejected) and
OpenLineage input/output datasets.""",
    "filter": """### filter (Spark)
`spark_jobs/filter/job.py`: similarity filter, exact and near-duplicate removal, split,
chat-template rendering, tokenization and packing into train-ready shards. Asset event with rows
and tokens per split.""",
    "train": """### train (DeepSpeed)
`training.train` under torchrun (local subprocess, Docker container, or an indexed Kubernetes Job
with one pod per node), on the deployment's launcher. A retry keeps the run id and resumes from
the newest checkpoint; a committed model is reused.""",
    "evaluate": """### evaluate (lm-evaluation-harness)
`training.benchmarks --input <model_uri> --output <run>/eval` launched like the trainer (local
subprocess, Docker container, one-pod Kubernetes Job): the `release.eval_tasks` (harness tasks or
local YAML tasks) on the exported model, HF backend; per task and metric the score, its stderr and
every sample, committed as the run's `eval/` artifact. Nothing to do without eval tasks.""",
    "data_report": """### data_report
Builds the committed `report/` artifact of the run's train-ready data (`reports.data_report`):
an HTML page with charts of rejects, similarity distributions with their thresholds, dropped
near-duplicates, packing and the loss mask of a rendered example. Its page is in the XCom and the
task's "Data report" link.""",
    "approve": """### approve
Optional human gate (`require_approval`): Approve trains, Reject skips train and publish and
records who and why in `runs/<run>/approval.json`. Skipped when approval is not required.""",
    "publish": """### publish
Evaluation-gated promotion: verifies every model file's sha256, scores the model and the current
`models/LATEST` on the same val rows (or, with `release.promote_on` metrics, compares both models'
benchmark scores from their eval artifacts), writes `runs/<run>/pipeline_summary.json` with the decision,
moves `models/LATEST` forward only when the gate allows, and emits the `mistral_finetune/model` asset event downstream DAGs schedule on.""",
}
