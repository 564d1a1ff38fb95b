"""Run by tests/test_training_loss.py under torchrun (CPU, gloo): one training step and one
evaluation of the trainer's own pieces (pipeline module with its TokenMeanLoss, the resolved
DeepSpeed config, the client optimizer, StepBatches) on rows the test hands over in a .pt file.

    torchrun --nproc_per_node N tests/training_loss_probe.py ROWS.pt MODEL_DIR STAGES PRECISION OUT.json [OPTIONS]

OPTIONS: JSON object of TrainSection overrides for the run (e.g. {"fused_wgrad_accumulation": true}).

Each data-parallel replica takes its micro-batches in order from ROWS.pt's ``per_replica`` list.
The last stage of replica 0 writes OUT.json: step loss, eval loss, the gradient of
``lm_head.weight`` seen by the optimizer, the global gradient norm and the engine's precision
settings; under the BF16 optimizer every rank writes the fp32 gradients of its decoder matrices
(name -> tensor, as the step reads them) to OUT.json.rank<R>.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# What the probe changes in the DeepSpeed config train.py would use, and why (nothing else may differ:
# tests/test_training_runtime.py::test_the_loss_probe_builds_the_engine_train_py_builds):
#   gradient_clipping 0: the test compares raw gradients;
#   zero_optimization stage 0 under fp32: ZeRO-1 would hand the optimizer flat partitions, not the
#   head's own .grad.
PROBE_DS_CHANGES = ("gradient_clipping", "zero_optimization")


def probe_config(stages: int, seq_len: int, micro_batches: int, precision: str, options: dict):
    from pipeline_core.config import load_config

    return load_config(overrides={
        "train.pipeline_stages": stages, "train.seq_len": seq_len, "train.micro_batch_size": 1,
        "train.gradient_accumulation_steps": micro_batches, "train.precision": precision,
        "train.learning_rate": 1e-3, "train.warmup_steps": 1, "train.steps": 1,
        **{f"train.{k}": v for k, v in options.items()},
    })


def probe_engine_spec(cfg, dp: int):
    """train.py's engine spec for ``cfg`` (training/engine.py), with PROBE_DS_CHANGES applied."""
    from training.engine import engine_spec
    from training.runtime import resolve_settings

    settings = resolve_settings(cfg.train, on_gpu=False)
    spec = engine_spec(cfg.train, dp, settings)
    spec.ds_config["gradient_clipping"] = 0.0
    if settings.precision == "fp32":
        spec.ds_config["zero_optimization"] = {"stage": 0}
    return spec, settings


def main(rows_path: str, model_dir: str, stages: int, precision: str, out: str, options: str = "{}") -> None:
    import deepspeed
    import torch.distributed as dist

    from tests.training_helpers import load_model_config
    from training.engine import build_engine
    from training.loss import StepBatches
    from training.model import build_pipeline_module, pipe_layers, prepare_hf_config
    from training.weights import load_stage_weights

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    data = torch.load(rows_path)
    per_replica = data["per_replica"]
    dp = world // stages
    cfg = probe_config(stages, data["seq_len"], len(per_replica[0]), precision, json.loads(options))
    spec, settings = probe_engine_spec(cfg, dp)
    ds = spec.ds_config
    hf_cfg = prepare_hf_config(load_model_config(Path(model_dir)), "sdpa", data["seq_len"])
    pipe = build_pipeline_module(hf_cfg, num_stages=stages, attention_backend="sdpa")
    grads, held = {}, {}
    head = next((p for n, p in pipe.named_parameters() if n.endswith("lm_head.weight")), None)

    def capture(opt, args, kwargs):
        # the optimizer's parameters: the model's own (fp32) or the BF16 optimizer's fp32 partitions
        if head is not None and head.grad is not None:
            grads["lm_head"] = head.grad.detach().float().clone()
        bf16 = held.get("bf16_optimizer")
        if bf16 is not None:  # the fp32 gradient of each decoder matrix, as the step reads it
            slot = {id(lp): (i, j) for i, group in enumerate(bf16.bf16_groups) for j, lp in enumerate(group)}
            grads["decoder"] = {n: bf16.fp32_groups_gradients[slot[id(p)][0]][slot[id(p)][1]].view(p.shape).clone()
                                for n, p in pipe.named_parameters() if p.ndim == 2 and (".self_attn." in n or ".mlp." in n)}

    built = build_engine(pipe, ds, torch.device("cpu"), spec.converters,
                         load_weights=lambda p: load_stage_weights(pipe_layers(p), Path(model_dir)))
    built.optimizer.register_step_pre_hook(capture)  # the client optimizer: its step reads the gradients
    engine = built.engine
    if type(engine.optimizer).__name__ == "BF16_Optimizer":
        held["bf16_optimizer"] = engine.optimizer
    bound = built.fast_paths.wgrad_fused_weights
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
    grad_norm = engine.get_global_grad_norm()
    torch.save(grads.get("decoder", {}), f"{out}.rank{dist.get_rank()}.pt")
    eval_loss = float(engine.eval_batch(batches().next_step(), num_micro_batches=len(per_replica[0])))
    if last and replica == 0:
        result = {"loss": loss, "eval_loss": eval_loss, "targets": pipe.loss_fn.targets,
                  "optimizer": type(engine.optimizer).__name__,
                  "grad_accum_dtype": str(engine.get_data_types()[1]),
                  "grad_norm": None if grad_norm is None else float(grad_norm), "main_grad_weights": bound,
                  "lm_head_grad": grads["lm_head"].tolist() if "lm_head" in grads else None}
        if result["optimizer"] == "BF16_Optimizer":
            result["accumulator_dtypes"] = sorted({str(g.dtype) for g in engine.optimizer.fp32_groups_gradients_flat})
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], *sys.argv[6:7])
