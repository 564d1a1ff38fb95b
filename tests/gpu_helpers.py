"""Shared by the GPU checks (tests/test_gpu_kernels.py, tests/gpu_pipeline_probe.py): the error
measure, the recorded limit check, a tiny Mistral config with the trainer's attention backend."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """|out - ref| / |ref| (norms, float64); inf when out is not finite."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Limits:
    """Each measured value against its limit: recorded (junit property, printed) whether or not it
    passes, so a run keeps every number; `failed` lists the ones over their limits."""

    def __init__(self, record_property=None):
        self.record = record_property or (lambda name, value: None)
        self.failed: dict[str, tuple[float, float]] = {}

    def note(self, name: str, value: float) -> None:
        self.record(name, value)
        print(f"{name}: {value:.3e}", flush=True)

    def check(self, name: str, value: float, limit: float) -> bool:
        ok = value <= limit
        self.record(name, value)
        self.record(f"{name}_limit", limit)
        print(f"{'PASS' if ok else 'FAIL'} {name}: {value:.3e} (limit {limit:.0e})", flush=True)
        if not ok:
            self.failed[name] = (value, limit)
        return ok


def tiny_config(hidden=512, layers=2, vocab=32000, attn="torch_varlen", seq=1024):
    from transformers import MistralConfig

    from training.kernels import register_attention
    from training.model import prepare_hf_config

    register_attention(attn)
    cfg = MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                        sliding_window=4096, tie_word_embeddings=False)
    return prepare_hf_config(cfg, attn, seq)
