"""training/optim.py: the fused fp32 gradient accumulation that replaces DeepSpeed's per-parameter add."""

from __future__ import annotations

import types

import torch


def test_fused_hp_grad_accumulation_adds_the_bf16_gradient_into_fp32_once():
    """optim.fuse_hp_grad_accumulation replaces DeepSpeed 0.19's BF16_Optimizer._update_hp_grad on
    one instance: same sums as ``hp.add_(lp.grad.to(fp32))``, the marker set, the bf16 grad kept."""
    from training.optim import fuse_hp_grad_accumulation

    torch.manual_seed(0)
    lp = torch.nn.Parameter(torch.randn(6, 5).bfloat16())
    hp = torch.randn(30)
    opt = types.SimpleNamespace(_update_hp_grad=None, fp32_groups_gradients=[[hp]],
                                fp32_groups_has_gradients=[[False]], autoep_folding_tp_group=None)
    assert fuse_hp_grad_accumulation(opt)
    expected = hp.clone()
    for _ in range(3):  # three micro-batches
        lp.grad = torch.randn(6, 5).bfloat16()
        expected += lp.grad.float().view(-1)
        opt._update_hp_grad(lp, 0, 0, clear_lp_grads=False)
    torch.testing.assert_close(hp, expected, rtol=0, atol=0)
    assert opt.fp32_groups_has_gradients[0][0] and lp._hp_grad is hp and lp.grad is not None
    assert not fuse_hp_grad_accumulation(types.SimpleNamespace())  # another optimizer: left alone
