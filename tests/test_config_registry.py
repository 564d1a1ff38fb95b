"""One declaration per config field (pipeline_core/config.py `content(...)` / `execution(...)`):
every classification is derived from it, and nothing is left unclassified."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from pipeline_core import config as cfgmod
from pipeline_core import layout
from pipeline_core.config import Config, FilterSection, Role, TrainSection, load_config
from pipeline_core.config_reference import render
from plugins.mft_airflow.params import OVERRIDABLE

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_every_field_declares_its_role():
    assert cfgmod.unclassified_fields() == []


def test_a_field_without_a_role_is_found(monkeypatch):
    class Filter2(FilterSection):
        new_knob: int = Field(3)

    monkeypatch.setattr(Config.model_fields["filter"], "annotation", Filter2)
    assert cfgmod.unclassified_fields() == ["filter.new_knob"]


def test_the_config_reference_is_generated_from_the_declarations():
    assert DOC.read_text() == render(), "regenerate: python -m pipeline_core.config_reference > docs/config.md"
    assert "**unclassified**" not in render()


@pytest.mark.parametrize("key, value", [("enrich.embedding_batch_size", 7), ("enrich.embedding_threads", 1),
                                        ("filter.near_dup_recall_sample", 5), ("filter.shuffle_partitions", 9),
                                        ("filter.spark_master", "spark://x:7077")])
def test_execution_settings_do_not_change_artifact_ids(key, value):
    base, other = load_config(), load_config(overrides={key: value})
    assert (layout.enriched_id(base), layout.train_ready_id(base)) == (
        layout.enriched_id(other), layout.train_ready_id(other))


@pytest.mark.parametrize("key, value", [("enrich.top_k", 7), ("filter.near_dup_cluster_size", 64),
                                        ("filter.train_on", "last_assistant_turn")])
def test_content_settings_change_artifact_ids(key, value):
    assert layout.train_ready_id(load_config()) != layout.train_ready_id(load_config(overrides={key: value}))


def test_resume_ignores_execution_settings_and_only_those():
    execution = TrainSection.fields_of(Role.EXECUTION)
    assert {"io_timeout_s", "max_bad_steps", "eval_every", "fused_wgrad_accumulation", "fused_grad_accumulation",
            "steps"} <= execution
    assert {"learning_rate", "seq_len", "base_model", "precision", "fp8"}.isdisjoint(execution)
    kept = layout.train_content_settings(TrainSection().model_dump(mode="json"))
    assert set(kept) == set(TrainSection.model_fields) - execution


def test_trigger_allowlist_is_derived_and_covers_the_default_methods_knobs():
    assert OVERRIDABLE == cfgmod.trigger_overridable()
    assert {"filter.near_dup_cluster_size", "filter.near_dup_probes", "filter.near_dup_seed", "filter.train_on",
            "filter.prompt_context",
            "train.eval_every"} <= OVERRIDABLE
    # what redirects I/O, credentials or code stays deployment configuration
    assert {"pipeline.store_uri", "pipeline.staging_uri", "storage.endpoint_url", "enrich.spark_conf",
            "filter.spark_master", "filter.tokenizer", "enrich.embedding_model", "train.ds_config",
            "train.base_model"}.isdisjoint(OVERRIDABLE)
