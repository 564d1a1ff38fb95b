"""Params: valid conf is accepted and resolved onto the config; each kind of invalid conf is
refused by the form's JSON schema or by the first task, before any compute, naming the field; the
trigger policy keeps deployment settings out of a trigger's reach."""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime

import pytest
import yaml
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk.exceptions import ParamValidationError

from pipeline_core import layout, uris
from pipeline_core.config import Config, load_config
from plugins.mft_airflow.params import OVERRIDABLE
from plugins.mft_airflow.plan import PlanError, resolve_plan, safe_run_name
from plugins.mft_airflow.run_plan import RunPlan
from tests.dag_helpers import DAG_ID, REPO

RUN_DATE = datetime(2026, 1, 2, 2, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def dag():
    return DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]


def form(dag, conf: dict) -> dict:
    """What the trigger form / REST API do with a conf: merge onto the DAG's Params and validate."""
    params = copy.deepcopy(dag.params)
    for k, v in conf.items():
        params[k] = v
    return params.validate()


@pytest.fixture
def roots(tmp_path):
    store, staging = tmp_path / "store", tmp_path / "staging"
    return {"pipeline.store_uri": uris.qualify(store), "pipeline.staging_uri": uris.qualify(staging)}


def deployment_env(roots: dict) -> dict[str, str]:
    """Store and staging come from the deployment (MFT__ environment), never from a trigger."""
    return {"MFT__" + k.upper().replace(".", "__"): v for k, v in roots.items()}


def resolve(params: dict, roots: dict, run_id: str = "manual__2026-01-02T02:00:00+00:00", world_size: int = 2,
            **deploy: str):
    """`deploy`: MFT_DEPLOY__ settings (e.g. allowed_source_prefixes) next to the deployment's config."""
    env = {**deployment_env(roots), **{f"MFT_DEPLOY__{k.upper()}": v for k, v in deploy.items()}}
    return resolve_plan(params, dag_id=DAG_ID, airflow_run_id=run_id, run_date=RUN_DATE, env=env,
                        world_size=world_size)


def test_defaults_are_valid_and_resolve_to_the_logical_date_version(dag, roots):
    params = form(dag, {})
    assert "launcher" not in params and params["stages"] == ["enrich", "filter", "train"]
    plan = resolve(params, roots)
    assert isinstance(plan, RunPlan)
    assert plan.dataset_version == "20260102"  # scheduled runs and backfills: from the logical date
    assert plan.run_id == "20260102-manual__2026-01-02T02-00-00-00-00"
    cfg = load_config(plan.config_file, env={})
    assert plan.enriched_uri == layout.enriched_uri(cfg)
    assert plan.enriched_uri.startswith(roots["pipeline.store_uri"] + "/datasets/20260102/enriched/")
    assert plan.train_ready_uri.startswith(roots["pipeline.store_uri"] + "/datasets/20260102/train/")
    assert plan.model_uri == roots["pipeline.store_uri"] + f"/runs/{plan.run_id}/model"
    # the config file lives under the staging root, one per Airflow run
    assert plan.config_file.startswith(str(uris.to_local_path(roots["pipeline.staging_uri"])))
    # the trainer's container / Job name is a deterministic DNS name of the run id
    assert plan.trainer_name == "mft-train-20260102-manual-2026-01-02t02-00-00-00-00"


