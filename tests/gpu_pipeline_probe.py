"""Run by tests/test_gpu_pipeline.py under torchrun (2 GPUs, nccl; gloo on CPU for a dry run of the
logic): the 2-stage pipeline (fast paths on, training/engine.py's builder) vs the HF model in bf16 on
a fixed packed batch (reference: HF run document by document), then STEPS steps of a tiny config
on the same repeating micro-batches.

    torchrun --nproc_per_node 2 tests/gpu_pipeline_probe.py OUT.json STEPS ATTENTION KERNELS

Rank 0 writes OUT.json: the two eval losses and the learning curve (first/last 10 steps, seconds)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(out: Path, steps: int, attention: str, kernels: str) -> None:
    import deepspeed
    from transformers import MistralForCausalLM

    from bench.train_throughput import RepeatingBatches, make_micro_batches
    from tests.gpu_helpers import tiny_config
    from tests.training_helpers import causal_lm_loss
    from training.engine import FastKernels, build_engine
    from training.loss import StepBatches
    from training.model import build_pipeline_module, pipe_layers
    from training.weights import load_stage_weights

    cuda = torch.cuda.is_available()  # CPU (gloo) only for a dry run of this probe's logic
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, local = torch.distributed.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local)
    seq, mb, m = 512, 2, 4
    cfg = tiny_config(hidden=256, layers=4, attn=attention, seq=seq)
    model_dir = out.parent / "mft_gpu_check_model"
    if rank == 0:
        torch.manual_seed(0)
        hf = MistralForCausalLM(tiny_config(hidden=256, layers=4, attn="sdpa", seq=seq))
        hf.save_pretrained(model_dir)
    torch.distributed.barrier()

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        module = build_pipeline_module(cfg, num_stages=2, attention_backend=attention, device=dev)
    finally:
        torch.set_default_dtype(old)
    ds_config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": m, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=2e-3, fused=cuda or None)
    engine = build_engine(module, ds_config, dev, [FastKernels(kernels, in_layers=True)], optimizer=opt,
                          load_weights=lambda m: load_stage_weights(pipe_layers(m), model_dir)).engine

    batches = make_micro_batches(n=m, micro_batch=mb, seq_len=seq, vocab=cfg.vocab_size, docs="packed", seed=7)

    def steps_of(data):  # the trainer's token-mean loss: count each step's targets first
        return StepBatches(data, module.loss_fn if engine.is_last_stage() else None, micro_batches=m, dp_size=1)

    pipe_loss = float(engine.eval_batch(steps_of(RepeatingBatches(batches, pin=False)).next_step()))
    result: dict = {}
    if rank == 0:
        # reference: the HF model in bf16, each packed document run on its own
        hf = MistralForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
        losses = []
        with torch.no_grad():
            for b in batches:
                logits = torch.empty(mb, seq, cfg.vocab_size, device=dev, dtype=torch.bfloat16)
                for row in range(mb):
                    starts = (b["position_ids"][row] == 0).nonzero().flatten().tolist() + [seq]
                    for s0, s1 in zip(starts, starts[1:], strict=False):
                        ids = b["input_ids"][row:row + 1, s0:s1].to(dev)
                        logits[row, s0:s1] = hf(input_ids=ids).logits[0]
                losses.append(float(causal_lm_loss(logits, b["targets"].to(dev))) * int((b["targets"] != -100).sum()))
        hf_loss = sum(losses) / sum(int((b["targets"] != -100).sum()) for b in batches)  # token mean
        result["pipeline_eval_loss"], result["hf_doc_by_doc_loss"] = pipe_loss, hf_loss
        print(f"pipeline eval loss {pipe_loss:.5f} vs HF (bf16, doc by doc) {hf_loss:.5f}", flush=True)

    # learning: a fixed set of micro-batches is memorisable, so the loss must fall well below ln(V)
    data = steps_of(RepeatingBatches(batches, pin=cuda))
    curve, t0 = [], time.perf_counter()
    for _ in range(steps):
        curve.append(float(engine.train_batch(data_iter=data.next_step())))
    elapsed = time.perf_counter() - t0
    if rank == 0:
        first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
        result["learning"] = {"steps": steps, "first10": first, "last10": last, "seconds": elapsed,
                              "curve": curve[:: max(1, steps // 50)]}
        print(f"learning: loss {first:.3f} -> {last:.3f} over {steps} steps ({elapsed:.1f} s)", flush=True)
        out.write_text(json.dumps(result, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
