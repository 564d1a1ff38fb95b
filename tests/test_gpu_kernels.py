"""The GPU correctness checks against their limits (marker `gpu`; skipped without a CUDA device, see
conftest.py): torch_varlen document attention and the Liger decoder layer + fused loss vs float32
references, the fused weight-gradient GEMM's fp32 sum, and the pipeline layers' windowed logits at
seq 8192 vs transformers. Run on the device: `pytest -m gpu` (bench/run_gpu_bench.sh checks). Every
measured value is printed and recorded as a junit property (`--junitxml`), passing or not; the
kernel timings are bench/kernel_bench.py's."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch

from bench.kernel_bench import packed_position_ids
from tests.gpu_helpers import Limits, rel_err, tiny_config
from tests.training_helpers import causal_lm_loss

pytestmark = pytest.mark.gpu


@pytest.fixture
def limits(record_property):
    return Limits(record_property)


def test_varlen_attention_matches_a_float32_dense_reference(limits):
    from training.fast_kernels import torch_varlen_attention_forward
    from training.model import dense_document_mask, varlen_kwargs

    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 8, 2, 1024, 128
    pos = packed_position_ids(b, s, [300, 200, 400, 124], "cuda")
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)

    class M:
        pass

    out, _ = torch_varlen_attention_forward(M(), q, k, v, None, scaling=d**-0.5, **varlen_kwargs(pos))
    out.backward(g)
    grads = [t.grad.clone() for t in (q, k, v)]
    # float32 dense reference with the trainer's own mask
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    mask = dense_document_mask(pos)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(hq // hkv, 1), vf.repeat_interleave(hq // hkv, 1), attn_mask=mask, scale=d**-0.5
    ).transpose(1, 2)
    ref.backward(g.float())
    limits.check("varlen_attention_fwd", rel_err(out, ref), 1e-2)
    for name, got, want in zip("qkv", grads, (qf.grad, kf.grad, vf.grad), strict=True):
        limits.check(f"varlen_attention_grad_{name}", rel_err(got, want), 2e-2)
    assert not limits.failed


def test_liger_layer_and_fused_loss_are_as_close_to_float32_as_the_reference_bf16_path(limits):
    from training.kernels import apply_fast_kernels
    from training.loss import TokenMeanLoss
    from training.model import (
        DecoderLayerPipe,
        LMHeadPipe,
        PackedAttentionContext,
        causal_lm_loss_sum,
        shift_targets,
    )

    torch.manual_seed(0)
    cfg = tiny_config()
    ctx = PackedAttentionContext(cfg, "torch_varlen")
    with torch.device("cuda"):
        ref_layer = DecoderLayerPipe(cfg, 0, ctx).bfloat16()
        ref_head = LMHeadPipe(cfg).bfloat16()
    for p in ref_layer.parameters():  # non-trivial norm weights
        torch.nn.init.normal_(p, 0.0, 0.05) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    fast_layer = DecoderLayerPipe(cfg, 0, ctx).cuda().bfloat16()
    fast_layer.load_state_dict(ref_layer.state_dict())
    fast_head = LMHeadPipe(cfg).cuda().bfloat16()
    fast_head.load_state_dict(ref_head.state_dict())

    class Holder(torch.nn.Module):
        def __init__(self, *mods):
            super().__init__()
            self.mods = torch.nn.ModuleList(mods)
            self.loss_fn = TokenMeanLoss(causal_lm_loss_sum)

    holder = Holder(fast_layer, fast_head)
    swapped = apply_fast_kernels("liger", holder, loss=holder.loss_fn)
    print(f"liger swapped: {swapped}", flush=True)
    pos = packed_position_ids(2, 1024, [500, 300, 224], "cuda")
    x = torch.randn(2, 1024, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, cfg.vocab_size, (2, 1024), device="cuda")
    targets = shift_targets(labels, pos)
    holder.loss_fn.begin(int(TokenMeanLoss.count(targets)), 1, 1)  # one micro-batch: the token mean

    def run(layer, head, loss_fn):
        xi = x.clone().requires_grad_()
        h, _ = layer((xi, pos))
        loss = loss_fn(head(h), targets)
        loss.backward()
        return h, loss, xi.grad, layer.mlp.gate_proj.weight.grad, layer.input_layernorm.weight.grad

    # reference in float32 on upcast weights
    ref32 = DecoderLayerPipe(cfg, 0, PackedAttentionContext(cfg, "torch_varlen")).cuda()
    ref32.load_state_dict({k: v.float() for k, v in ref_layer.state_dict().items()})
    head32 = LMHeadPipe(cfg).cuda()
    head32.load_state_dict({k: v.float() for k, v in ref_head.state_dict().items()})
    xf = x.float().requires_grad_()
    # fp32 attention through the same varlen kernel is not available: use the dense sdpa path
    ref32.self_attn.config = tiny_config(attn="sdpa")
    ref32.attention_context = PackedAttentionContext(ref32.self_attn.config, "sdpa")
    h32, _ = ref32((xf, pos))
    loss32 = causal_lm_loss(head32(h32), targets)
    loss32.backward()
    ref_out = run(ref_layer, ref_head, causal_lm_loss)
    fast_out = run(fast_layer, fast_head, holder.loss_fn)
    names = ("hidden", "loss", "grad_input", "grad_gate_proj", "grad_input_norm")
    want = (h32, loss32, xf.grad, ref32.mlp.gate_proj.weight.grad, ref32.input_layernorm.weight.grad)
    for name, r, f, w in zip(names, ref_out, fast_out, want, strict=True):
        e_ref, e_fast = rel_err(r, w), rel_err(f, w)
        limits.note(f"liger_{name}_reference_path_err", e_ref)
        # the fast path must be as close to float32 as the reference bf16 path is (2x + slack)
        limits.check(f"liger_{name}", e_fast, max(2 * e_ref, 1e-2))
    assert not limits.failed


def test_fused_wgrad_leaves_the_fp32_sum_of_the_micro_batches(limits):
    """training/wgrad_fusion.py on the GPU: two micro-batches through ``MainGradLinear`` leave
    sum dy^T x in the fp32 buffer (the bf16-operand GEMM with fp32 C, beta = 1), against a float64
    reference; the input gradient is nn.Linear's; no bf16 .grad is made."""
    from training.wgrad_fusion import MainGradLinear

    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 2048, bias=False, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(1024, 2048, bias=False, device=dev, dtype=torch.bfloat16)
    lin.load_state_dict(ref.state_dict())
    lin.__class__ = MainGradLinear
    lin.weight.main_grad = torch.zeros(2048, 1024, device=dev)
    expected = torch.zeros(2048, 1024, device=dev, dtype=torch.float64)
    dx_err = 0.0
    for _ in range(2):
        x = torch.randn(2, 512, 1024, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(2, 512, 2048, device=dev, dtype=torch.bfloat16)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xa).backward(dy)
        lin(xb).backward(dy)
        dx_err = max(dx_err, rel_err(xb.grad, xa.grad))
        expected += dy.double().reshape(-1, 2048).t() @ x.double().reshape(-1, 1024)
    limits.check("wgrad_fused_fp32_sum", rel_err(lin.weight.main_grad, expected), 1e-5)
    limits.check("wgrad_fused_input_grad", dx_err, 0.0)
    limits.check("wgrad_fused_no_bf16_grad", float(lin.weight.grad is not None), 0.0)
    assert not limits.failed


