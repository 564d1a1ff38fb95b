"""Run by tests/test_training_loss.py under torchrun (CPU, gloo): one training step and one
evaluation of the trainer's own pieces (pipeline module with its TokenMeanLoss, the resolved
DeepSpeed config, the client optimizer, StepBatches) on rows the test hands over in a .pt file.

    torchrun --nproc_per_node N tests/training_loss_probe.py ROWS.pt MODEL_DIR STAGES PRECISION OUT.json

Each data-parallel replica takes its micro-batches in order from ROWS.pt's ``per_replica`` list.
The last stage of replica 0 writes OUT.json: step loss, eval loss, the gradient of
``lm_head.weight`` seen by the optimizer, and the engine's precision settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(rows_path: str, model_dir: str, stages: int, precision: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from pipeline_core.config import load_config
    from training.loss import StepBatches
    from training.model import build_pipeline_module, pipe_layers, prepare_hf_config
    from training.optim import build_ds_config, build_optimizer
    from training.runtime import resolve_settings
    from training.weights import load_model_config, load_stage_weights

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    data = torch.load(rows_path)
    per_replica = data["per_replica"]
    dp = world // stages
    cfg = load_config(overrides={
        "train.pipeline_stages": stages, "train.seq_len": data["seq_len"], "train.micro_batch_size": 1,
        "train.gradient_accumulation_steps": len(per_replica[0]), "train.precision": precision,
        "train.learning_rate": 1e-3, "train.warmup_steps": 1, "train.steps": 1,
    })
    settings = resolve_settings(cfg.train, on_gpu=False)
    ds = build_ds_config(cfg.train, dp, settings)
    ds["gradient_clipping"] = 0.0  # the test compares raw gradients
    if precision == "fp32":  # ZeRO-1 would hand the optimizer flat partitions, not the head's own .grad
        ds["zero_optimization"] = {"stage": 0}
    hf_cfg = prepare_hf_config(load_model_config(Path(model_dir)), "sdpa", data["seq_len"])
    pipe = build_pipeline_module(hf_cfg, num_stages=stages, attention_backend="sdpa")
    load_stage_weights(pipe_layers(pipe), Path(model_dir))
    optimizer = build_optimizer(pipe, ds, torch.device("cpu"))
    grads = {}
    head = next((p for n, p in pipe.named_parameters() if n.endswith("lm_head.weight")), None)

    def capture(opt, args, kwargs):
        # the optimizer's parameters: the model's own (fp32) or the BF16 optimizer's fp32 partitions
        if head is not None and head.grad is not None:
            grads["lm_head"] = head.grad.detach().float().clone()

    optimizer.register_step_pre_hook(capture)
    engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=optimizer,
                                           config={k: v for k, v in ds.items() if k != "optimizer"})
    replica = engine.grid.get_data_parallel_rank()
    last = engine.is_last_stage()

    def source():
        for ids, pos, targets in per_replica[replica]:
            yield (ids[None], pos[None]), targets[None]

    def batches():
        has_data = engine.is_first_stage() or last
        return StepBatches(source() if has_data else None, pipe.loss_fn if last else None,
                           micro_batches=len(per_replica[0]), dp_size=dp,
                           dp_group=engine.grid.get_data_parallel_group())

    loss = float(engine.train_batch(data_iter=batches().next_step()))
    eval_loss = float(engine.eval_batch(batches().next_step(), num_micro_batches=len(per_replica[0])))
    if last and replica == 0:
        result = {"loss": loss, "eval_loss": eval_loss, "targets": pipe.loss_fn.targets,
                  "optimizer": type(engine.optimizer).__name__,
                  "grad_accum_dtype": str(engine.get_data_types()[1]),
                  "lm_head_grad": grads["lm_head"].tolist() if "lm_head" in grads else None}
        if result["optimizer"] == "BF16_Optimizer":
            result["accumulator_dtypes"] = sorted({str(g.dtype) for g in engine.optimizer.fp32_groups_gradients_flat})
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
