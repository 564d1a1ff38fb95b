"""URIs are always fully qualified and cannot escape their prefix; the config validates at load."""

from __future__ import annotations

import pytest

from pipeline_core import layout, uris
from pipeline_core.config import ConfigError, load_config


def test_qualify_makes_local_paths_explicit(tmp_path):
    uri = uris.qualify(tmp_path / "a b")
    assert uri.startswith("file:///") and uri.endswith("/a%20b")
    assert uris.to_local_path(uri) == tmp_path / "a b"
    assert uris.qualify("s3://bucket/x") == "s3://bucket/x"


@pytest.mark.parametrize("bare", ["data/out", "/abs/path", "./x", "bucket/key"])
def test_bare_paths_are_refused_where_a_uri_is_required(bare):
    with pytest.raises(ValueError, match="bare path"):
        uris.require_uri(bare, "--output")


@pytest.mark.parametrize("bad", ["s3:///nobucket", "ftp://host/x", "file://host/x", "s3://b/a/../../c"])
def test_malformed_or_escaping_uris_are_refused(bad):
    with pytest.raises(ValueError):
        uris.require_uri(bad)


def test_spark_and_boto_forms():
    assert uris.to_spark_uri("s3://bucket/a/b") == "s3a://bucket/a/b"
    assert uris.to_spark_uri("file:///tmp/x") == "file:///tmp/x"
    assert uris.require_uri("s3a://bucket/a") == "s3://bucket/a"
    assert uris.split_bucket_key("s3://bucket/a/b") == ("bucket", "a/b")
    assert uris.join("s3://bucket/", "runs", "r1/") == "s3://bucket/runs/r1"
    assert uris.parent("s3://bucket/runs/r1") == "s3://bucket/runs"


@pytest.mark.parametrize("rid", ["../x", "a/b", "..", "", "-lead", "x" * 129, "a..b"])
def test_run_ids_cannot_escape(rid):
    with pytest.raises(ValueError, match="run_id"):
        uris.safe_component(rid, "run_id")


def test_defaults_are_embedded_and_valid():
    cfg = load_config(env={})
    assert cfg.pipeline.store_uri.startswith("file:///")
    assert cfg.pipeline.source_uri.endswith("sample_data/nemotron_v1")
    assert cfg.enrich.spark_master.startswith("local")


def test_file_env_and_override_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("enrich:\n  top_k: 3\n  splits: [chat]\nstorage:\n  max_attempts: 4\n")
    cfg = load_config(f, env={"MFT__ENRICH__TOP_K": "7", "MFT__STORAGE__ENDPOINT_URL": "http://127.0.0.1:9000"},
                      overrides={"enrich.relevance_threshold": 0.5})
    assert cfg.enrich.top_k == 7  # env beats file
    assert cfg.enrich.splits == ["chat"]  # file beats default
    assert cfg.storage.max_attempts == 4
    assert cfg.storage.endpoint_url == "http://127.0.0.1:9000"
    assert cfg.enrich.relevance_threshold == 0.5
    cfg2 = load_config(f, env={}, overrides={"enrich": {"top_k": 9}})
    assert cfg2.enrich.top_k == 9


def test_dump_round_trip(tmp_path):
    cfg = load_config(env={}, overrides={"pipeline.dataset_version": "2026-11-30"})
    p = cfg.dump(tmp_path / "resolved.yaml")
    again = load_config(p, env={})
    assert again == cfg
    assert again.section_hash("enrich") == cfg.section_hash("enrich")
    assert layout.enriched_uri(again).endswith(f"/datasets/2026-11-30/enriched/{layout.enriched_id(again)}")