def test_pipeline_layers_match_transformers_logits_at_8192_with_and_without_a_window(limits):
    """Issue 29: bf16 logits of the pipeline layers at seq 8192 vs transformers' MistralForCausalLM
    in float32 (sdpa, its own sliding-window mask; transformers' own bf16 error recorded beside: on an
    H200 it is larger than the pipeline's), for a model with a 4096 window and one without, on the
    GPU backends: torch_varlen on whole rows (the SDPA path without a window, the varlen kernel's left
    window with one), torch_varlen on a packed row, and flex. |diff| / |ref| (norms)."""
    from transformers import MistralConfig, MistralForCausalLM

    from training.kernels import register_attention
    from training.model import layer_specs, prepare_hf_config
    from training.weights import load_stage_weights

    seq, window, limit, device = 8192, 4096, 1e-2, "cuda"
    register_attention("torch_varlen")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (1, seq), generator=g).to(device)
    whole = torch.arange(seq, device=device)[None]
    cut = seq * 3 // 4  # a first document longer than the window
    packed = torch.cat([torch.arange(cut), torch.arange(seq - cut)]).to(device)[None]
    runs = (("torch_varlen", "whole"), ("torch_varlen", "packed"), ("flex", "whole"))
    for w in (window, None):
        torch.manual_seed(1)
        base = MistralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                             sliding_window=w, tie_word_embeddings=False)
        hf = MistralForCausalLM(copy.deepcopy(base)).to(device).float().eval()
        with tempfile.TemporaryDirectory() as d, torch.no_grad():
            hf.save_pretrained(d)
            rows_of = (("whole", whole), ("packed", packed))
            refs = {name: hf(input_ids=ids, position_ids=pos, use_cache=False).logits for name, pos in rows_of}
            hf.bfloat16()  # transformers' own bf16 error: the floor a bf16 path reaches
            refs16 = {name: hf(input_ids=ids, position_ids=pos, use_cache=False).logits for name, pos in rows_of}
            for backend, rows in runs:
                cfg = prepare_hf_config(base, backend, seq)
                layers = [s.build() for s in layer_specs(cfg, backend, sync_free_attention=True, causal_rows_sdpa=True)]
                load_stage_weights(layers, Path(d))
                x = (ids, whole if rows == "whole" else packed)
                for layer in layers:
                    layer.to(device).bfloat16().eval()
                    x = layer(x)
                name = f"window_parity_{seq}_{'w' + str(w) if w else 'nowindow'}_{backend}_{rows}"
                # the norm-relative error is the check (bf16 logits round at ~|logit| * 2^-9);
                # the max |diff| and the largest |logit| are recorded beside it
                limits.note(name + "_max_abs_vs_fp32", float((x.float() - refs[rows]).abs().max()))
                limits.note(name + "_rel_vs_hf_bf16", rel_err(x, refs16[rows]))
                limits.note(name + "_hf_bf16_rel_vs_fp32", rel_err(refs16[rows], refs[rows]))
                limits.note(name + "_max_logit", float(refs[rows].abs().max()))
                limits.check(name, rel_err(x, refs[rows]), limit)
                del layers
            if w is not None:  # how far the window moves the logits (what parity must resolve)
                hf.config.sliding_window = None  # hf holds its own copy of the config
                nowin = hf.float()(input_ids=ids, position_ids=whole, use_cache=False).logits
                limits.note(f"window_effect_{seq}_w{w}", rel_err(nowin, refs["whole"]))
        del hf
        torch.cuda.empty_cache()
    assert not limits.failed
