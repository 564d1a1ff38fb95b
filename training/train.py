"""Train stage entry point (DESIGN.md "train"): DeepSpeed pipeline fine-tuning of Mistral.

    torchrun --standalone --nproc_per_node 2 training/train.py \
        --input <train-ready artifact URI> --output <store>/runs/<run_id> --config resolved.yaml

Everything that can be checked without weights (config, world size vs stages, sequence length vs
the model, the input artifact) is checked first. Then: resume from the newest verifiable
checkpoint in the store, train with ``engine.train_batch``, push checkpoints in the background,
evaluate on the validation split, export a Hugging Face model and publish ``model/`` and
``report/`` under the run. Re-running a finished run is a no-op.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script by torchrun/deepspeed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from pipeline_core import layout, uris
from pipeline_core.artifacts import fetch_artifact, publish_artifact, read_manifest
from pipeline_core.config import PROJECT_ROOT, Config, ConfigError, load_config
from training import checkpoints as ckpt
from training.data import COLUMNS, MicroBatches, ShardSet, columns_for, split_files
from training.lease import RunLease, attempt_id
from training.metrics import MetricsLog, flops_per_token, peak_tflops, write_report
from training.model import build_pipeline_module, pipe_layers, prepare_hf_config

log = logging.getLogger("training.train")

DEFAULT_DS_CONFIG = Path(__file__).with_name("ds_config.json")
TINY_CACHE = PROJECT_ROOT / ".cache" / "models"


class TrainConfigError(ValueError):
    """Invalid training setup, detected before any weights load."""


@dataclass
class Plan:
    cfg: Config
    input_uri: str
    run_uri: str
    run_id: str
    world_size: int
    stages: int
    dp: int
    hf_config: Any  # MistralConfig prepared for the pipeline
    base_config: Any  # the base model's own config (what the export carries)
    ds_config: dict[str, Any]
    staging: Path


# ----------------------------------------------------------------------------- validation
def base_model_config(base_model: str):
    """The model's config only (no weights): tiny built-in, a local directory, or a hub id."""
    from transformers import AutoConfig, MistralConfig

    from training.tiny import TINY_CONFIG

    if base_model == "tiny":
        return MistralConfig(**TINY_CONFIG)
    path = uris.to_local_path(base_model) if base_model.startswith("file://") else Path(base_model)
    if path.is_dir() and not (path / "config.json").exists():
        raise TrainConfigError(f"train.base_model: {path} has no config.json")
    try:
        return AutoConfig.from_pretrained(str(path) if path.is_dir() else base_model)
    except OSError as e:
        raise TrainConfigError(f"train.base_model: cannot load a model config from {base_model!r}: {e}") from None


def build_ds_config(cfg: Config, dp: int, on_gpu: bool) -> dict[str, Any]:
    t = cfg.train
    path = uris.to_local_path(t.ds_config) if t.ds_config else DEFAULT_DS_CONFIG
    if not path.is_file():
        raise TrainConfigError(f"train.ds_config: {path} does not exist")
    ds = json.loads(path.read_text())
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    if zero > 1:
        raise TrainConfigError(f"train.ds_config: zero_optimization.stage={zero}; pipeline parallelism supports 0 or 1")
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.gradient_accumulation_steps
    ds["train_batch_size"] = t.micro_batch_size * t.gradient_accumulation_steps * dp
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": t.precision == "bf16"}
    ds.pop("fp16", None)
    opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    opt.setdefault("params", {})["lr"] = t.learning_rate
    if not on_gpu:
        opt["params"]["torch_adam"] = True  # FusedAdam needs CUDA
    sched = ds.setdefault("scheduler", {"type": "WarmupDecayLR", "params": {}})
    if sched.get("type") in ("WarmupLR", "WarmupDecayLR"):
        sched.setdefault("params", {}).update(warmup_max_lr=t.learning_rate, warmup_num_steps=t.warmup_steps)
    if sched.get("type") == "WarmupDecayLR":
        sched["params"]["total_num_steps"] = max(t.steps, t.warmup_steps + 1)
    ds.setdefault("pipeline", {})["activation_checkpoint_interval"] = t.activation_checkpoint_interval
    ds["steps_per_print"] = ds.get("steps_per_print", 10**9)
    return ds


