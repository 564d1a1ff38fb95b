"""Shipped config presets load and validate (a typo in one would fail only on a GPU node)."""

from pathlib import Path

import pytest

from pipeline_core.config import load_config

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_presets():
    assert PRESETS


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_validates_and_is_consistent(path):
    cfg = load_config(path, env={})
    assert cfg.filter.seq_len == cfg.train.seq_len, "train.seq_len must equal the packed shards' seq_len"
    assert cfg.filter.max_tokens <= cfg.filter.seq_len or cfg.filter.overflow == "truncate"
