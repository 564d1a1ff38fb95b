"""The GPU correctness checks (bench/gpu_checks.py kernels) against their limits: torch_varlen
document attention and the Liger decoder layer + fused loss vs float32 references. Needs CUDA:
skipped here, run on the device (bench/run_trainer_bench.sh checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run it on the device")
def test_gpu_kernel_checks_are_within_their_limits(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "bench/gpu_checks.py", "kernels", "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    results = json.loads((tmp_path / "checks_kernels.json").read_text())
    checks = {k: v for k, v in results["checks"].items() if isinstance(v, dict) and "pass" in v}
    assert checks, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = {k: v for k, v in checks.items() if not v["pass"]}
    assert not failed and proc.returncode == 0, (failed, proc.stdout[-3000:])
    assert {"varlen_attention_fwd", "liger_loss", "liger_grad_input", "wgrad_fused_fp32_sum"} <= set(checks)