def make_plan(cfg: Config, input_uri: str, output_uri: str, world_size: int, on_gpu: bool) -> Plan:
    t = cfg.train
    input_uri = uris.require_uri(input_uri, "--input")
    run_uri = uris.require_uri(output_uri, "--output").rstrip("/")
    run_id = ckpt.run_id_of(run_uri)
    if world_size % t.pipeline_stages:
        raise TrainConfigError(
            f"train.pipeline_stages={t.pipeline_stages} does not divide the world size {world_size} "
            "(world size = data parallel x pipeline stages)"
        )
    base_config = base_model_config(t.base_model)
    try:
        hf_config = prepare_hf_config(base_config, t.attention_backend, t.seq_len)
    except ValueError as e:
        raise TrainConfigError(str(e)) from None
    n_layers = hf_config.num_hidden_layers + 3
    if t.pipeline_stages > n_layers:
        raise TrainConfigError(f"train.pipeline_stages={t.pipeline_stages} exceeds the model's {n_layers} pipe layers")
    manifest = read_manifest(input_uri, cfg.storage)
    if manifest is None:
        raise TrainConfigError(f"--input {input_uri}: no committed train-ready artifact there (no _manifest.json)")
    if manifest.kind != "train-ready":
        raise TrainConfigError(f"--input {input_uri}: is a {manifest.kind!r} artifact, expected 'train-ready'")
    if not any(f["path"].startswith("data/train/") for f in manifest.files):
        raise TrainConfigError(f"--input {input_uri}: artifact has no data/train/*.parquet files")
    art_seq = (manifest.extra or {}).get("seq_len") or (manifest.config.get("filter") or {}).get("seq_len")
    if art_seq is not None and int(art_seq) != t.seq_len:
        raise TrainConfigError(f"train.seq_len={t.seq_len} but the input artifact is packed to seq_len={art_seq}")
    dp = world_size // t.pipeline_stages
    try:  # train.global_batch_size fixes sequences per step: derive accumulation for this world size
        t.gradient_accumulation_steps = t.accumulation_steps(world_size)
    except ConfigError as e:
        raise TrainConfigError(str(e)) from None
    # per attempt: a zombie attempt and its retry never share (or wipe) each other's files
    staging = uris.to_local_path(layout.staging_dir(cfg, "runs", run_id)) / "attempts" / attempt_id()
    return Plan(cfg, input_uri, run_uri, run_id, world_size, t.pipeline_stages, dp, hf_config, base_config,
                build_ds_config(cfg, dp, on_gpu), staging)


# ----------------------------------------------------------------------------- helpers
def resolve_base_model(base_model: str, local_rank: int) -> Path:
    """Local directory with the base weights; node-local rank 0 fetches/builds, the others wait."""
    import torch.distributed as dist

    from training.tiny import ensure_tiny_model
    from training.weights import resolve_model_dir

    def get() -> Path:
        return ensure_tiny_model(TINY_CACHE) if base_model == "tiny" else resolve_model_dir(base_model)

    if local_rank == 0:
        path = get()
    dist.barrier()
    if local_rank != 0:
        path = get()
    return path


def broadcast(obj, src: int = 0):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@torch.no_grad()
def logits_vs_hf(engine, probe: dict[str, torch.Tensor] | None, model_dir: Path, dtype: torch.dtype) -> float | None:
    """Max |pipeline logits - transformers logits| on the probe batch (on the last stage; None elsewhere)."""
    batch = None
    if probe is not None:
        batch = ((probe["input_ids"], probe["position_ids"]), probe["targets"])
    _, logits = engine.eval_batch(iter([batch]), return_logits=True, num_micro_batches=1)
    if not engine.is_last_stage():
        return None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").eval()
    # use_cache=False: transformers only derives the packed-document mask from position_ids without a cache
    ref = hf(input_ids=probe["input_ids"].cpu(), position_ids=probe["position_ids"].cpu(), use_cache=False).logits
    del hf
    return float((logits.float().cpu() - ref.float()).abs().max())


