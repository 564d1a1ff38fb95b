"""CPU tests of the trainer's GPU fast paths (training/fast_kernels.py, training/kernels.py, the
attention context of training/model.py).

The two GPU-only kernels (PyTorch's FlashAttention-2 varlen op and Liger's Triton kernels) cannot
run here; they are replaced by plain-torch reference implementations of the same contracts, so
what is tested is everything around them: flattening, document boundaries, GQA handling, the
attention-interface plumbing, the module swaps (names, shared parameters), the fused-loss glue.
Their GPU numerics are checked by the `gpu` tests (tests/test_gpu_kernels.py) on the device
(results in bench/RESULTS.md).
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import MistralConfig
from transformers.models.mistral import modeling_mistral

from training import fast_kernels, kernels
from training.loss import TokenMeanLoss
from training.model import (
    DecoderLayerPipe,
    LMHeadPipe,
    PackedAttentionContext,
    causal_lm_loss_sum,
    prepare_hf_config,
    shift_targets,
    varlen_kwargs,
)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                     expected_scale="unset"):
    """Plain-torch stand-in for torch.nn.attention.varlen.varlen_attn (FlashAttention-2, GPU only):
    causal attention inside each [cu[i], cu[i+1]) segment, GQA by head groups. Every argument the
    trainer passes is checked against what the real kernel needs."""
    assert tuple(window_size) == (-1, 0), "the trainer always asks for causal attention"
    assert cu_q is cu_k and cu_q.dtype == torch.int32 and cu_q[0] == 0 and cu_q[-1] == q.shape[0]
    assert max_q == max_k and isinstance(max_q, int)
    # an upper bound of the longest segment (train.sync_free_attention passes the row length)
    assert int((cu_q[1:] - cu_q[:-1]).max()) <= max_q <= q.shape[0], "max length must bound the longest segment"
    assert expected_scale == "unset" or scale == expected_scale, (scale, expected_scale)
    assert isinstance(enable_gqa, bool)
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise ValueError("Expect query and key/value to have the same number of heads")
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    for s0, s1 in zip(bounds, bounds[1:], strict=False):
        qs, ks, vs = (t[s0:s1].transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[s0:s1] = o[0].transpose(0, 1)
    return out



def fake_varlen_api(monkeypatch, params, calls, expected_scale="unset"):
    def varlen(*args, **kwargs):
        assert set(kwargs) <= set(params), f"{set(kwargs) - set(params)} not in this torch's signature"
        calls.append(kwargs)
        return reference_varlen(*args, **kwargs, expected_scale=expected_scale)

    monkeypatch.setattr(fast_kernels, "_VARLEN_API", (varlen, frozenset(params)))



def packed_positions(lengths: list[int], rows: int = 2) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).repeat(rows, 1)



def test_torch_varlen_attention_equals_the_dense_document_mask(monkeypatch):
    calls = []
    fake_varlen_api(monkeypatch, ["scale", "window_size", "enable_gqa"], calls, expected_scale=0.3)
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 48, 16
    pos = packed_positions([20, 17, 11], rows=b)
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    out, weights = fast_kernels.torch_varlen_attention_forward(None, q, k, v, None, scaling=0.3, **varlen_kwargs(pos))
    from training.model import dense_document_mask

    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(pos), scale=0.3, enable_gqa=True)
    assert weights is None and out.shape == (b, s, hq, d)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert calls[0]["enable_gqa"] is True and calls[0]["window_size"] == (-1, 0)



def test_torch_varlen_expands_kv_heads_where_the_wrapper_refuses_gqa(monkeypatch):
    calls = []
    fake_varlen_api(monkeypatch, ["scale", "window_size"], calls, expected_scale=None)  # older torch: no enable_gqa
    pos = packed_positions([10, 6], rows=1)
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    out, _ = fast_kernels.torch_varlen_attention_forward(None, q, k, v, None, scaling=None, **varlen_kwargs(pos))
    assert len(calls) == 2  # first refused (ValueError), then called again with repeated K/V
    from training.model import dense_document_mask

    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(pos), enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)



def test_torch_varlen_needs_document_boundaries():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        fast_kernels.torch_varlen_attention_forward(None, q, q, q, None)



def tiny_cfg(backend: str, seq: int = 48) -> MistralConfig:
    cfg = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    kernels.register_attention(backend)
    return prepare_hf_config(cfg, backend, seq)



def test_decoder_layer_with_torch_varlen_backend_equals_the_sdpa_reference(monkeypatch):
    """The whole transformers path (attention interface, cu_seqlens kwargs, RoPE on restarted
    positions) gives the reference layer's output and gradients."""
    fake_varlen_api(monkeypatch, ["scale", "window_size", "enable_gqa"], [])
    torch.manual_seed(0)
    ref = DecoderLayerPipe(tiny_cfg("sdpa"), 0, PackedAttentionContext(tiny_cfg("sdpa"), "sdpa"))
    fast_cfg = tiny_cfg("torch_varlen")
    assert fast_cfg._attn_implementation == fast_kernels.TORCH_VARLEN_ATTENTION
    fast = DecoderLayerPipe(fast_cfg, 0, PackedAttentionContext(fast_cfg, "torch_varlen"))
    fast.load_state_dict(ref.state_dict())
    pos = packed_positions([30, 18])
    x = torch.randn(2, 48, 32)
    outs = []
    for layer in (ref, fast):
        xi = x.clone().requires_grad_()
        h, p = layer((xi, pos))
        h.square().sum().backward()
        outs.append((h, xi.grad, layer.self_attn.q_proj.weight.grad))
        assert p is pos
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


