"""Weight-gradient GEMM accumulating straight into the fp32 gradient buffer (Megatron's
``gradient_accumulation_fusion``).

With bf16 weights and fp32 gradient accumulation, an ``nn.Linear`` backward normally writes a
bf16 weight gradient that a second kernel then adds into the fp32 buffer (DeepSpeed's BF16
optimizer, ``bf16.immediate_grad_update``). Here the weight-gradient GEMM itself accumulates:
``main_grad += grad_out^T @ input`` with beta = 1 in fp32 (cuBLAS reads the fp32 buffer in its
epilogue), so no bf16 weight gradient exists, no separate add runs, and the sum is not rounded to
bf16 per micro-batch (it is *more* exact than the unfused path).

``MainGradLinear`` is an ``nn.Linear`` (same parameters and names) whose weight, once bound to a
buffer (``weight.main_grad``, see ``training.optim.bind_main_grads``), runs ``_LinearMainGrad``;
unbound it is a plain ``nn.Linear``. Autograd then gets no gradient for the weight (``None``), so
the optimizer must treat ``main_grad`` as the gradient: ``bind_main_grads`` does that for
DeepSpeed's BF16 optimizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def accumulate_wgrad(main_grad: torch.Tensor, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """``main_grad += grad_out^T @ inputs`` in ``main_grad``'s dtype. ``grad_out`` [T, out] and
    ``inputs`` [T, in] may be bf16: on CUDA one GEMM with bf16 operands and fp32 C, beta = 1
    (``addmm``'s ``out_dtype``); elsewhere the operands are upcast first (same sum, more traffic)."""
    if grad_out.dtype == main_grad.dtype:
        main_grad.addmm_(grad_out.t(), inputs)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_out.t(), inputs, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(grad_out.t().to(main_grad.dtype), inputs.to(main_grad.dtype))


class _LinearMainGrad(torch.autograd.Function):
    """y = x W^T + b; backward: dx = dy W, ``W.main_grad += dy^T x``, db = sum(dy); no dW."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        # the Parameter itself, not a saved tensor: under activation recomputation (train.recompute)
        # saved tensors come back as plain tensors, without the bound ``main_grad``
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        accumulate_wgrad(weight.main_grad.view(weight.shape), g2, x2)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b


class MainGradLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient goes into ``weight.main_grad`` once that is bound."""

    def forward(self, x):
        if getattr(self.weight, "main_grad", None) is None or not torch.is_grad_enabled():
            return super().forward(x)
        return _LinearMainGrad.apply(x, self.weight, self.bias)


def use_main_grad_linears(module: nn.Module, within: type) -> list[nn.Parameter]:
    """Turn every plain ``nn.Linear`` inside modules of type ``within`` (the decoder layers) into a
    ``MainGradLinear`` in place (class swap: parameters, names and values unchanged). Returns their
    weights, for ``bind_main_grads``. Linears that are already something else (FP8, LoRA) are left."""
    weights = []
    for block in module.modules():
        if not isinstance(block, within):
            continue
        for sub in block.modules():
            if type(sub) is nn.Linear:
                sub.__class__ = MainGradLinear
            if isinstance(sub, MainGradLinear):
                weights.append(sub.weight)
    return weights