@pytest.mark.parametrize(
    ("override", "field", "hint"),
    [
        ({"enrich.top_k": 0}, "enrich.top_k", "greater than or equal to 1"),
        ({"storage.max_attempts": 99}, "storage.max_attempts", "less than or equal to 20"),
        ({"enrich.splits": ["chat", "Poetry/x"]}, "enrich.splits", "Poetry/x"),
        ({"pipeline.dataset_version": "../../etc"}, "pipeline.dataset_version", "not allowed"),
        ({"pipeline.store_uri": "relative/store"}, "pipeline.store_uri", "bare path"),
        ({"enrich.reasoning": "maybe"}, "enrich.reasoning", "separate"),
        ({"enrich.nonsense": 1}, "enrich.nonsense", "Extra inputs"),
        ({"train.warmup_steps": 0}, "train.warmup_steps", "greater than or equal to 1"),
    ],
)
def test_invalid_values_name_the_field(override, field, hint):
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides=override)
    assert field in str(e.value) and hint in str(e.value)


def test_bad_env_variable_is_named():
    with pytest.raises(ConfigError, match="MFT__TOPK"):
        load_config(env={"MFT__TOPK": "3"})
    with pytest.raises(ConfigError, match="enrich.top_k"):
        load_config(env={"MFT__ENRICH__TOP_K": "lots"})


def test_changing_a_section_changes_only_its_artifact_ids():
    a = load_config(env={})
    b = load_config(env={}, overrides={"filter.min_qa_similarity": 0.5})
    assert layout.enriched_id(a) == layout.enriched_id(b)
    assert layout.train_ready_id(a) != layout.train_ready_id(b)


def test_execution_settings_do_not_move_artifacts():
    """Running on a cluster instead of a laptop must find the artifacts already committed."""
    a = load_config(env={})
    b = load_config(env={}, overrides={"enrich.spark_master": "spark://master:7077", "enrich.shuffle_partitions": 400,
                                       "filter.spark_master": "yarn", "filter.spark_conf": {"spark.executor.memory": "8g"}})
    assert layout.enriched_id(a) == layout.enriched_id(b)
    assert layout.train_ready_id(a) == layout.train_ready_id(b)
    c = load_config(env={}, overrides={"enrich.top_k": 2})
    assert layout.enriched_id(a) != layout.enriched_id(c)
    assert layout.train_ready_id(a) != layout.train_ready_id(c), "a new enriched input means new train-ready data"


OLD_LSH_DEFAULTS = {"lsh_bands": 48, "lsh_min_band_matches": 2, "lsh_rows_per_band": 16, "lsh_max_leaders": 32,
                    "lsh_seed": 0}


@pytest.mark.parametrize("settings, expect", [
    ({"near_dup_method": "lsh"}, r"filter.near_dup_method 'lsh' was retired in issue 33 .*use 'cluster' \(the default\)"),
    ({"lsh_seed": 7}, r"filter.lsh_seed=7 was retired .*set filter.near_dup_seed instead"),
    ({"lsh_bands": 64, "lsh_max_leaders": 8}, r"filter.lsh_bands=64, filter.lsh_max_leaders=8: settings of the LSH "
                                              r"method, retired in issue 33: remove them"),
])
@pytest.mark.parametrize("source", ["file", "env", "override"])
def test_the_retired_lsh_method_is_refused_saying_what_to_change(tmp_path, settings, expect, source):
    import yaml

    path, env, overrides = None, {}, None
    if source == "file":
        path = tmp_path / "old.yaml"
        path.write_text(yaml.safe_dump({"filter": settings}))
    elif source == "env":
        env = {f"MFT__FILTER__{k.upper()}": str(v) for k, v in settings.items()}
    else:
        overrides = {f"filter.{k}": v for k, v in settings.items()}
    with pytest.raises(ConfigError, match=expect) as e:
        load_config(path, overrides=overrides, env=env)
    assert "Extra inputs" not in str(e.value)


def test_a_config_dumped_before_the_lsh_retirement_still_loads(tmp_path):
    """Every config the old code dumped (each in-flight run's resolved file) holds the LSH settings at
    their defaults: they changed nothing under 'cluster', so the file loads as today's defaults and a
    run resumes across the upgrade; near_dup_seed, added since, reads as its default."""
    import yaml

    old = load_config(env={}).model_dump(mode="json")
    del old["filter"]["near_dup_seed"]
    old["filter"].update(OLD_LSH_DEFAULTS)
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(old))
    assert load_config(path, env={}) == load_config(env={})
