"""GPU fast paths for the pipeline model (opt-in; the CPU/reference path never imports them).

Two independent levers, both keeping every parameter name (so weight loading, checkpoints and
export are unchanged) and both numerically equivalent to the reference within bf16 rounding:

- ``torch_varlen`` attention: the block-diagonal causal (document) mask computed as PyTorch's
  built-in FlashAttention-2 varlen kernel (``torch.nn.attention.varlen``) over ``cu_seqlens``.
  No ``flash_attn`` package needed, no S x S mask, and attention work shrinks with the documents.
- ``liger`` kernels (``liger-kernel`` package, Triton): fused RMSNorm and SwiGLU inside every
  decoder layer, fused RoPE, and a fused linear + cross-entropy loss on the last stage, so the
  [tokens, vocab] logits are never materialised.

Both need a CUDA device; ``apply_liger`` raises a clear error when the package is missing.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch import nn

from pipeline_core.handoffs import IGNORE_INDEX

TORCH_VARLEN_ATTENTION = "mft_torch_varlen"


# ----------------------------------------------------------------------------- varlen attention
_VARLEN_API: tuple | None = None  # (varlen_attn, its parameter names): looked up once, a plain read after


def _varlen_api():
    # A module-level value rather than functools.cache: torch.compile traces a global read, while
    # a cached call (and inspect.signature) would break the compiled layer's graph.
    global _VARLEN_API
    if _VARLEN_API is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_API = (varlen_attn, frozenset(inspect.signature(varlen_attn).parameters))
    return _VARLEN_API


def varlen_supports_window() -> bool:
    """True when the installed ``varlen_attn`` takes a (left, right) ``window_size`` (torch 2.10+)."""
    try:
        return "window_size" in _varlen_api()[1]
    except ImportError:
        return False


def varlen_causal_attention(q, k, v, cu_seqlens, max_len: int, scale: float | None, window: int | None = None):
    """Causal attention inside each [cu[i], cu[i+1]) segment of flattened q/k/v ([T, H, D]).

    Adapts to the ``varlen_attn`` signature of the installed torch (2.9: ``is_causal``; 2.10+:
    ``window_size``; 2.12+: ``enable_gqa``). GQA is native in the kernel; where the wrapper
    rejects fewer KV heads, K/V are expanded instead (slower, still exact).
    """
    varlen_attn, params = _varlen_api()
    kwargs: dict = {"scale": scale}
    left = -1 if window is None else window - 1  # dense reference: q - kv < window
    if "window_size" in params:
        kwargs["window_size"] = (left, 0)
    elif left != -1:
        raise NotImplementedError("this torch's varlen_attn has no sliding-window support")
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    try:
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)
    except ValueError:
        if k.shape[1] == q.shape[1]:
            raise
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        kwargs.pop("enable_gqa", None)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


def torch_varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    whole_rows: bool = False,
    **kwargs,
):
    """transformers attention-interface function: q [B, Hq, S, D], k/v [B, Hkv, S, D] ->
    ([B, S, Hq, D], None). Needs ``cu_seq_lens_q``/``max_length_q`` (``model.varlen_kwargs``).
    ``whole_rows``: every row is one document, so the document mask is the plain causal mask and
    transformers' SDPA path runs it (cuDNN attention on Hopper, ~1.7x FA2 varlen there)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError("torch_varlen attention needs cu_seq_lens_q/max_length_q (document boundaries)")
    if dropout:
        raise ValueError("torch_varlen attention does not implement attention dropout")
    batch, heads, seq, dim = query.shape
    if whole_rows and (sliding_window is None or sliding_window >= seq):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=scaling, is_causal=True)
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], dim)
    window = sliding_window if sliding_window is not None and sliding_window < max_length_q else None
    out = varlen_causal_attention(q, k, v, cu_seq_lens_q, int(max_length_q), scaling, window)
    return out.view(batch, seq, heads, dim), None


@functools.cache
def register_torch_varlen_attention() -> str:
    """Register the function under ``TORCH_VARLEN_ATTENTION`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TORCH_VARLEN_ATTENTION, torch_varlen_attention_forward)
    _varlen_api()  # resolved before any (compiled) forward
    return TORCH_VARLEN_ATTENTION


# ----------------------------------------------------------------------------- liger kernels
def _liger():
    try:
        from liger_kernel.ops import LigerRMSNormFunction, LigerSiLUMulFunction
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError as exc:  # pragma: no cover - depends on the GPU image
        raise RuntimeError(
            "train.fast_kernels='liger' needs the liger-kernel package (and Triton on a CUDA GPU)"
        ) from exc
    return types.SimpleNamespace(
        rms_norm=LigerRMSNormFunction,
        silu_mul=LigerSiLUMulFunction,
        flce=liger_fused_linear_cross_entropy,
        rope=liger_rotary_pos_emb,
    )


class FusedRMSNorm(nn.Module):
    """Liger RMSNorm with the HF (llama) casting: fp32 statistics, weight applied in input dtype.
    Reuses the original ``weight`` Parameter, so names and values are unchanged."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return _liger().rms_norm.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", True, None)


class FusedSwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the activation product fused; reuses the three Linears."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.down_proj(_liger().silu_mul.apply(self.gate_proj(x), self.up_proj(x), 1.0, 1.0))


def fused_lm_head_forward(self, hidden_states):
    """LMHeadPipe.forward under the fused loss: hand (hidden, head weight) to the loss instead of
    logits; the loss runs the projection chunk by chunk (same stage, nothing crosses a boundary)."""
    return hidden_states, self.lm_head.weight


def fused_causal_lm_loss_sum(outputs, targets: torch.Tensor) -> torch.Tensor:
    """``model.causal_lm_loss_sum`` without materialised logits: summed CE over targets != -100
    (already shifted); 0 for a micro-batch without targets."""
    hidden, weight = outputs
    return _liger().flce(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


def apply_liger(pipeline_module: nn.Module, *, decoder_cls: type | None, head_cls: type, loss=None) -> dict[str, int]:
    """Swap Liger kernels into the local stage of a built pipeline module (before weights load or
    after: parameters are reused, not copied). ``decoder_cls``/``head_cls`` name the layer types
    (this module does not import the model; ``decoder_cls=None`` leaves the layers and RoPE
    alone); ``loss`` is the stage's ``TokenMeanLoss``, whose summed CE becomes the fused one
    (None: keep logits). Returns what was swapped, for the log."""
    from transformers.models.mistral import modeling_mistral

    lk = _liger()
    if decoder_cls is not None:
        # RoPE is a module-level function in transformers; the swap applies to this process.
        modeling_mistral.apply_rotary_pos_emb = lk.rope
    swapped = {"rms_norm": 0, "swiglu": 0, "fused_loss": 0}
    for layer in pipeline_module.modules():
        if decoder_cls is not None and isinstance(layer, decoder_cls):
            for name in ("input_layernorm", "post_attention_layernorm"):
                old = getattr(layer, name)
                setattr(layer, name, FusedRMSNorm(old.weight, old.variance_epsilon))
                swapped["rms_norm"] += 1
            layer.mlp = FusedSwiGLUMLP(layer.mlp)
            swapped["swiglu"] += 1
        elif isinstance(layer, head_cls) and loss is not None:
            layer.forward = types.MethodType(fused_lm_head_forward, layer)
            loss.sum_fn = fused_causal_lm_loss_sum
            swapped["fused_loss"] += 1
    return swapped
