#!/usr/bin/env bash
# `make demo`: the whole pipeline through Airflow (`airflow dags test mistral_finetune`) on the
# embedded defaults: local Spark, the local object store (.store/), the tiny Mistral-architecture
# model with DeepSpeed on CPU, the bundled sample. Ends with what each stage did and where the
# model is. Airflow's state (SQLite) lives in .airflow/; the full log in .airflow/demo-<time>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

export AIRFLOW_HOME="${AIRFLOW_HOME:-$ROOT/.airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$ROOT/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}"
export AIRFLOW_CONN_SPARK_DEFAULT="${AIRFLOW_CONN_SPARK_DEFAULT:-{\"conn_type\": \"spark\", \"host\": \"local[*]\"\}}"
export MFT_DEPLOY__SPARK_CONF="${MFT_DEPLOY__SPARK_CONF:-{spark.sql.shuffle.partitions: '4', spark.ui.enabled: 'false'\}}"
export PATH="$ROOT/.venv/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"

# Evaluation (docs/evaluation.md): the filter decontaminates against the bundled tiny eval set (three of
# its questions are planted copies of sample records), and the exported model is scored on the same
# questions as a local lm-evaluation-harness YAML task. Set either variable to "[]" to leave it out.
export MFT__FILTER__DECONTAMINATE="${MFT__FILTER__DECONTAMINATE:-[{name: tiny_qa, uri: 'file://$ROOT/sample_data/eval/tiny_qa.jsonl'\}]}"
export MFT__RELEASE__EVAL_TASKS="${MFT__RELEASE__EVAL_TASKS:-[{task: tiny_qa, yaml: 'file://$ROOT/sample_data/eval/tiny_qa.yaml'\}]}"

# MLflow tracking (docs/evaluation.md#tracking-mlflow): params, per-step metrics, eval scores and the
# registered model go to a local SQLite store; browse it with the server package (its own venv, see
# docs) `mlflow ui --backend-store-uri sqlite:///.store/mlflow/mlflow.db`. Set the variable empty to turn it off.
mkdir -p "$ROOT/.store/mlflow"
export MFT__TRACKING__MLFLOW_URI="${MFT__TRACKING__MLFLOW_URI-sqlite:///$ROOT/.store/mlflow/mlflow.db}"

# The embedded defaults, with the dataset version pinned so that a second `make demo` reuses the
# committed data artifacts (and trains a new run on them).
CONF="${DEMO_CONF:-{\"dataset_version\": \"sample\"\}}"
mkdir -p "$AIRFLOW_HOME"
LOG="$AIRFLOW_HOME/demo-$(date +%Y%m%d-%H%M%S).log"

echo "== Airflow home $AIRFLOW_HOME (SQLite); full log: $LOG"
airflow db migrate >>"$LOG" 2>&1
airflow pools set gpu 1 "concurrent training runs" >>"$LOG" 2>&1

# One `airflow dags test` run; fails the demo unless the DAG run succeeded.
dag_test() {
  local conf="$1" runlog="$AIRFLOW_HOME/demo-run-$(date +%s%N).log"
  echo "== airflow dags test mistral_finetune -c '$conf'"
  local start=$(date +%s) rc
  set +e
  airflow dags test mistral_finetune -c "$conf" 2>&1 | tee -a "$LOG" "$runlog" \
    | grep --line-buffered -E "\[DAG TEST\] end task|DagRun Finished|ERROR|Traceback" \
    | sed -u -E 's/.*\[DAG TEST\] end task task_id=([a-z_]+).*/   task \1 done/; s/.*DagRun Finished.*state=([a-z]+).*/   dag run \1/'
  rc=${PIPESTATUS[0]}
  set -e
  echo "== $(( $(date +%s) - start ))s"
  if [ "$rc" -ne 0 ] || ! grep -q "DagRun Finished.*state=success" "$runlog"; then
    echo "demo failed: see $LOG" >&2
    exit 1
  fi
}

# DEMO_STEPS picks the runs (default all three, in this order; dpo needs an earlier sft run's model).
STEPS=" ${DEMO_STEPS:-sft dpo family} "
if [[ "$STEPS" == *" sft "* ]]; then
  dag_test "$CONF"
  echo "== what the run did (read back from the committed manifests)"
  python -m plugins.mft_airflow.summary
fi

# Then DPO (docs/dpo.md) from the model the SFT run just promoted (`base_model: latest`), on the bundled
# preference sample: the same DAG, objective dpo, with scripts/demo-dpo.json's settings (seq 128, a
# quarter of the prompts held out for validation, a larger step than SFT's default: the tiny model's
# reward accuracy and margin move within a minute of CPU; tests/test_dpo_dag.py runs the same settings).
# A promoted DPO model is models/dpo/LATEST.
if [[ "$STEPS" == *" dpo "* ]]; then
  DPO_CONF="${DEMO_DPO_CONF:-$(python -c 'import json, sys; print(json.dumps({**json.load(open(sys.argv[1])), "source_uri": sys.argv[2]}))' \
    scripts/demo-dpo.json "file://$ROOT/sample_data/preference")}"
  dag_test "$DPO_CONF"
  echo "== what the DPO run did"
  python -m plugins.mft_airflow.summary --objective dpo --newest
fi

# The Nemotron SFT-collection shapes (docs/data-sources.md): withheld system/user turns re-joined from
# the bundled seed copies (WildChat-style by sha256, TACO-style by dataset/split/index), per-turn
# training flags, identity and licence filters. The summary shows restored / unrestorable prompts per
# source and, per input split, how many conversations fit seq_len with and without reasoning.
if [[ "$STEPS" == *" family "* ]]; then
  MFT__ENRICH__PROMPT_SOURCES="${MFT__ENRICH__PROMPT_SOURCES:-{allenai/WildChat-1M: 'file://$ROOT/sample_data/seeds/wildchat', BAAI/TACO: 'file://$ROOT/sample_data/seeds/taco'\}}" \
    dag_test "{\"dataset_version\": \"sample-family\", \"source_uri\": \"file://$ROOT/sample_data/nemotron_sft\", \"config_overrides\": {\"enrich.splits\": [\"chat\", \"tool\", \"code\"], \"filter.val_fraction\": 0.25}}"
  echo "== what the family run did"
  python -m plugins.mft_airflow.summary --newest
fi
