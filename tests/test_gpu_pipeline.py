"""The 2-stage pipeline on 2 GPUs (marker `gpu`; skipped without two CUDA devices): its eval loss on
a fixed packed batch equals the HF model's run document by document (bf16), and 200 steps on
repeating micro-batches bring the loss well down (tests/gpu_pipeline_probe.py under torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu_helpers import Limits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs: run it on the device")]
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("attention,kernels", [("torch_varlen", "liger")])
def test_pipeline_matches_hf_and_learns(tmp_path, record_property, attention, kernels):
    out = tmp_path / f"checks_pipeline_{attention}_{kernels}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "tests/gpu_pipeline_probe.py", str(out), "200", attention, kernels],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    limits = Limits(record_property)
    limits.note("pipeline_eval_loss", result["pipeline_eval_loss"])
    limits.note("hf_doc_by_doc_loss", result["hf_doc_by_doc_loss"])
    limits.check("pipeline_vs_hf_loss_bf16",
                 abs(result["pipeline_eval_loss"] - result["hf_doc_by_doc_loss"]) / abs(result["hf_doc_by_doc_loss"]),
                 1e-2)
    learning = result["learning"]
    limits.note("learning_seconds", learning["seconds"])
    limits.check("learning_last_over_first", learning["last10"] / learning["first10"], 0.8)
    assert not limits.failed
