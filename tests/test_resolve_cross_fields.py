"""`resolve` refuses, before any compute, every combination of settings a later stage would refuse
after hours of work (issue 26.6): the trainer's (data packed to another length, more positions or
pipeline stages than the base model has, a non-Mistral or tied-embedding model) and the publish
task's (no val split to score on). Each message names the fields."""

from __future__ import annotations

import json

import pytest

from plugins.mft_airflow.plan import PlanError
from tests.test_trigger_policy import _nothing_written, _resolve, dag, deploy  # noqa: F401 - fixtures


@pytest.mark.parametrize("conf, message", [
    ({"config_overrides": {"filter.val_fraction": 0}}, r"filter\.val_fraction=0: the publish task scores"),
    ({"config_overrides": {"train.seq_len": 512}}, r"train\.seq_len=512 != filter\.seq_len=1024"),
    ({"config_overrides": {"filter.seq_len": 256}}, r"train\.seq_len=1024 != filter\.seq_len=256"),
    ({"seq_len": 4096}, r"train\.seq_len=4096 exceeds train\.base_model='tiny''s max_position_embeddings=2048"),
    ({"config_overrides": {"train.pipeline_stages": 8}}, r"train\.pipeline_stages=8 exceeds .*'tiny''s 7 pipe layers"),
])
def test_combinations_later_stages_refuse_are_refused_by_resolve(dag, deploy, tmp_path, conf, message):  # noqa: F811
    with pytest.raises(PlanError, match=message):
        _resolve(dag, conf, deploy())
    _nothing_written(tmp_path)


def test_a_local_base_model_is_checked_from_its_config_json(dag, deploy, tmp_path):  # noqa: F811
    model = tmp_path / "models" / "gemma"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "gemma", "tie_word_embeddings": True,
                                                   "max_position_embeddings": 8192, "num_hidden_layers": 2}))
    cfg = deploy(allowed_base_models=f"[{tmp_path / 'models'}/]")
    with pytest.raises(PlanError) as e:
        _resolve(dag, {"base_model": str(model), "config_overrides": {"train.pipeline_stages": 6}}, cfg)
    text = str(e.value)
    assert "is a 'gemma' model" in text and "ties its input and output embeddings" in text
    assert "train.pipeline_stages=6 exceeds" in text and "5 pipe layers" in text
    _nothing_written(tmp_path)


def test_train_left_out_needs_no_train_rule(dag, deploy):  # noqa: F811
    _resolve(dag, {"stages": ["enrich", "filter"], "config_overrides": {"filter.val_fraction": 0}}, deploy())
