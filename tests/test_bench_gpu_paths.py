"""CPU tests for the GPU throughput benchmark (bench/) and the trainer's GPU fast paths
(training/fast_kernels.py).

The two GPU-only kernels (PyTorch's FlashAttention-2 varlen op and Liger's Triton kernels) cannot
run here; they are replaced by plain-torch reference implementations of the same contracts, so
what is tested is everything around them: flattening, document boundaries, GQA handling, the
attention-interface plumbing, the module swaps (names, shared parameters), the fused-loss glue.
Their GPU numerics are checked by bench/gpu_checks.py on the device (results in bench/RESULTS.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import MistralConfig, MistralForCausalLM
from transformers.models.mistral import modeling_mistral

from bench import report
from bench.metrics import (
    MISTRAL_7B,
    ModelShape,
    analytic_bubble,
    bubble_share,
    flops_per_token,
    mfu,
    throughput_summary,
    tokens_per_s_for_mfu,
)
from training import fast_kernels, flops, kernels
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

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- accounting
def test_mistral_7b_accounting_is_the_published_convention():
    """6 N + 12 L h s with N = every parameter but the input embedding (Megatron, torchtitan)."""
    assert MISTRAL_7B.num_parameters() == 7_241_732_096
    assert MISTRAL_7B.non_embedding_parameters() == 7_241_732_096 - 32000 * 4096
    assert flops_per_token(MISTRAL_7B, 4096) == 6 * 7_110_660_096 + 12 * 32 * 4096 * 4096
    # 60% MFU is about 12,100 tokens/s per GPU at seq 4096
    assert round(tokens_per_s_for_mfu(0.60, MISTRAL_7B, 4096), -2) == 12_100
    # the 2026-11-30 headline (12,530 tok/s/GPU) is 62.2% on this convention, not 63.2%
    assert mfu(12_530, MISTRAL_7B, 4096) == pytest.approx(0.622, abs=5e-4)


def test_trainer_and_benchmark_share_one_flops_function():
    from training import train

    assert flops_per_token is flops.flops_per_token is train.flops_per_token
    cfg = MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    assert flops.ModelShape.from_hf_config(cfg) == MISTRAL_7B


def test_head_dim_comes_from_the_config():
    """A model whose heads x head_dim differs from hidden_size (e.g. Mistral-Nemo) counts its real width."""
    cfg = MistralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    shape = flops.ModelShape.from_hf_config(cfg)
    assert shape.attention_width == 128
    model = MistralForCausalLM(cfg)
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())
    assert flops_per_token(shape, 16) == 6 * shape.non_embedding_parameters() + 12 * 2 * 128 * 16


def test_document_aware_flops_count_only_the_documents_present():
    s = 4096
    assert flops.document_flops_per_token(MISTRAL_7B, [s]) == flops_per_token(MISTRAL_7B, s)
    attn_full = flops_per_token(MISTRAL_7B, s) - 6 * MISTRAL_7B.non_embedding_parameters()
    two = flops.document_flops_per_token(MISTRAL_7B, [s // 2, s // 2]) - 6 * MISTRAL_7B.non_embedding_parameters()
    assert two == pytest.approx(attn_full / 2)
    with pytest.raises(ValueError):
        flops.document_flops_per_token(MISTRAL_7B, [])


def test_parameter_count_equals_the_real_hf_model():
    cfg = MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = MistralForCausalLM(cfg)
    assert ModelShape.from_hf_config(cfg).num_parameters() == sum(p.numel() for p in model.parameters())


def test_bubble_accounting():
    assert analytic_bubble(2, 32) == pytest.approx(1 / 33)
    assert analytic_bubble(1, 8) == 0.0
    assert bubble_share(10.0, 9.3) == pytest.approx(0.07)
    assert bubble_share(10.0, 10.4) == 0.0  # event timing noise never gives a negative share
    with pytest.raises(ValueError):
        analytic_bubble(2, 0)
    with pytest.raises(ValueError):
        bubble_share(0.0, 1.0)


def test_throughput_summary_uses_the_median_step_and_counts_energy_per_token():
    s = throughput_summary(step_times_s=[2.0, 1.0, 1.0, 5.0, 1.0], tokens_per_step=4096 * 8, num_gpus=2,
                           shape=MISTRAL_7B, seq_len=4096, energy_j=10_000.0, timed_tokens=4096 * 8 * 5)
    assert s["step_time_median_s"] == 1.0
    assert s["tokens_per_s_per_gpu"] == 4096 * 8 / 2
    assert s["tokens_per_kj"] == pytest.approx(4096 * 8 * 5 / 10.0)
    assert s["mfu"] == pytest.approx(mfu(4096 * 4, MISTRAL_7B, 4096))


def test_report_table_ratios_against_the_baseline_rows():
    def row(label, setup, tps, **extra):
        args = {"stages": 2, "micro_batch": 2, "grad_accum": 32, "attention": "torch_varlen", "kernels": "liger",
                "act_ckpt": 0, "docs": "packed", "hf_attention": "sdpa", "sliding_window": "default"}
        return {"label": label, "setup": setup, "tokens_per_s_per_gpu": tps, "mfu": tps / 20_000, "args": args,
                **extra}

    rows = [
        row("pipe", "pipeline", 12_000, bubble_share=[0.07, 0.01], analytic_bubble=1 / 33, peak_alloc_gib_max=89.5),
        row("hf_single_no_window", "hf_single", 8_000),
        row("hf_zero2", "hf_zero2", 6_000),
        row("hf_single", "hf_single", 7_500),
    ]
    lines = report.table(rows).splitlines()
    assert lines[2].startswith("| hf_single |")  # the baseline named after its setup comes first
    pipe = next(line for line in lines if line.startswith("| pipe |"))
    cells = [c.strip() for c in pipe.split("|")]
    assert cells[5] == "1.60" and cells[6] == "2.00"  # vs hf_single (7,500), not the no-window variant
    assert "7.0% / 1.0%" in pipe and "3.0%" in pipe


# ----------------------------------------------------------------------------- varlen attention
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


# ----------------------------------------------------------------------------- liger swaps
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


# ----------------------------------------------------------------------------- CPU dry runs
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


def test_report_ratio_against_the_best_strong_peer_and_checkpoint_stall():
    def row(label, setup, tps, docs, **extra):
        args = {"stages": 2, "micro_batch": 2, "grad_accum": 32, "attention": "auto", "kernels": "auto",
                "act_ckpt": 0, "docs": docs, "hf_attention": "sdpa", "sliding_window": "none",
                "grad_accum_dtype": "fp32", "hf_liger": True}
        return {"label": label, "setup": setup, "tokens_per_s_per_gpu": tps, "mfu": tps / 20_000, "args": args,
                **extra}

    rows = [
        row("trainer_causal", "trainer", 13_000, "causal",
            checkpoint={"save_stall_s": 40.0, "stall_share_at_every": 0.019, "checkpoint_every": 200}),
        row("zero2_causal", "hf_zero2", 10_000, "causal"),
        row("fsdp2_causal", "fsdp2", 10_400, "causal"),
        row("legacy_zero2_window_ckpt", "hf_zero2", 12_000, "causal"),  # never the peer to beat
        row("trainer_packed", "trainer", 14_000, "packed", doc_mfu=0.5),
        row("fsdp2_packed", "fsdp2", 7_000, "packed"),
    ]
    lines = report.table(rows).splitlines()

    def cells(label):
        return [c.strip() for c in next(x for x in lines if x.startswith(f"| {label} |")).split("|")]

    assert cells("trainer_causal")[13] == "1.25"  # 13,000 / FSDP2's 10,400, not the legacy 12,000
    assert cells("trainer_causal")[14] == "40.0 s (1.90% at 200)"
    assert cells("trainer_packed")[13] == "2.00" and cells("trainer_packed")[12] == "50.0%"
    assert "fp32 accum" in cells("trainer_causal")[2] and "liger" in cells("fsdp2_causal")[2]


def test_benchmark_refuses_a_checkpoint_outside_the_trainer():
    cmd = [sys.executable, "bench/train_throughput.py", "--setup", "fsdp2", "--model", "tiny", "--device", "cpu",
           "--checkpoint"]
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), timeout=120, capture_output=True, text=True)
    assert proc.returncode == 2 and "--checkpoint needs --setup trainer" in proc.stderr


# ----------------------------------------------------------------------------- issue 17's levers
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