def gather_value(value):
    """The one non-None value (e.g. the last stage's), on every rank."""
    return next((v for v in gather_all(value) if v is not None), None)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="train-ready artifact URI")
    p.add_argument("--output", required=True, help="run prefix URI: <store>/runs/<run_id>")
    p.add_argument("--config", default=None, help="resolved project config (YAML/JSON)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
                        )
    cfg = load_config(args.config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    plan = make_plan(cfg, args.input, args.output, world_size, on_gpu)  # raises before any weights load
    if all(read_manifest(u, cfg.storage) is not None for u in (layout.model_uri(plan.run_uri),
                                                                layout.report_uri(plan.run_uri))):
        log.info("run %s is complete (model/ and report/ are committed); nothing to do", plan.run_uri)
        return 0  # a model without its report is repaired: the run resumes from its last checkpoint
    lease = RunLease(plan.run_uri, cfg.storage, cfg.train.lease_ttl_s, plan.staging.name).acquire() if rank == 0 else None
    try:
        return Trainer(plan, lease).run()
    finally:
        if lease is not None:
            lease.release()


class Trainer:
    def __init__(self, plan: Plan, lease: RunLease | None = None):
        self.plan = plan
        self.lease = lease  # rank 0's hold on runs/<run_id>/: every store write of the run checks it
        self.cfg = plan.cfg
        self.t = plan.cfg.train
        self.storage = plan.cfg.storage

    # -- setup
    def _init_dist(self) -> None:
        import deepspeed
        import torch.distributed as dist

        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.rank = dist.get_rank()

    def _prepare_staging(self) -> None:
        import torch.distributed as dist

        run_staging = self.plan.staging.parent.parent
        if self.rank == 0:  # holds the lease: earlier attempts are dead; push what they saved, drop the rest
            self.ckpt_key = ckpt.hmac_key(self.cfg.pipeline.staging_uri)
            ckpt.prepare_attempt(run_staging, self.plan.staging, self.plan.run_uri, self.storage, key=self.ckpt_key,
                                 keep_last=self.t.keep_last, lease=self.lease)
        dist.barrier()
        if self.local_rank == 0:
            self.plan.staging.mkdir(parents=True, exist_ok=True)
            (run_staging / "input").mkdir(parents=True, exist_ok=True)
            if not (self.plan.staging / "input").is_symlink():  # the verified input is shared by the run's attempts
                (self.plan.staging / "input").symlink_to(run_staging / "input", target_is_directory=True)
            fetch_artifact(self.plan.input_uri, self.plan.staging / "input", self.storage, prefix="data/")
        dist.barrier()

    def run(self) -> int:
        import deepspeed
        import torch.distributed as dist

        from training.weights import load_stage_weights

        t0 = time.time()
        self._init_dist()
        plan, t = self.plan, self.t
        torch.manual_seed(t.seed)
        np.random.seed(t.seed)
        random.seed(t.seed)
        self._prepare_staging()
        model_dir = resolve_base_model(t.base_model, self.local_rank)

        pipe = build_pipeline_module(
            plan.hf_config, num_stages=plan.stages, partition_method=t.partition_method,
            attention_backend=t.attention_backend, activation_checkpoint_interval=t.activation_checkpoint_interval,
            device=self.device, fast_kernels=t.fast_kernels,
        )
        n = load_stage_weights(pipe_layers(pipe), model_dir)
        log.info("stage %d: loaded %d base tensors from %s", pipe.stage_id, n, model_dir)
        engine, _, _, _ = deepspeed.initialize(
            model=pipe, model_parameters=[p for p in pipe.parameters() if p.requires_grad], config=plan.ds_config
        )
        self.engine = engine
        first, last = engine.is_first_stage(), engine.is_last_stage()
        dp_rank, dp_size = engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()

        # ---- resume
        restored = None
        if self.rank == 0:
            contract = ckpt.resume_contract(self.cfg.model_dump(mode="json"), plan.input_uri, self.storage,
                                            t.resume_across_changes)
            restored = ckpt.fetch_newest_valid(plan.run_uri, self.storage, plan.staging / "resume", contract=contract,
                                               key=self.ckpt_key, lease=self.lease)
            ckpt.discard_after(plan.run_uri, self.storage, restored.step if restored else 0,
                               restored.uri if restored else None, lease=self.lease)
        restored = broadcast(restored)
        start_step, position = 0, 0
        if restored is not None:
            _, client = engine.load_checkpoint(str(restored.local_dir), tag=ckpt.TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
            if client is None:
                raise RuntimeError(f"DeepSpeed could not load checkpoint {restored.uri}")
            start_step, position = int(client["step"]), int(client["data_position"])
            ckpt.load_rng(restored.local_dir / ckpt.TAG, self.rank)
            log.info("resumed from %s: step %d, data position %d", restored.uri, start_step, position)

        # ---- data
        inp = plan.staging / "input"
        train_iter = None
        if first or last:
            shards = ShardSet(split_files(inp, "train"), t.seq_len, columns_for(first, last))
            train_iter = MicroBatches(shards, micro_batch=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                      seed=t.seed, position=position, need_inputs=first, need_labels=last,
                                      device=self.device)
        val_files = split_files(inp, "val")

        metrics = None
        report_dir = plan.staging / "report" / "data"
        if self.rank == 0:
            report_dir.mkdir(parents=True, exist_ok=True)
            csv_path = report_dir / "metrics.csv"
            csv_path.unlink(missing_ok=True)
            if restored is not None and (restored.local_dir / ckpt.TAG / "metrics.csv").exists():
                shutil.copy(restored.local_dir / ckpt.TAG / "metrics.csv", csv_path)
            metrics = MetricsLog(csv_path, report_dir / "tensorboard")
            metrics.truncate(start_step)

        summary: dict[str, Any] = {"run": plan.run_uri, "input": plan.input_uri, "resumed_from_step": start_step}
        probe = self._probe(val_files, first, last) if t.verify_parity else None
        dtype = torch.float32 if t.precision == "fp32" else torch.bfloat16
        if t.verify_parity and restored is None:
            diff = gather_value(logits_vs_hf(engine, probe, model_dir, dtype))
            summary["parity_base_max_abs_diff"] = diff
            log.info("parity vs transformers (base model): max |diff| = %.3g", diff)
            self._check_parity(diff, "base model")

        uploader = None
        if self.rank == 0:
            uploader = ckpt.CheckpointUploader(
                plan.run_uri, self.storage,
                ckpt.PushPolicy(t.keep_last, t.max_failed_pushes, t.max_pending_pushes, t.push_backoff_s),
                config=self.cfg.model_dump(mode="json"), inputs=[plan.input_uri], key=self.ckpt_key, lease=self.lease)

        # ---- train
        tokens_per_step = t.micro_batch_size * t.gradient_accumulation_steps * plan.dp * t.seq_len
        fpt = flops_per_token(plan.hf_config, t.seq_len)
        peak = peak_tflops(t.peak_tflops) if self.device.type == "cuda" else None
        train_t0 = time.time()
        for step in range(start_step + 1, t.steps + 1):
            t_step = time.time()
            loss = engine.train_batch(data_iter=train_iter)
            dt = time.time() - t_step
            grad_norm = engine.get_global_grad_norm()
            if metrics is not None:
                tps = tokens_per_step / dt
                metrics.add({
                    "step": step, "loss": float(loss), "lr": engine.get_lr()[0],
                    "grad_norm": None if grad_norm is None else float(grad_norm), "tokens_per_s": tps,
                    "step_time_s": dt, "mfu": None if peak is None else fpt * tps / (peak * 1e12 * plan.world_size),
                })
            if step % t.checkpoint_every == 0 or step == t.steps:
                self._save_checkpoint(step, step * t.gradient_accumulation_steps, uploader, metrics)
        summary["train_time_s"] = time.time() - train_t0
        summary["steps_run"] = t.steps - start_step

        # ---- eval
        summary.update(self._evaluate(val_files, first, last, dp_rank, dp_size, metrics))

        # ---- export
        export_dir = self._export(model_dir, dtype)
        if t.verify_parity:
            diff = gather_value(logits_vs_hf(engine, probe, export_dir / "data", dtype))
            summary["parity_export_max_abs_diff"] = diff
            log.info("parity vs transformers (exported model): max |diff| = %.3g", diff)
            self._check_parity(diff, "exported model")

        if self.rank == 0:
            uploader.close()  # every checkpoint is in the store before the run is declared done
            rows = metrics.rows
            metrics.close()
            summary.update(
                steps=t.steps, checkpoints_pushed=uploader.pushed, world_size=plan.world_size,
                pipeline_stages=plan.stages, data_parallel=plan.dp, precision=t.precision,
                tokens_per_step=tokens_per_step, wall_time_s=time.time() - t0,
                final_train_loss=rows[-1]["loss"] if rows else None,
                mean_step_time_s=float(np.mean([r["step_time_s"] for r in rows[1:]] or [math.nan])),
            )
            write_report(report_dir, rows, summary)
            cfg_json = self.cfg.model_dump(mode="json")
            self.lease.check()
            publish_artifact(export_dir, layout.model_uri(plan.run_uri), kind="model", config=cfg_json,
                             inputs=[plan.input_uri], counts={}, extra={"format": "huggingface", "step": t.steps},
                             storage=self.storage)
            publish_artifact(report_dir.parent, layout.report_uri(plan.run_uri), kind="report", config=cfg_json,
                             inputs=[plan.input_uri], counts={}, extra={k: summary.get(k) for k in
                             ("eval_loss", "eval_perplexity", "final_train_loss")}, storage=self.storage)
            log.info("run complete: %s", json.dumps({k: summary.get(k) for k in
                     ("final_train_loss", "eval_loss", "eval_perplexity", "mean_step_time_s")}))
        dist.barrier()
        dist.destroy_process_group()
        return 0

    # -- pieces
    def _probe(self, val_files, first: bool, last: bool) -> dict[str, torch.Tensor] | None:
        """A fixed validation micro-batch with every column (for the parity check)."""
        if not (first or last):
            return None
        files = val_files or split_files(self.plan.staging / "input", "train")
        it = MicroBatches(ShardSet(files, self.t.seq_len, COLUMNS), micro_batch=self.t.micro_batch_size,
                          dp_rank=0, dp_size=1, seed=0, shuffle=False, device=self.device)
        (ids, pos), targets = next(it)
        return {"input_ids": ids, "position_ids": pos, "targets": targets}

    def _check_parity(self, diff: float, what: str) -> None:
        if diff > self.t.parity_tolerance:
            raise RuntimeError(f"pipeline logits differ from transformers' ({what}) by {diff:.3g} > "
                               f"train.parity_tolerance={self.t.parity_tolerance}")

    def _save_checkpoint(self, step: int, position: int, uploader, metrics) -> None:
        import torch.distributed as dist

        local = self.plan.staging / "checkpoints" / f"step-{step}"
        self.engine.save_checkpoint(str(local), tag=ckpt.TAG, save_latest=False,
                                    client_state={"step": step, "data_position": position})
        ckpt.save_rng(local / ckpt.TAG, self.rank)
        if metrics is not None:
            shutil.copy(metrics.csv_path, local / ckpt.TAG / "metrics.csv")
        dist.barrier()  # every rank's files are on disk before the push starts
        if uploader is not None:
            ckpt.check_all_ranks(local, self.plan.world_size)
            uploader.submit(step, local, {"data_position": position})  # raises once pushing failed for good

    def _evaluate(self, val_files, first, last, dp_rank, dp_size, metrics) -> dict[str, Any]:
        t = self.t
        if not val_files or t.eval_batches == 0:
            log.warning("no validation split or train.eval_batches=0: skipping evaluation")
            return {"eval_loss": None, "eval_perplexity": None}
        it = None
        n_batches = t.eval_batches
        if first or last:
            shards = ShardSet(val_files, t.seq_len, columns_for(first, last))
            it = MicroBatches(shards, micro_batch=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=0,
                              shuffle=False, need_inputs=first, need_labels=last, device=self.device)
            n_batches = min(n_batches, it.per_epoch)
        n_batches = min(v for v in gather_all(n_batches) if v is not None)
        loss = float(self.engine.eval_batch(it, num_micro_batches=n_batches))
        ppl = math.exp(min(loss, 50.0))
        log.info("validation: loss %.4f perplexity %.2f (%d micro-batches per pipeline)", loss, ppl, n_batches)
        if metrics is not None:
            metrics.scalar("eval/loss", loss, t.steps)
        return {"eval_loss": loss, "eval_perplexity": ppl, "eval_micro_batches": n_batches}

    def _export(self, model_dir: Path, dtype: torch.dtype) -> Path:
        """Every stage's dp-rank-0 writes its shard; rank 0 adds index/config/tokenizer."""
        import torch.distributed as dist

        from training.weights import finish_export, save_stage_shard

        out = self.plan.staging / "export"
        data = out / "data"
        part = None
        if self.engine.grid.get_data_parallel_rank() == 0:
            part = save_stage_shard(pipe_layers(self.engine.module), data, self.engine.stage_id,
                                    self.plan.stages, dtype)
        parts = gather_all(part)
        if self.rank == 0:
            finish_export(data, [p for p in parts if p], model_dir, self.plan.base_config, dtype)
        dist.barrier()
        return out


def gather_all(value) -> list:
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


if __name__ == "__main__":
    sys.exit(main())
