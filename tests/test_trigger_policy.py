"""The deployment's policy wins over a trigger's params, through `resolve` (`resolve_plan`, what the
DAG's first task runs) with the DAG's own Params schema: a required approval cannot be turned off,
forcing a promotion needs a listed user, a logical date far ahead is refused, and a trigger reads
only from the deployment's allowed sources and base models (issue 26.5, 26.8b). Each refusal
happens before anything is written, with a message naming the field and the setting."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import yaml
from airflow.dag_processing.dagbag import DagBag

from pipeline_core import uris
from pipeline_core.config import load_config
from plugins.mft_airflow.plan import PlanError, resolve_plan
from plugins.mft_airflow.settings import load_settings
from tests.dag_helpers import DAG_ID, REPO
from tests.test_dag_params import form

NOW = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def dag():
    return DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]


@pytest.fixture
def deploy(tmp_path):
    """A deployment config file (store, staging) and its MFT_DEPLOY__ environment."""
    def make(release: dict | None = None, **deploy_env: str):
        cfg = {"pipeline": {"store_uri": uris.qualify(tmp_path / "store"),
                            "staging_uri": uris.qualify(tmp_path / "staging")}, "release": release or {}}
        path = tmp_path / "deploy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {f"MFT_DEPLOY__{k.upper()}": v for k, v in deploy_env.items()}
        return str(path), env
    return make


def _resolve(dag, conf, deploy_cfg, *, user="alice", run_date=NOW):
    config_file, env = deploy_cfg
    return resolve_plan(form(dag, conf), dag_id=DAG_ID, airflow_run_id="manual__x", run_date=run_date,
                        config_file=config_file, env=env, triggered_by=user, now=NOW)


def _nothing_written(tmp_path):
    assert not list((tmp_path / "staging").rglob("config.yaml")) and not (tmp_path / "store").exists()


def test_a_required_approval_cannot_be_turned_off_by_a_trigger(dag, deploy, tmp_path):
    required = deploy({"require_approval": True})
    with pytest.raises(PlanError, match=r"require_approval: this deployment requires an approval"):
        _resolve(dag, {"require_approval": False}, required)
    _nothing_written(tmp_path)
    plan = _resolve(dag, {}, required)  # left to the deployment: the gate stays on
    assert load_config(plan.config_file, env={}).release.require_approval
    # a trigger may still turn the gate on where the deployment does not require it
    plan = _resolve(dag, {"require_approval": True}, deploy())
    assert load_config(plan.config_file, env={}).release.require_approval


def test_force_promote_needs_a_user_the_deployment_lists(dag, deploy, tmp_path):
    with pytest.raises(PlanError, match=r"force_promote: user 'mallory' may not force.*MFT_DEPLOY__FORCE_PROMOTE_USERS"):
        _resolve(dag, {"force_promote": True}, deploy(force_promote_users="[alice]"), user="mallory")
    with pytest.raises(PlanError, match="force_promote: user None"):  # a run nobody triggered by hand
        _resolve(dag, {"force_promote": True}, deploy(force_promote_users="[alice]"), user=None)
    _nothing_written(tmp_path)
    plan = _resolve(dag, {"force_promote": True}, deploy(force_promote_users="[alice]"), user="alice")
    assert load_config(plan.config_file, env={}).release.force_promote
    assert not load_config(_resolve(dag, {"force_promote": False}, deploy(), user="mallory").config_file,
                           env={}).release.force_promote


def test_a_logical_date_far_ahead_is_refused(dag, deploy, tmp_path):
    with pytest.raises(PlanError, match=r"logical_date: 2100-01-01.*release\.max_order_key_ahead_s=3600"):
        _resolve(dag, {}, deploy(), run_date=datetime(2100, 1, 1, tzinfo=UTC))
    _nothing_written(tmp_path)
    _resolve(dag, {}, deploy(), run_date=NOW + timedelta(minutes=30))  # clock skew within the tolerance


@pytest.mark.parametrize("source", [
    "file:///", "file:///etc", "s3://someone-elses-bucket/raw",
    "file:///allowed/raw-other",                      # a sibling that shares the prefix's characters
    "file:///allowed/raw/../../etc",                  # climbs out (refused by the URI check already)
])
def test_a_trigger_reads_only_from_allowed_sources(dag, deploy, tmp_path, source):
    with pytest.raises(PlanError, match=r"source_uri: .*(not under the deployment's allowed sources.*"
                                        r"MFT_DEPLOY__ALLOWED_SOURCE_PREFIXES|contains '\.\.')"):
        _resolve(dag, {"source_uri": source}, deploy(allowed_source_prefixes="[file:///allowed/raw]"))
    _nothing_written(tmp_path)


def test_allowed_sources_and_models_resolve(dag, deploy):
    cfg = deploy(allowed_source_prefixes="[file:///allowed/raw, 'hf://datasets/nvidia/']",
                 allowed_base_models="[tiny, 'mistralai/']")
    for conf in ({"source_uri": "file:///allowed/raw/v2"}, {"source_uri": "hf://datasets/nvidia/Nemotron-Post"},
                 {"base_model": "mistralai/Mistral-7B-v0.1"}, {"base_model": "tiny"}):
        plan = _resolve(dag, conf, cfg)
        got = load_config(plan.config_file, env={})
        assert conf.get("source_uri", got.pipeline.source_uri) == got.pipeline.source_uri
        assert conf.get("base_model", got.train.base_model) == got.train.base_model
    # the defaults: the embedded sample and the embedded tiny model only
    default = load_settings(env={})
    assert default.allowed_base_models == ("tiny",) and default.allowed_source_prefixes[0].endswith("/sample_data")


@pytest.mark.parametrize("model", ["/", "/home/someone/model", "someone/remote-code-model", "mistralai-evil/x",
                                   "/models/ok/../../etc"])
def test_a_trigger_loads_only_allowed_base_models(dag, deploy, tmp_path, model):
    with pytest.raises(PlanError, match=r"base_model: .* not among the deployment's allowed base models.*"
                                        r"MFT_DEPLOY__ALLOWED_BASE_MODELS"):
        _resolve(dag, {"base_model": model}, deploy(allowed_base_models="[tiny, 'mistralai/', /models/ok]"))
    _nothing_written(tmp_path)
