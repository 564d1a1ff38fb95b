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


def test_long_context_preset_fits_two_h200s_by_the_estimate():
    """configs/mistral-7b-2xh200-16k.yaml: the stage-memory estimate that train.py checks before
    weights load accepts it on 2 x H200 (Mistral-7B v0.3's shape), and picks some recomputation."""
    from transformers import MistralConfig

    from training.runtime import Settings
    from training.train import plan_recompute

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "mistral-7b-2xh200-16k.yaml", env={})
    v03 = MistralConfig(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                        sliding_window=None)
    mode, every, memory = plan_recompute(cfg.train, v03, 1, Settings("bf16", "torch_varlen", "liger", True),
                                         143771 * 2**20)
    assert mode != "none" and memory.total < 0.93 * 143771 * 2**20
