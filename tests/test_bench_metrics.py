"""bench/metrics.py: pipeline-bubble accounting and the throughput summary of a benchmark row."""

from __future__ import annotations

import pytest

from bench.metrics import (
    MISTRAL_7B,
    analytic_bubble,
    bubble_share,
    model_mfu,
    throughput_summary,
)


def test_bubble_accounting():
    assert analytic_bubble(2, 32) == pytest.approx(1 / 33)
    assert analytic_bubble(1, 8) == 0.0
    assert bubble_share(10.0, 9.3) == pytest.approx(0.07)
    assert bubble_share(10.0, 10.4) == 0.0  # event timing noise never gives a negative share
    with pytest.raises(ValueError):
        analytic_bubble(2, 0)
    with pytest.raises(ValueError):
        bubble_share(0.0, 1.0)



def test_throughput_summary_uses_the_median_step_and_counts_energy_per_token():
    s = throughput_summary(step_times_s=[2.0, 1.0, 1.0, 5.0, 1.0], tokens_per_step=4096 * 8, num_gpus=2,
                           shape=MISTRAL_7B, seq_len=4096, energy_j=10_000.0, timed_tokens=4096 * 8 * 5)
    assert s["step_time_median_s"] == 1.0
    assert s["tokens_per_s_per_gpu"] == 4096 * 8 / 2
    assert s["tokens_per_kj"] == pytest.approx(4096 * 8 * 5 / 10.0)
    assert s["mfu"] == pytest.approx(model_mfu(4096 * 4, MISTRAL_7B, 4096))
