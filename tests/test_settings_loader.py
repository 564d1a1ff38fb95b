"""The one settings loader (pipeline_core/settings_loader.py): precedence, YAML values, refusals,
the injected environment, for the pipeline config (MFT__), the deployment (MFT_DEPLOY__) and the
process variables (MFT_CODE_VERSION, ...)."""

from __future__ import annotations

import pytest
import yaml

from pipeline_core import artifacts
from pipeline_core.config import ConfigError, load_config
from pipeline_core.settings_loader import ProcessSettings, load_process_settings
from plugins.mft_airflow.settings import load_settings
from training import checkpoints, lease


def test_precedence_defaults_file_env_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"enrich": {"top_k": 2, "embedding_batch_size": 11,
                                            "spark_conf": {"spark.a": "1", "spark.b": "2"}}}))
    env = {"MFT__ENRICH__TOP_K": "3", "MFT__ENRICH__SPARK_CONF": "{spark.c: '3'}"}
    cfg = load_config(f, env=env, overrides={"enrich.top_k": 4})
    assert cfg.enrich.top_k == 4  # overrides > env > file
    assert cfg.enrich.embedding_batch_size == 11  # a section merges field by field: the file's other fields stay
    assert cfg.enrich.spark_conf == {"spark.c": "3"}  # a dict field is set whole, never merged key by key
    assert cfg.filter.min_qa_similarity == load_config(env={}).filter.min_qa_similarity  # defaults under all
    assert load_config(f, env=env).enrich.top_k == 3  # env > file
    assert load_config(f, env={}, overrides={"enrich": {"spark_conf": {"spark.d": "4"}}}).enrich.spark_conf == {
        "spark.d": "4"}


def test_env_values_are_yaml():
    cfg = load_config(env={"MFT__ENRICH__SPLITS": "[chat, code]", "MFT__ENRICH__ACCEPT_CORRUPT_FILE_LOSS": "true",
                           "MFT__FILTER__MIN_QA_SIMILARITY": "0.25", "MFT__PIPELINE__RUN_ID": ""})
    assert cfg.enrich.splits == ["chat", "code"]
    assert cfg.enrich.accept_corrupt_file_loss is True
    assert cfg.filter.min_qa_similarity == 0.25
    assert cfg.pipeline.run_id is None  # empty: None
    assert load_config(env={"mft__enrich__top_k": "9"}).enrich.top_k == load_config(env={}).enrich.top_k  # prefix: upper
    assert load_config(env={"MFT__Enrich__Top_K": "9"}).enrich.top_k == 9  # names: any case


