"""DPO on the pipeline equals TRL's DPO (issue 30): the same tiny Mistral, the same pairs rendered by
the filter's own code, the same reference log-probs and beta.

- In process: the per-document log-probs from packed pair rows (position-id segments; logits and
  the chunked hidden-state path) equal each side alone through transformers, and the loss and
  rewards equal `DPOTrainer._compute_loss` (TRL 1.x) for sigmoid and IPO; label smoothing is the
  conservative-DPO formula (TRL 1.x's sigmoid has none).
- Under torchrun (CPU, gloo): pipeline 1 (one process) and pipeline 2 (two processes), 2 pairs per
  micro-batch x 3 micro-batches per step: the reference pass through the pipeline equals
  transformers' forward, and the step's loss, reward accuracy, rewards and margin equal TRL's over
  the step's 6 pairs; the evaluation on val pairs reports the same quantities.
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

from spark_jobs.filter.train_ready import write_rows
from tests.dpo_helpers import hf_side_logps, pair_rows, rendered_pairs, trl_dpo
from tests.training_helpers import make_tiny_model
from training.dpo_data import pair_sides
from training.dpo_loss import pair_losses, side_sums, target_logps
from training.model import shift_targets

REPO = Path(__file__).resolve().parents[1]
SEQ = 128
BETA = 0.1
TOL = 1e-5
LOGP_RTOL = 1e-6  # summed log-probs reach -200 nats: fp32 sums of packed vs separate attention agree to ~1e-7 relative


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import MistralForCausalLM

    tmp = tmp_path_factory.mktemp("dpo")
    model_dir = make_tiny_model(tmp / "tiny", max_shard_size=None)
    model = MistralForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pairs = rendered_pairs(SEQ)
    with torch.no_grad():
        base = hf_side_logps(model, pairs).double()
    # a reference that differs from the policy, so rewards and margins are not all 0
    gen = torch.Generator().manual_seed(3)
    ref = base + torch.randn(base.shape, generator=gen, dtype=torch.float64) * 2.0
    return {"tmp": tmp, "model_dir": model_dir, "model": model, "pairs": pairs, "base": base, "ref": ref}


def _packed(pairs):
    rows = pair_rows(pairs, SEQ)
    ids, labels, pos = (torch.stack([r[i] for r in rows]) for i in range(3))
    targets = shift_targets(labels, pos)
    return ids, pos, targets, pair_sides(targets, pos)


def test_packed_pair_logps_equal_each_side_alone(setup):
    model, pairs = setup["model"], setup["pairs"]
    ids, pos, targets, side = _packed(pairs)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, use_cache=False, output_hidden_states=True)
        by_logits, counts = side_sums(target_logps(out.logits, targets), side)
        by_hidden, _ = side_sums(target_logps((out.hidden_states[-1], model.lm_head.weight), targets, chunk=5), side)
    assert torch.allclose(by_logits.double(), setup["base"], atol=TOL, rtol=LOGP_RTOL)
    assert torch.allclose(by_hidden.double(), setup["base"], atol=TOL, rtol=LOGP_RTOL)
    # the counts are each side's final answer (incl. </s>), nothing of the prompt
    assert counts.tolist() == [[int((torch.as_tensor(lab) != -100).sum()) for _, lab in p] for p in pairs]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_rewards_equal_trl(setup, loss_type):
    model, pairs, ref = setup["model"], setup["pairs"], setup["ref"]
    ids, pos, targets, side = _packed(pairs)
    policy, counts = side_sums(target_logps(model(input_ids=ids, position_ids=pos, use_cache=False).logits, targets),
                               side)
    terms = pair_losses(policy, ref, counts, beta=BETA, loss_type=loss_type)
    trl = trl_dpo(model, pairs, ref, beta=BETA, loss_type=loss_type)
    assert abs(terms.losses.mean().item() - trl["loss"]) < TOL
    assert abs(terms.chosen_rewards.mean().item() - trl["chosen_reward"]) < TOL
    assert abs(terms.rejected_rewards.mean().item() - trl["rejected_reward"]) < TOL
    assert abs((terms.chosen_rewards - terms.rejected_rewards).mean().item() - trl["reward_margin"]) < TOL
    assert (terms.chosen_rewards > terms.rejected_rewards).float().mean().item() == trl["reward_accuracy"]
    assert 0 < trl["reward_accuracy"] < 1  # the reference makes some pairs right, some wrong


def test_label_smoothing_is_conservative_dpo(setup):
    pol = torch.tensor([[-3.0, -5.0], [-4.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-3.5, -4.0], [-4.0, -4.0]], dtype=torch.float64)
    t = pair_losses(pol, ref, torch.ones(2, 2), beta=0.5, label_smoothing=0.2)
    d = 0.5 * ((pol - ref)[:, 0] - (pol - ref)[:, 1])
    assert torch.allclose(t.losses, -0.8 * F.logsigmoid(d) - 0.2 * F.logsigmoid(-d))


def _probe(setup, stages: int, tag: str, **options) -> dict:
    tmp = setup["tmp"]
    data = tmp / f"data-{tag}"
    rows = pair_rows(setup["pairs"], SEQ)
    as_lists = [{"input_ids": r[0].tolist(), "labels": r[1].tolist(), "position_ids": r[2].tolist()} for r in rows]
    write_rows(data / "data" / "train" / "part-00000.parquet", as_lists[:4])
    write_rows(data / "data" / "train" / "part-00001.parquet", as_lists[4:])
    write_rows(data / "data" / "val" / "part-00000.parquet", as_lists[:4])
    torch.save({"train": setup["ref"], "val": setup["ref"][:4]}, data / "reference.pt")
    out = tmp / f"out-{tag}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
    opts = {"seq_len": SEQ, "micro_batch": 2, "accumulation": 3, "beta": BETA, **options}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(stages),
           str(REPO / "tests" / "dpo_probe.py"), str(data), str(setup["model_dir"]), str(stages), str(out),
           json.dumps(opts)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
def test_pipeline_dpo_step_equals_trl(setup, stages):
    got = _probe(setup, stages, f"pp{stages}")
    # the reference pass through the pipeline = transformers' forward of each side alone
    assert torch.allclose(torch.tensor(got["collected"], dtype=torch.float64), setup["base"], atol=TOL,
                          rtol=LOGP_RTOL)
    trl = trl_dpo(setup["model"], setup["pairs"], setup["ref"], beta=BETA)
    step = got["step"]
    assert step["pairs"] == 6  # 2 pairs x 3 micro-batches, one step
    assert abs(got["loss"] - trl["loss"]) < TOL  # the engine's step loss: the mean over the step's pairs
    assert abs(step["dpo_loss"] - trl["loss"]) < TOL
    for k in ("reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin"):
        assert abs(step[k] - trl[k]) < TOL, (k, step[k], trl[k])
    # evaluation on val pairs (4 of them) after the update reports the same quantities
    ev = got["eval"]
    assert ev["pairs"] == 4 and abs(ev["dpo_loss"] - got["eval_loss"]) < TOL
    assert ev["reward_accuracy"] is not None and ev["reward_margin"] is not None