def test_valid_conf_maps_onto_the_config(dag, roots, tmp_path):
    conf = {"dataset_version": "v7", "seq_len": 64, "steps": 3, "learning_rate": 3e-4, "splits": ["chat", "math"],
            "min_qa_similarity": 0.1, "near_dup_threshold": 0.9, "relevance_threshold": 0.3,
            "base_model": "tiny", "run_id": "exp-1", "stages": ["enrich", "filter", "train"],
            "source_uri": uris.qualify(tmp_path / "raw"),
            "config_overrides": {"train.micro_batch_size": 2, "filter.val_fraction": 0.1}}
    plan = resolve(form(dag, conf), roots, allowed_source_prefixes=f"[{uris.qualify(tmp_path)}]")
    cfg = yaml.safe_load(open(plan.config_file))
    assert cfg["pipeline"]["dataset_version"] == "v7" and cfg["pipeline"]["run_id"] == "exp-1"
    assert cfg["filter"]["seq_len"] == cfg["train"]["seq_len"] == 64
    assert cfg["train"]["steps"] == 3 and cfg["train"]["learning_rate"] == 3e-4
    assert cfg["train"]["micro_batch_size"] == 2 and cfg["filter"]["val_fraction"] == 0.1
    assert cfg["enrich"]["splits"] == ["chat", "math"] and cfg["enrich"]["relevance_threshold"] == 0.3
    assert cfg["filter"]["min_qa_similarity"] == 0.1 and cfg["filter"]["near_dup_threshold"] == 0.9
    assert cfg["pipeline"]["source_uri"] == conf["source_uri"]
    assert plan.run_uri.endswith("/runs/exp-1")


@pytest.mark.parametrize("conf, field", [
    ({"steps": "ten"}, "steps"),                      # wrong type
    ({"steps": 0}, "steps"),                          # out of range
    ({"seq_len": 16}, "seq_len"),
    ({"learning_rate": 0}, "learning_rate"),
    ({"min_qa_similarity": 1.5}, "min_qa_similarity"),
    ({"source_uri": "s3://bucket/raw?versionId=1"}, "source_uri"),  # query: the object read is not the one named
    ({"source_uri": "s3://bucket/raw#frag"}, "source_uri"),
    ({"stages": []}, "stages"),
    ({"stages": ["enrich", "deploy"]}, "stages"),
    ({"splits": ["chat", "poetry"]}, "splits"),
    ({"splits": ["multilingual_xx"]}, "splits"),      # not a v2 language
    ({"splits": ["Multilingual_DE"]}, "splits"),      # split names are lower case
    ({"dataset_version": "../../etc"}, "dataset_version"),  # path traversal
    ({"run_id": "a/b"}, "run_id"),
    ({"source_uri": "/data/raw"}, "source_uri"),      # bare path: paths are URIs
    ({"config_overrides": {"Train.Steps!": 1}}, "config_overrides"),
])
def test_invalid_conf_is_refused_by_the_schema(dag, conf, field):
    with pytest.raises(ParamValidationError, match=f"param {field}"):
        form(dag, conf)


def test_v1_and_v2_split_names_are_accepted_by_the_form(dag, roots):
    params = form(dag, {"splits": ["multilingual_de", "multilingual_ja", "chat", "tool_calling"]})
    assert params["splits"] == ["multilingual_de", "multilingual_ja", "chat", "tool_calling"]
    cfg = load_config(resolve(params, roots).config_file, env={})
    assert cfg.enrich.splits == ["multilingual_de", "multilingual_ja", "chat", "tool"]  # the hub alias resolved


@pytest.mark.parametrize("conf, message", [
    ({"config_overrides": {"train.no_such_field": 1}}, "train.no_such_field"),
    ({"config_overrides": {"enrich.top_k": 0}}, "enrich.top_k"),
    ({"config_overrides": {"train.micro_batch_size": "two"}}, "train.micro_batch_size"),
    ({"source_uri": "file://relative/raw"}, "pipeline.source_uri"),
    ({"step": 5}, "unknown param"),                     # a typo'd param is not silently ignored
    ({"stages": ["train"]}, "stages"),                  # train alone needs a committed train-ready artifact
    ({"launcher": "docker"}, "unknown param"),          # the launcher is deployment configuration
    ({"config_overrides": {"train.global_batch_size": 6}}, "train.global_batch_size"),  # 6 % (1 x 4 ranks)
    # the retired LSH method: what to change, not "a deployment setting" (lsh_seed 0 too: a trigger never needs it)
    ({"config_overrides": {"filter.near_dup_method": "lsh"}}, "filter.near_dup_method 'lsh' was retired"),
    ({"config_overrides": {"filter.lsh_seed": 0}}, "filter.lsh_seed=0 was retired"),
    ({"config_overrides": {"filter.lsh_seed": 3}}, "set filter.near_dup_seed instead"),
    ({"config_overrides": {"filter.lsh_bands": 48}}, "filter.lsh_bands=48: settings of the LSH method"),
])
def test_invalid_conf_fails_the_first_task_naming_the_field(dag, roots, conf, message, tmp_path):
    params = {**form(dag, {}), **conf}
    with pytest.raises(PlanError, match=message.replace(".", r"\.")):
        resolve(params, roots, world_size=8)  # 8 ranks / 2 pipeline stages = 4 data-parallel ranks
    # nothing was computed or written: no resolved config, no store
    assert not uris.to_local_path(roots["pipeline.store_uri"]).exists()
    assert not list(uris.to_local_path(roots["pipeline.staging_uri"]).rglob("config.yaml"))