@pytest.mark.parametrize("key,message", [
    ("MFT__ENRICH", "environment variable MFT__ENRICH: expected MFT__<SECTION>__<FIELD>"),
    ("MFT__ENRICH__SPARK_CONF__X", "expected MFT__<SECTION>__<FIELD>"),
    ("MFT__ENRICH__", "expected MFT__<SECTION>__<FIELD>"),
    ("MFT__NOSUCH__TOP_K", "nosuch: Extra inputs are not permitted"),
    ("MFT__ENRICH__NOSUCH", "enrich.nosuch: Extra inputs are not permitted"),
])
def test_unknown_or_misshapen_variables_are_refused(key, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config(env={key: "1"})


def test_unparseable_env_value_is_a_config_error_naming_the_variable():
    with pytest.raises(ConfigError, match="MFT__ENRICH__SPLITS"):
        load_config(env={"MFT__ENRICH__SPLITS": "[chat, code"})


def test_a_non_mapping_section_is_refused_where_a_later_source_sets_its_fields(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("enrich: 5\n")
    with pytest.raises(ConfigError, match="config section 'enrich' must be a mapping"):
        load_config(f, env={"MFT__ENRICH__TOP_K": "3"})


def test_only_the_injected_env_is_read(monkeypatch):
    monkeypatch.setenv("MFT__ENRICH__TOP_K", "6")
    monkeypatch.setenv("MFT_DEPLOY__GPUS", "3")
    monkeypatch.setenv("MFT_CODE_VERSION", "from-os")
    assert load_config(env={}).enrich.top_k != 6
    assert load_config().enrich.top_k == 6  # default: os.environ
    assert load_settings(env={}).gpus == 8
    assert load_settings().gpus == 3
    assert load_process_settings({}).code_version is None
    assert load_process_settings().code_version == "from-os"


def test_deploy_settings_parse_yaml_keep_text_and_layer():
    s = load_settings(env={"MFT_DEPLOY__SCHEDULE": "@daily", "MFT_DEPLOY__START_DATE": "2026-02-03",
                           "MFT_DEPLOY__NODE_SELECTOR": "{pool: gpu}", "MFT_DEPLOY__ENV_PASSTHROUGH": "[A, B]",
                           "MFT_DEPLOY__CPU_REQUEST": "8", "MFT_DEPLOY__DOCKER_NETWORK": "",
                           "MFT_CONFIG": "/etc/mft.yaml"}, gpus=2)
    assert s.schedule == "@daily"  # not YAML: its text
    assert s.start_date == "2026-02-03"  # date-like: its text
    assert s.node_selector == {"pool": "gpu"} and s.env_passthrough == ("A", "B")
    assert s.cpu_request == "8" and s.docker_network is None and s.gpus == 2
    assert s.config_file == "/etc/mft.yaml"  # MFT_CONFIG names the config file
    both = {"MFT_CONFIG": "/a.yaml", "MFT_DEPLOY__CONFIG_FILE": "/b.yaml"}
    assert load_settings(env=both).config_file == "/b.yaml"  # MFT_DEPLOY__CONFIG_FILE wins over MFT_CONFIG
    assert load_settings(env=both, config_file="/c.yaml").config_file == "/c.yaml"  # keywords win over both
    with pytest.raises(ValueError, match="MFT_DEPLOY__SPARK_CONF__X: Extra inputs are not permitted"):
        load_settings(env={"MFT_DEPLOY__SPARK_CONF__X": "1"})


def test_process_settings_are_text_and_feed_their_readers(tmp_path, monkeypatch):
    p = load_process_settings({"MFT_CODE_VERSION": "1234567", "MFT_ATTEMPT_ID": "", "MFT__ENRICH__TOP_K": "1",
                               "MFT_DEPLOY__GPUS": "1", "MFT_CHECKPOINT_HMAC_KEY": "k" * 20})
    assert p.code_version == "1234567"  # a commit id stays text
    assert p.attempt_id is None  # empty: unset
    assert p.checkpoint_hmac_key is not None and "k" * 20 not in repr(p)  # a secret is not printed
    assert ProcessSettings.env_name("checkpoint_hmac_key_file") == "MFT_CHECKPOINT_HMAC_KEY_FILE"
    with pytest.raises(KeyError):
        ProcessSettings.env_name("nosuch")

    monkeypatch.setenv("MFT_CODE_VERSION", "abc123")
    artifacts.code_version.cache_clear()
    try:
        assert artifacts.code_version() == "abc123"
    finally:
        artifacts.code_version.cache_clear()
    monkeypatch.setenv("MFT_CHECKPOINT_HMAC_KEY", "s" * 16)
    assert checkpoints.hmac_key(str(tmp_path)) == b"s" * 16
    monkeypatch.delenv("MFT_CHECKPOINT_HMAC_KEY")
    monkeypatch.setenv("MFT_CHECKPOINT_HMAC_KEY_FILE", str(tmp_path / "missing.key"))
    with pytest.raises(checkpoints.CheckpointError, match="MFT_CHECKPOINT_HMAC_KEY_FILE=.*no such file"):
        checkpoints.hmac_key(str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("MFT_ATTEMPT_ID", "manual__x-try3")
    assert lease.attempt_id() == "manual__x-try3"