EPS = 1e-6  # tiny_cfg's rms_norm_eps (MistralConfig's default)



def reference_liger():
    """Plain-torch implementations of the four Liger entry points fast_kernels uses; each checks
    every argument against the Mistral/HF semantics the trainer needs."""

    class RMS:
        @staticmethod
        def apply(x, w, eps, offset, casting_mode, in_place, row_mode):
            assert eps == EPS, eps
            assert offset == 0.0, "Mistral's RMSNorm has no (1 + w) offset"
            assert casting_mode == "llama", "HF casting: fp32 statistics, weight applied in input dtype"
            assert in_place is True, "in-place backward saves one activation"
            assert row_mode is None, "let Liger pick the row mode"
            assert isinstance(w, torch.nn.Parameter)
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    class SiluMul:
        @staticmethod
        def apply(a, b, gate_multiplier, down_multiplier):
            assert gate_multiplier == 1.0 and down_multiplier == 1.0, "plain SwiGLU: no muP multipliers"
            assert a.shape == b.shape
            return F.silu(a) * b

    def flce(inp, weight, target, *args, **kwargs):
        assert not args, "pass Liger's options by name"
        assert kwargs == {"ignore_index": -100, "reduction": "sum"}, kwargs
        assert inp.dim() == 2 and target.dim() == 1 and target.dtype == torch.long
        assert inp.shape[0] == target.shape[0] and weight.shape[1] == inp.shape[1]
        return F.cross_entropy((inp @ weight.t()).float(), target, **kwargs)

    return types.SimpleNamespace(rms_norm=RMS, silu_mul=SiluMul, flce=flce,
                                 rope=modeling_mistral.apply_rotary_pos_emb)



