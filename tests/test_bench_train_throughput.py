"""bench/train_throughput.py on CPU: dry runs of its setups (one process; the trainer on 2 stages and
FSDP2 on 2 ranks, gloo), the document-aware FLOPs of packed rows, parameters refused before compute."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from transformers import MistralConfig

from bench.metrics import (
    MISTRAL_7B,
    ModelShape,
    flops_per_token,
)
from training import flops

REPO = Path(__file__).resolve().parents[1]


def bench_env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env



def test_benchmark_dry_run_single_process(tmp_path):
    out = tmp_path / "row.json"
    cmd = [sys.executable, "bench/train_throughput.py", "--setup", "hf_single", "--model", "tiny", "--device", "cpu",
           "--seq-len", "128", "--micro-batch", "2", "--act-ckpt", "1", "--warmup", "1", "--steps", "2",
           "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=bench_env(), check=True, timeout=300, capture_output=True)
    r = json.loads(out.read_text())
    assert r["tokens_per_step"] == 2 * 128 and r["timed_steps"] == 2 and r["num_gpus"] == 1
    assert r["model_params"] == ModelShape.from_hf_config(MistralConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2)).num_parameters()
    assert all(math.isfinite(x) for x in r["losses"])



def test_benchmark_rejects_invalid_parameters_before_compute():
    cmd = [sys.executable, "bench/train_throughput.py", "--setup", "trainer", "--model", "7b", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and "--model 7b needs --device cuda" in proc.stderr



@pytest.mark.slow
def test_benchmark_dry_run_trainer_two_stages(tmp_path):
    """The trainer's engine (training/engine.py, through Trainer.setup) in the benchmark on 2 CPU
    ranks (gloo): instruction timing, bubble accounting and per-stage layout reach the result."""
    out = tmp_path / "pipe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "bench/train_throughput.py", "--setup", "trainer", "--stages", "2", "--model", "tiny", "--device", "cpu",
           "--seq-len", "128", "--micro-batch", "1", "--grad-accum", "4", "--attention", "sdpa",
           "--work", str(tmp_path / "work"), "--warmup", "1", "--steps", "2", "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=bench_env(), check=True, timeout=600, capture_output=True)
    r = json.loads(out.read_text())
    assert r["stage_of_rank"] == [0, 1] and r["layers_on_stage"] == [2, 2]
    assert sum(r["params_on_stage"]) == r["model_params"]
    assert r["analytic_bubble"] == pytest.approx(1 / 5)
    assert len(r["bubble_share"]) == 2 and all(0.0 <= b <= 1.0 for b in r["bubble_share"])
    assert r["tokens_per_step"] == 4 * 128
    for stage in r["instr_gpu_s"]:
        assert stage["ForwardPass"] > 0 and stage["BackwardPass"] > 0



def test_benchmark_dry_run_fsdp2_two_ranks(tmp_path):
    """FSDP2 (issue 16's peer) on 2 CPU ranks (gloo): every rank holds only its fp32 shard, the
    step trains, and packed rows get document-aware FLOPs below the full-row credit."""
    out = tmp_path / "fsdp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "bench/train_throughput.py", "--setup", "fsdp2", "--model", "tiny", "--device", "cpu",
           "--seq-len", "128", "--micro-batch", "1", "--grad-accum", "2", "--docs", "packed",
           "--sliding-window", "none", "--hf-position-ids", "--warmup", "1", "--steps", "2", "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=bench_env(), check=True, timeout=300, capture_output=True)
    r = json.loads(out.read_text())
    extra = r["settings"]["extra"]
    assert r["num_gpus"] == 2 and r["tokens_per_step"] == 2 * 2 * 128
    assert extra["param_dtype"] == "bf16" and extra["reduce_dtype"] == "fp32"
    assert extra["local_param_dtype"] == "torch.float32"  # the sharded master copy
    assert 0.45 * r["model_params"] <= extra["local_param_numel"] <= 0.55 * r["model_params"]
    assert all(math.isfinite(x) for x in r["losses"])
    assert 0 < r["doc_mfu"] < r["mfu"]



def test_packed_flops_follow_the_rows_documents():
    from bench.train_throughput import make_micro_batches, packed_flops_per_token

    args = types.SimpleNamespace(seq_len=256, seed=7)
    got = packed_flops_per_token(MISTRAL_7B, args, vocab=1000, rows=8)
    rows = make_micro_batches(n=8, micro_batch=1, seq_len=256, vocab=1000, docs="packed", seed=7)
    want = []
    for b in rows:
        pos = b["position_ids"][0].tolist()
        lengths, n = [], 0
        for i, p in enumerate(pos):
            if p == 0 and i:
                lengths.append(n)
                n = 0
            n += 1
        want.append(flops.document_flops_per_token(MISTRAL_7B, [*lengths, n]))
    assert got == pytest.approx(sum(want) / len(want))
    assert 6 * MISTRAL_7B.non_embedding_parameters() < got < flops_per_token(MISTRAL_7B, 256)



def test_benchmark_refuses_a_checkpoint_outside_the_trainer():
    cmd = [sys.executable, "bench/train_throughput.py", "--setup", "fsdp2", "--model", "tiny", "--device", "cpu",
           "--checkpoint"]
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and "--checkpoint needs --setup trainer" in proc.stderr
