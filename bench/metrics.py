"""Accounting for the throughput benchmark: MFU, pipeline bubble, step statistics.

FLOPs per token come from ``training.flops`` (the trainer's own function), on the published
convention: non-embedding N, full attention credit on plain causal rows,

    MFU = tokens/s/GPU * (6 * N + 12 * L * heads * head_dim * seq_len) / 989e12

Packed rows are reported as tokens/s and with document-aware FLOPs beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from training.flops import H200_PEAK_FLOPS as H100_H200_BF16_DENSE_FLOPS
from training.flops import ModelShape, flops_per_token
from training.flops import mfu as mfu_of

MISTRAL_7B = ModelShape(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128,
)


def model_mfu(tokens_per_s_per_gpu: float, shape: ModelShape, seq_len: int, peak: float = H100_H200_BF16_DENSE_FLOPS) -> float:
    return mfu_of(tokens_per_s_per_gpu, flops_per_token(shape, seq_len), peak)


def tokens_per_s_for_mfu(target: float, shape: ModelShape, seq_len: int, peak: float = H100_H200_BF16_DENSE_FLOPS) -> float:
    return target * peak / flops_per_token(shape, seq_len)


def analytic_bubble(stages: int, micro_batches: int) -> float:
    """Idle share of a 1F1B / GPipe schedule with equal stages: (p - 1) / (m + p - 1)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError("stages and micro_batches must be >= 1")
    return (stages - 1) / (micro_batches + stages - 1)


def bubble_share(step_time_s: float, busy_s: float) -> float:
    """Share of a stage's step not spent computing (waiting on the other stage, P2P, host stalls).
    ``busy_s`` = GPU time of the stage's forward, backward and optimizer instructions."""
    if step_time_s <= 0:
        raise ValueError("step_time_s must be > 0")
    return min(1.0, max(0.0, 1.0 - busy_s / step_time_s))


@dataclass(frozen=True)
class StepStats:
    median_s: float
    mean_s: float
    min_s: float
    max_s: float
    n: int

    @classmethod
    def of(cls, times: list[float]) -> StepStats:
        if not times:
            raise ValueError("no timed steps")
        return cls(statistics.median(times), statistics.fmean(times), min(times), max(times), len(times))


def throughput_summary(
    *,
    step_times_s: list[float],
    tokens_per_step: int,
    num_gpus: int,
    shape: ModelShape,
    seq_len: int,
    energy_j: float | None = None,
    timed_tokens: int | None = None,
) -> dict:
    """The numbers every setup reports. ``energy_j`` is summed over the GPUs the setup uses during
    the timed steps, which processed ``timed_tokens`` tokens in total."""
    stats = StepStats.of(step_times_s)
    tps_gpu = tokens_per_step / stats.median_s / num_gpus
    out = {
        "step_time_median_s": stats.median_s,
        "step_time_min_s": stats.min_s,
        "step_time_max_s": stats.max_s,
        "timed_steps": stats.n,
        "tokens_per_step": tokens_per_step,
        "num_gpus": num_gpus,
        "tokens_per_s_per_gpu": tps_gpu,
        "mfu": model_mfu(tps_gpu, shape, seq_len),
        "model_tflops_per_gpu": tps_gpu * flops_per_token(shape, seq_len) / 1e12,
    }
    if energy_j and timed_tokens:
        out["energy_j"] = energy_j
        out["tokens_per_kj"] = timed_tokens / (energy_j / 1e3)
    return out