def test_apply_liger_keeps_names_shares_parameters_and_numerics(monkeypatch):
    monkeypatch.setattr(fast_kernels, "_liger", reference_liger)
    # apply_liger patches transformers' RoPE function for the process: restore it after the test
    monkeypatch.setattr(modeling_mistral, "apply_rotary_pos_emb", modeling_mistral.apply_rotary_pos_emb)
    torch.manual_seed(0)
    cfg = tiny_cfg("sdpa")
    ctx = PackedAttentionContext(cfg, "sdpa")

    class Stage(torch.nn.Module):  # stands in for the last pipeline stage (layers + loss_fn)
        def __init__(self):
            super().__init__()
            self.layer, self.head = DecoderLayerPipe(cfg, 0, ctx), LMHeadPipe(cfg)
            self.loss_fn = TokenMeanLoss(causal_lm_loss_sum)

        def forward(self, x, pos, targets):
            return self.loss_fn(self.head(self.layer((x, pos))[0]), targets)

    ref, fast = Stage(), Stage()
    fast.load_state_dict(ref.state_dict())
    keys_before = list(fast.state_dict())
    norm_weight = fast.layer.input_layernorm.weight
    loss_fn = fast.loss_fn
    swapped = kernels.apply_fast_kernels("liger", fast, loss=loss_fn)
    assert swapped == {"rms_norm": 2, "swiglu": 1, "fused_loss": 1}
    assert list(fast.state_dict()) == keys_before  # checkpoints and HF export see the same names
    assert fast.layer.input_layernorm.weight is norm_weight  # reused, not copied
    assert isinstance(fast.layer.mlp, fast_kernels.FusedSwiGLUMLP)
    assert fast.loss_fn is loss_fn and loss_fn.sum_fn is fast_kernels.fused_causal_lm_loss_sum

    pos = packed_positions([30, 18])
    targets = shift_targets(torch.randint(0, 97, (2, 48)), pos)
    targets[0, :10] = -100
    x = torch.randn(2, 48, 32)
    for stage in (ref, fast):
        stage.loss_fn.begin(int((targets != -100).sum()), 1, 1)
    losses = [stage(x, pos, targets) for stage in (ref, fast)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1])
    for name, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, dict(fast.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)



def test_fused_loss_of_a_micro_batch_without_targets_is_zero(monkeypatch):
    monkeypatch.setattr(fast_kernels, "_liger", reference_liger)
    hidden, weight = torch.randn(1, 5, 8), torch.randn(11, 8)
    loss = TokenMeanLoss(fast_kernels.fused_causal_lm_loss_sum)
    loss.begin(0, 2, 1)
    value = loss((hidden, weight), torch.full((1, 5), -100))
    assert value.item() == 0.0 and not math.isnan(value.item())



def test_unknown_fast_kernels_are_refused():
    with pytest.raises(ValueError, match="train.fast_kernels"):
        kernels.apply_fast_kernels("fastest", torch.nn.Linear(2, 2))



def test_whole_document_rows_run_sdpa_packed_rows_the_varlen_kernel_and_both_match_the_reference(monkeypatch):
    """train.causal_rows_sdpa: a micro-batch of one document per row takes transformers' SDPA path
    (no varlen call); a packed one keeps the varlen kernel; both equal the dense-mask layer."""
    calls = []
    fake_varlen_api(monkeypatch, ["scale", "window_size", "enable_gqa"], calls)
    torch.manual_seed(0)
    cfg = tiny_cfg("torch_varlen")
    ctx = PackedAttentionContext(cfg, "torch_varlen", sync_free=True, causal_rows_sdpa=True)
    fast = DecoderLayerPipe(cfg, 0, ctx)
    ref = DecoderLayerPipe(tiny_cfg("sdpa"), 0, PackedAttentionContext(tiny_cfg("sdpa"), "sdpa"))
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 48, 32)
    for pos, varlen_calls in ((packed_positions([48]), 0), (packed_positions([30, 18]), 1)):
        calls.clear()
        whole = ctx._build_mask(pos)[1].get("whole_rows", False)
        assert whole is (varlen_calls == 0), pos
        h_fast, _ = fast((x, pos))
        h_ref, _ = ref((x, pos))
        assert len(calls) == varlen_calls
        torch.testing.assert_close(h_fast, h_ref, rtol=1e-5, atol=1e-5)



def test_sync_free_varlen_bounds_max_seqlen_by_the_row_length():
    pos = packed_positions([30, 18])
    assert varlen_kwargs(pos)["max_length_q"] == 30  # read back from the device
    free = varlen_kwargs(pos, exact_max_len=False)
    assert free["max_length_q"] == free["max_length_k"] == 48 and torch.equal(free["cu_seq_lens_q"],
                                                                           varlen_kwargs(pos)["cu_seq_lens_q"])
