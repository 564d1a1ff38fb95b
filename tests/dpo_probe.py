"""Run by tests/test_dpo_loss.py under torchrun (CPU, gloo): the trainer's DPO pieces on pair rows.

    torchrun --nproc_per_node N tests/dpo_probe.py DATA_DIR MODEL_DIR STAGES OUT.json OPTIONS

DATA_DIR holds data/{train,val}/*.parquet pair rows and reference.pt ({split: [rows, 2] float64}).
OPTIONS: JSON {"micro_batch": m, "accumulation": g, "beta": b, "loss_type": ..., "label_smoothing": ...}.
Builds the pipeline module with the DPO loss and the hidden-state head (training/dpo_train.py),
then (1) the reference pass of ``dpo_train.sequence_logps`` over the train split with the base weights,
(2) one training step on the train split with the given reference log-probs (PairMicroBatches,
StepBatches counting pairs), (3) an evaluation pass. The last stage of replica 0 writes OUT.json:
collected log-probs, step loss, the step's and the evaluation's DPO metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(data_dir: str, model_dir: str, stages: int, out: str, options: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from pipeline_core.config import load_config
    from tests.training_helpers import load_model_config
    from training import dpo_train
    from training.data import ShardSet, columns_for, split_files
    from training.dpo_data import PairMicroBatches
    from training.engine import build_engine, engine_spec
    from training.loss import StepBatches
    from training.model import build_pipeline_module, pipe_layers, prepare_hf_config
    from training.runtime import resolve_settings
    from training.weights import load_stage_weights

    opts = json.loads(options)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    dp = world // stages
    data = Path(data_dir)
    reference = torch.load(data / "reference.pt")
    seq = int(opts["seq_len"])
    cfg = load_config(overrides={
        "enrich.objective": "dpo", "filter.objective": "dpo", "train.objective": "dpo",
        "train.pipeline_stages": stages, "train.seq_len": seq, "train.micro_batch_size": opts["micro_batch"],
        "train.gradient_accumulation_steps": opts["accumulation"], "train.precision": "fp32",
        "train.learning_rate": 1e-3, "train.warmup_steps": 1, "train.steps": 1,
        "train.dpo": {"beta": opts["beta"], "loss_type": opts.get("loss_type", "sigmoid"),
                      "label_smoothing": opts.get("label_smoothing", 0.0)},
    })
    t = cfg.train
    spec = engine_spec(t, dp, resolve_settings(t, on_gpu=False))  # train.py's, for this config
    ds = spec.ds_config
    ds["zero_optimization"] = {"stage": 0}
    hf_cfg = prepare_hf_config(load_model_config(Path(model_dir)), "sdpa", seq)
    pipe = build_pipeline_module(hf_cfg, num_stages=stages, attention_backend="sdpa", loss_fn=dpo_train.make_loss(t))
    engine = build_engine(pipe, ds, torch.device("cpu"), spec.converters,  # dpo: hidden states
                          load_weights=lambda p: load_stage_weights(pipe_layers(p), Path(model_dir))).engine
    first, last = engine.is_first_stage(), engine.is_last_stage()
    role = SimpleNamespace(first=first, last=last, has_data=first or last, dp_rank=engine.grid.get_data_parallel_rank(),
                           dp_size=dp, device=torch.device("cpu"))
    loss = pipe.loss_fn
    shards = {s: ShardSet(split_files(data, s), seq, columns_for(first, last)) for s in ("train", "val")}

    collected = dpo_train.sequence_logps(engine, role, loss, shards["train"], t)

    def step_batches(split: str, n: int | None = None):
        src = PairMicroBatches(shards[split], reference[split].numpy(), micro_batch=t.micro_batch_size,
                               dp_rank=role.dp_rank, dp_size=dp, seed=t.seed, need_inputs=first, need_labels=last)
        return StepBatches(src if role.has_data else None, loss if last else None, micro_batches=n or
                           t.gradient_accumulation_steps, dp_size=dp, dp_group=engine.grid.get_data_parallel_group())

    step_loss = float(engine.train_batch(data_iter=step_batches("train").next_step()))
    step = dpo_train.step_metrics(loss, role, engine)
    n_val = shards["val"].num_rows // (t.micro_batch_size * dp)
    eval_loss = float(engine.eval_batch(step_batches("val", n_val).next_step(), num_micro_batches=n_val))
    ev = dpo_train.step_metrics(loss, role, engine)
    if last and role.dp_rank == 0:
        Path(out).write_text(json.dumps({
            "collected": collected[0].tolist(), "collected_counts": collected[1].tolist(),
            "loss": step_loss, "step": step.as_row(),
            "eval_loss": eval_loss, "eval": ev.as_row()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
