"""Invalid training setups fail before any weights load, with a message naming the field."""

from __future__ import annotations

import pytest

from pipeline_core import uris
from pipeline_core.config import load_config
from tests.training_helpers import build_train_ready, make_tiny_model
from training import train


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-cfg")
    store = uris.qualify(tmp / "store")
    (tmp / "store").mkdir()
    model = make_tiny_model(tmp / "tiny")
    ready = build_train_ready(store, tmp / "ready", seq_len=64, n_train_docs=20, n_val_docs=4)
    return tmp, store, model, ready


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    """Any attempt to load weights or start the process group fails the test."""
    import training.weights

    def boom(*a, **k):
        raise AssertionError("weights loaded before validation finished")

    monkeypatch.setattr(training.weights, "load_stage_weights", boom)
    monkeypatch.setattr(train, "Trainer", boom)


def _main(env, monkeypatch, world_size=2, input_uri=None, **train_overrides):
    tmp, store, model, ready = env
    cfg = load_config(overrides={"pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp / "staging"),
                                 "train.base_model": str(model), "train.seq_len": 64,
                                 **{f"train.{k}": v for k, v in train_overrides.items()}})
    path = cfg.dump(tmp / "cfg.yaml")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return train.main(["--input", input_uri or ready, "--output", uris.join(store, "runs", "r"), "--config", str(path)])


def test_stages_must_divide_world_size(env, monkeypatch):
    with pytest.raises(train.TrainConfigError, match=r"train.pipeline_stages=2 does not divide the world size 3"):
        _main(env, monkeypatch, world_size=3, pipeline_stages=2)


def test_seq_len_over_model_maximum(env, monkeypatch):
    with pytest.raises(train.TrainConfigError, match=r"train.seq_len=4096 exceeds the model's max_position_embeddings=2048"):
        _main(env, monkeypatch, seq_len=4096)


def test_seq_len_must_match_the_artifact(env, monkeypatch):
    with pytest.raises(train.TrainConfigError, match=r"train.seq_len=128 but the input artifact is packed to seq_len=64"):
        _main(env, monkeypatch, seq_len=128)


def test_missing_input_artifact(env, monkeypatch):
    _, store, _, _ = env
    missing = uris.join(store, "datasets", "nope", "train", "x")
    with pytest.raises(train.TrainConfigError, match=r"--input .*nope.*no committed train-ready artifact"):
        _main(env, monkeypatch, input_uri=missing)


def test_bare_paths_are_refused(env, monkeypatch):
    with pytest.raises(ValueError, match="--input"):
        _main(env, monkeypatch, input_uri="/tmp/not/a/uri")


def test_more_stages_than_layers(env, monkeypatch):
    with pytest.raises(train.TrainConfigError, match=r"train.pipeline_stages=8 exceeds the model's 7 pipe layers"):
        _main(env, monkeypatch, world_size=8, pipeline_stages=8)


def test_config_file_rejects_unknown_values():
    from pipeline_core.config import ConfigError

    with pytest.raises(ConfigError, match="train.attention_backend"):
        load_config(overrides={"train.attention_backend": "magic"})
    with pytest.raises(ConfigError, match="train.partition_method"):
        load_config(overrides={"train.partition_method": "by-vibes"})
