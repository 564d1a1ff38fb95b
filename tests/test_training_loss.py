"""The step loss is the mean over all of a step's target tokens (issue 12), across micro-batches
and data-parallel ranks, and so is its gradient and the evaluation loss.

A crafted tiny Mistral (LM head scaled up, so per-token losses spread over several nats) and one
step of two micro-batches with 127 and 2 targets: a mean of per-micro-batch means would be far
from the token mean. The reference is transformers' MistralForCausalLM on the same rows in this
process. Runs the trainer's own pieces under torchrun on CPU (gloo), 2 processes:
pipeline 2 x data-parallel 1, and data-parallel 2 x pipeline 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline_core.handoffs import IGNORE_INDEX
from tests.training_helpers import make_tiny_model
from training.model import shift_targets

REPO = Path(__file__).resolve().parents[1]
SEQ = 128
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """Model dir + the two micro-batches (127 targets, 2 targets) + the transformers reference."""
    from transformers import MistralForCausalLM

    tmp = tmp_path_factory.mktemp("loss")
    base = make_tiny_model(tmp / "base", max_shard_size=None)
    model = MistralForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # per-token CE now ranges over several nats
    model.save_pretrained(str(tmp / "crafted"))
    for f in base.glob("tokenizer*"):
        (tmp / "crafted" / f.name).write_bytes(f.read_bytes())

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 32000, (2, SEQ), generator=gen)
    pos = torch.arange(SEQ).repeat(2, 1)
    labels = ids.clone()
    labels[1, :] = IGNORE_INDEX
    labels[1, 40], labels[1, 90] = ids[1, 40], ids[1, 90]  # 2 targets after the shift
    targets = shift_targets(labels, pos)
    assert [(targets[i] != IGNORE_INDEX).sum().item() for i in range(2)] == [127, 2]

    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="none").reshape(2, SEQ)
    token_mean = ce.sum() / (targets != IGNORE_INDEX).sum()
    token_mean.backward()
    per_mb_means = [ce[i].sum().item() / (targets[i] != IGNORE_INDEX).sum().item() for i in range(2)]
    mean_of_means = sum(per_mb_means) / 2
    assert abs(mean_of_means - token_mean.item()) > 0.5, "the crafted rows must tell the two rules apart"
    rows = [(ids[i], pos[i], targets[i]) for i in range(2)]
    return {"dir": tmp / "crafted", "rows": rows, "loss": token_mean.item(), "mean_of_means": mean_of_means,
            "grad": model.lm_head.weight.grad.clone(), "tmp": tmp}


def _probe(crafted, stages: int, per_replica, precision: str = "fp32", options: dict | None = None) -> dict:
    tmp = crafted["tmp"]
    tag = f"{stages}-{precision}-{'-'.join(f'{k}={v}' for k, v in sorted((options or {}).items()))}"
    rows_path = tmp / f"rows-{tag}.pt"
    torch.save({"seq_len": SEQ, "per_replica": per_replica}, rows_path)
    out = tmp / f"out-{tag}.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "training_loss_probe.py"), str(rows_path), str(crafted["dir"]), str(stages),
           precision, str(out), json.dumps(options or {})]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(out.read_text())
    result["decoder_grads"] = {k: v for r in range(2) for k, v in torch.load(f"{out}.rank{r}.pt").items()}
    return result


def test_pipeline_step_loss_and_gradient_are_the_token_mean(crafted):
    """pipeline 2 x dp 1: both micro-batches in one step (gradient accumulation 2)."""
    r = _probe(crafted, stages=2, per_replica=[crafted["rows"]])
    assert r["targets"] == 129
    assert r["loss"] == pytest.approx(crafted["loss"], abs=1e-4)
    assert r["eval_loss"] == pytest.approx(crafted["loss"], abs=1e-4)
    torch.testing.assert_close(torch.tensor(r["lm_head_grad"]), crafted["grad"], rtol=1e-4, atol=1e-6)


def test_data_parallel_step_loss_and_gradient_are_the_token_mean(crafted):
    """dp 2 x pipeline 1: one micro-batch per replica; the count is all-reduced over data parallel."""
    a, b = crafted["rows"]
    r = _probe(crafted, stages=1, per_replica=[[a], [b]])
    assert r["targets"] == 129
    assert r["loss"] == pytest.approx(crafted["loss"], abs=1e-4)
    assert r["eval_loss"] == pytest.approx(crafted["loss"], abs=1e-4)
    torch.testing.assert_close(torch.tensor(r["lm_head_grad"]), crafted["grad"], rtol=1e-4, atol=1e-6)


def test_bf16_accumulates_gradients_in_fp32(crafted):
    """bf16 + the default grad_accum_dtype: DeepSpeed's pipeline BF16 optimizer with fp32 buffers."""
    r = _probe(crafted, stages=2, per_replica=[crafted["rows"]], precision="bf16")
    assert r["optimizer"] == "BF16_Optimizer"
    assert r["grad_accum_dtype"] == "torch.float32"
    assert r["accumulator_dtypes"] == ["torch.float32"]
    assert r["loss"] == pytest.approx(crafted["loss"], rel=2e-2)  # bf16 weights and activations


def test_fused_wgrad_accumulation_equals_the_unfused_step(crafted):
    """train.fused_wgrad_accumulation: the decoder layers' weight-gradient GEMMs add into DeepSpeed's
    fp32 buffers themselves. Same step as the unfused bf16 path: the fp32 gradient of every decoder
    matrix of both stages, as the optimizer steps on it, agrees to bf16 rounding (the unfused path
    rounds each micro-batch's weight gradient to bf16 first; both micro-batches must land in the sum),
    and so does the global norm, which counts the fused weights only if the optimizer knows they have
    gradients."""
    plain = _probe(crafted, stages=2, per_replica=[crafted["rows"]], precision="bf16",
                   options={"fused_wgrad_accumulation": False})
    fused = _probe(crafted, stages=2, per_replica=[crafted["rows"]], precision="bf16")  # the default
    assert plain["main_grad_weights"] == 0
    assert fused["main_grad_weights"] == 7 * 2  # q, k, v, o, gate, up, down of the last stage's layers
    assert fused["loss"] == plain["loss"]  # the forward is unchanged
    assert len(plain["decoder_grads"]) == 7 * 4 and fused["decoder_grads"].keys() == plain["decoder_grads"].keys()
    for name, ref in plain["decoder_grads"].items():
        got = fused["decoder_grads"][name]
        assert ref.norm() > 0, name
        assert float((got - ref).norm() / ref.norm()) < 1e-2, name
    assert fused["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-3)