# each dangerous override a trigger could try: credentials, endpoints, where it writes, code it loads
@pytest.mark.parametrize("key, value", [
    ("storage.aws_conn_id", "someone_elses_connection"),
    ("storage.endpoint_url", "http://attacker.example:9000"),
    ("pipeline.store_uri", "s3://other-bucket/"),
    ("pipeline.staging_uri", "file:///tmp/elsewhere"),
    ("enrich.spark_conf", {"spark.jars": "http://attacker.example/x.jar"}),
    ("filter.spark_conf", {"spark.sql.files.ignoreCorruptFiles": "true"}),
    ("enrich.spark_master", "spark://attacker.example:7077"),
    ("train.ds_config", "file:///tmp/ds.json"),
    ("enrich.embedding_model", "someone/remote-code-model"),
    ("filter.tokenizer", "someone/tokenizer"),
])
def test_trigger_policy_refuses_deployment_settings(dag, roots, key, value):
    params = {**form(dag, {"config_overrides": {key: value}})}
    with pytest.raises(PlanError, match=rf"config_overrides: \['{re.escape(key)}'\] cannot be set by a trigger"):
        resolve(params, roots)
    assert not list(uris.to_local_path(roots["pipeline.staging_uri"]).rglob("config.yaml"))


def test_every_overridable_key_is_a_config_field():
    cfg = Config()
    for key in OVERRIDABLE:
        section, field = key.split(".")
        assert field in type(getattr(cfg, section)).model_fields, key


def test_global_batch_fixes_sequences_per_step_whatever_the_gpu_count(dag, roots):
    conf = {"config_overrides": {"train.global_batch_size": 16, "train.micro_batch_size": 2}}
    for world_size, accumulation in ((2, 8), (4, 4), (16, 1)):  # pipeline_stages=2: dp = world_size / 2
        plan = resolve(form(dag, conf), roots, world_size=world_size)
        train = load_config(plan.config_file, env={}).train
        assert train.accumulation_steps(world_size) == accumulation
        assert accumulation * train.micro_batch_size * (world_size // train.pipeline_stages) == 16
    with pytest.raises(PlanError, match="train.global_batch_size=16 is not a multiple of .* = 32"):
        resolve(form(dag, conf), roots, world_size=32)


def test_run_names_are_safe_path_components():
    assert safe_run_name("backfill__2026-01-01T02:00:00+00:00") == "backfill__2026-01-01T02-00-00-00-00"
    assert ".." not in safe_run_name("manual__..//..")
    assert safe_run_name("////") == "run"


def test_store_uris_with_a_query_or_fragment_are_refused(dag, tmp_path):
    """urlsplit would drop '?…'/'#…': the object written would not be the one named."""
    for store in ("s3://bucket/mft?versionId=1", "s3://bucket/mft#x"):
        roots = {"pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp_path / "staging")}
        with pytest.raises(PlanError, match="query or fragment"):
            resolve(form(dag, {}), roots)
