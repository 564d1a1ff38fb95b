"""Kernel-level GPU measurements, run before the throughput rows (one GPU):

    python bench/kernel_bench.py --out DIR [--only environment|matmul|layers|wgrad]

environment report; bf16 matmul ceiling; fwd+bwd time of one Mistral-7B decoder layer per
attention/kernel variant; the fused weight-gradient GEMM against bf16 GEMM + add. Writes
``<DIR>/kernel_bench.json``. The pass/fail GPU checks (torch_varlen attention, the Liger layer and
fused loss, the fused wgrad sum, windowed logits parity, the 2-stage pipeline vs HF) are pytest tests
marked ``gpu``: ``pytest -m gpu tests/test_gpu_kernels.py tests/test_gpu_pipeline.py`` (skipped
without CUDA; bench/run_gpu_bench.sh runs them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.flops import H200_PEAK_FLOPS  # noqa: E402  (after the repo is on sys.path)


def cuda_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of fn() timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return times[len(times) // 2]


def environment() -> dict:
    import importlib.metadata as md

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    for pkg in ("triton", "transformers", "deepspeed", "liger-kernel", "flash-attn", "nvidia-ml-py"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        env["varlen_attn_params"] = list(inspect.signature(varlen_attn).parameters)
    except Exception as exc:
        env["varlen_attn_params"] = f"unavailable: {exc}"
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        env["flex_attention"] = True
    except Exception:
        env["flex_attention"] = False
    return env


def matmul_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b, warmup=3, iters=10)
    return 2 * 8192**3 / t / 1e12


def packed_position_ids(batch: int, seq: int, lengths: list[int], device) -> torch.Tensor:
    row = torch.cat([torch.arange(n) for n in lengths])[:seq]
    assert row.numel() == seq
    return row.to(device).repeat(batch, 1)


def layer_lever_timings(micro_batch: int = 2, seq: int = 4096) -> dict:
    """fwd+bwd of one Mistral-7B decoder layer (bf16, micro-batch x 4096 tokens) per variant."""
    from transformers import MistralConfig
    from transformers.models.mistral import modeling_mistral

    from training.kernels import apply_fast_kernels, register_attention
    from training.model import DecoderLayerPipe, PackedAttentionContext, prepare_hf_config

    base = MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                         sliding_window=4096)
    lengths = []
    gen = torch.Generator().manual_seed(0)
    while sum(lengths) < seq:
        lengths.append(min(int(torch.randint(128, 2049, (1,), generator=gen)), seq - sum(lengths)))
    packed = packed_position_ids(micro_batch, seq, lengths, "cuda")
    causal = torch.arange(seq, device="cuda").repeat(micro_batch, 1)
    x = torch.randn(micro_batch, seq, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    flops = 6 * 218_112_000 * micro_batch * seq + 12 * 4096 * seq * micro_batch * seq  # 6N + 12hs, one layer
    original_rope = modeling_mistral.apply_rotary_pos_emb
    variants = [
        ("sdpa_dense_doc_mask", "sdpa", "none", packed),  # the trainer's reference (CPU) path
        ("torch_varlen_causal", "torch_varlen", "none", causal),
        ("torch_varlen_doc", "torch_varlen", "none", packed),
        ("torch_varlen_causal_liger", "torch_varlen", "liger", causal),
        ("torch_varlen_doc_liger", "torch_varlen", "liger", packed),
    ]
    out = {}
    for name, attn, kernels, pos in variants:
        try:
            register_attention(attn)
            cfg = prepare_hf_config(base, attn, seq)
            ctx = PackedAttentionContext(cfg, attn)
            torch.manual_seed(0)
            with torch.device("cuda"):
                layer = DecoderLayerPipe(cfg, 0, ctx).bfloat16()
            if kernels == "liger":
                apply_fast_kernels("liger", torch.nn.ModuleList([layer]), loss=None)
            xi = x.clone().requires_grad_()

            def fwd_bwd(layer=layer, xi=xi, pos=pos):
                h, _ = layer((xi, pos))
                h.backward(g)

            t = cuda_time(fwd_bwd, warmup=3, iters=8)
            out[name] = {"ms": t * 1e3, "layer_mfu": flops / t / H200_PEAK_FLOPS,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            print(f"layer {name}: {t * 1e3:.2f} ms fwd+bwd, layer-MFU {flops / t / H200_PEAK_FLOPS:.1%}", flush=True)
            del layer, xi
        except Exception as exc:  # keep measuring the other variants
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"layer {name}: ERROR {out[name]['error']}", flush=True)
        finally:
            modeling_mistral.apply_rotary_pos_emb = original_rope
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return out


def wgrad_timing(tokens: int = 8192, d_in: int = 4096, d_out: int = 14336) -> dict:
    """The weight-gradient step of one micro-batch both ways on a Mistral-7B MLP shape: the fused
    GEMM into the fp32 buffer (training/wgrad_fusion.py) vs bf16 GEMM + the trainer's mixed-dtype add
    (its correctness: tests/test_gpu_kernels.py)."""
    from training.wgrad_fusion import accumulate_wgrad

    dev = torch.device("cuda")
    torch.manual_seed(0)
    g = torch.randn(tokens, d_out, device=dev, dtype=torch.bfloat16)
    x = torch.randn(tokens, d_in, device=dev, dtype=torch.bfloat16)
    main = torch.zeros(d_out, d_in, device=dev)
    fused = cuda_time(lambda: accumulate_wgrad(main, g, x))
    unfused = cuda_time(lambda: main.add_(g.t() @ x))
    flops = 2 * tokens * d_in * d_out
    print(f"wgrad {tokens}x{d_in}x{d_out}: fused {fused * 1e3:.3f} ms, bf16 GEMM + add {unfused * 1e3:.3f} ms",
          flush=True)
    return {"shape": [tokens, d_in, d_out], "fused_ms": fused * 1e3, "bf16_gemm_plus_add_ms": unfused * 1e3,
            "fused_tflops": flops / fused / 1e12, "unfused_tflops": flops / unfused / 1e12}


MEASUREMENTS = ("environment", "matmul", "layers", "wgrad")


def run(out_dir: Path, only: str | None = None) -> dict:
    results: dict = {}
    if only in (None, "environment"):
        results["env"] = environment()
        print(json.dumps(results["env"]), flush=True)
    if only in (None, "matmul"):
        results["matmul_8192_tflops"] = matmul_ceiling()
        print(f"bf16 8192^3 matmul: {results['matmul_8192_tflops']:.0f} TFLOP/s", flush=True)
    if only in (None, "layers"):
        results["layer_levers"] = layer_lever_timings()
    if only in (None, "wgrad"):
        results["wgrad_fusion_timing"] = wgrad_timing()
    (out_dir / "kernel_bench.json").write_text(json.dumps(results, indent=1, default=str))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--only", choices=MEASUREMENTS, default=None, help="run just this measurement")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run(out, args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
