"""Train stage entry point (DESIGN.md "train"): DeepSpeed pipeline fine-tuning of Mistral.

    torchrun --standalone --nproc_per_node 2 training/train.py \
        --input <train-ready artifact URI> --output <store>/runs/<run_id> --config resolved.yaml

Everything that can be checked without weights (config, world size vs stages, sequence length vs
the model, the input artifact and its tokenizer vs the model's vocabulary) is checked first. Then
the phases of ``Trainer.run``: setup (inputs and base weights fetched on a gloo side group whose
timeout is sized to the transfer, never inside an NCCL collective; engine), resume (newest
verifiable checkpoint in the store, data position included), fit (``engine.train_batch`` with the
token-mean loss, periodic validation, checkpoints pushed in the background), evaluate, export and
publish ``model/`` and ``report/`` under the run. Re-running a finished run is a no-op.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script by torchrun/deepspeed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Fewer allocator splits near full memory; read at the first CUDA allocation, so set before it.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipeline_core import layout, uris  # noqa: E402
from pipeline_core.artifacts import fetch_artifact, publish_artifact, read_manifest  # noqa: E402
from pipeline_core.config import PROJECT_ROOT, Config, ConfigError, load_config  # noqa: E402
from pipeline_core.handoffs import TokenizerSpec, TrainReadyInfo  # noqa: E402
from pipeline_core.names import SPLITS, Split, data_prefix  # noqa: E402
from pipeline_core.run_records import RunReportInfo  # noqa: E402
from training import base_model, dpo_train  # noqa: E402
from training import checkpoints as ckpt  # noqa: E402
from training.collectives import agreed_staging, broadcast, gather_all, gather_value  # noqa: E402
from training.data import COLUMNS, MicroBatches, ShardSet, columns_for, split_files  # noqa: E402
from training.engine import FastPaths, ModelConverter, build_engine, engine_spec, model_converters  # noqa: E402
from training.flops import ModelShape, flops_per_token  # noqa: E402
from training.kernels import (  # noqa: E402
    check_attention_window,
    register_attention,
)
from training.lease import RunLease, attempt_id  # noqa: E402
from training.loss import StepBatches, TokenMeanLoss  # noqa: E402
from training.memory import (  # noqa: E402
    GIB,
    USABLE_FRACTION,
    StageMemory,
    TrainShape,
    choose_recompute,
    estimate_stages,
    fits,
    tokens_that_fit,
)
from training.metrics import MetricsLog, peak_tflops, write_report  # noqa: E402
from training.model import build_pipeline_module, pipe_layers, prepare_hf_config  # noqa: E402
from training.optim import (  # noqa: E402
    OptimizerConfigError,
)
from training.runtime import Settings, resolve_settings  # noqa: E402
from training.tracking import Tracker  # noqa: E402

log = logging.getLogger("training.train")

TINY_CACHE = PROJECT_ROOT / ".cache" / "models"
STORE_MODELS = PROJECT_ROOT / ".cache" / "store-models"  # train.base_model given as a committed model artifact


class TrainConfigError(ValueError):
    """Invalid training setup, detected before any weights load."""


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row (train.max_bad_steps)."""


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
    settings: Settings
    tokenizer: TokenizerSpec | None = None  # what the train-ready artifact was rendered with
    recompute: str = "none"  # train.recompute resolved (auto -> a mode, training/memory.py)
    recompute_every: int = 1
    memory: StageMemory | None = None  # the fullest stage's estimate (GPU only)
    input_manifest: Any = None  # the train-ready artifact's manifest (its hashes and counts are tracked)

    def converters(self) -> list[ModelConverter]:
        """The performance levers this run's engine gets, in order (training/engine.py)."""
        return model_converters(self.cfg.train, self.settings)


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


def check_tokenizer(spec: TokenizerSpec, base_config, base_model: str) -> None:
    """The data's token ids must mean what the model's embedding rows mean: same vocabulary size
    and special ids (e.g. ``mistral-v3`` data on a 32000-vocab v0.1 model is refused)."""
    model_ids = {"vocab": base_config.vocab_size, "bos": getattr(base_config, "bos_token_id", None),
                 "eos": getattr(base_config, "eos_token_id", None)}
    data_ids = {"vocab": spec.vocab_size, "bos": spec.bos_id, "eos": spec.eos_id}
    bad = [k for k in data_ids if data_ids[k] is not None and model_ids[k] is not None and data_ids[k] != model_ids[k]]
    if bad:
        def show(ids):
            return ", ".join(f"{k} {ids[k]}" for k in ("vocab", "bos", "eos"))

        raise TrainConfigError(
            f"the input artifact was tokenized with {spec.name!r} ({show(data_ids)}) but train.base_model "
            f"{base_model!r} has {show(model_ids)}: re-run the filter with a filter.tokenizer that matches the "
            "model, or train a base model with this vocabulary"
        )


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
    settings = resolve_settings(t, on_gpu)
    if t.fp8 != "off" and on_gpu and torch.cuda.get_device_capability() < (8, 9):
        raise TrainConfigError(f"train.fp8={t.fp8!r} needs a GPU with float8 matrix units (compute capability 8.9+, "
                               f"e.g. L4, H100); this one is {torch.cuda.get_device_capability()}: set train.fp8 off")
    stored = base_model.fetch(t.base_model, cfg.storage, STORE_MODELS, config_only=True)  # a model artifact URI
    base_config = base_model_config(str(stored) if stored else t.base_model)
    try:
        register_attention(settings.attention_backend)
        hf_config = prepare_hf_config(base_config, settings.attention_backend, t.seq_len)
        check_attention_window(settings.attention_backend, hf_config.sliding_window)
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
    if not manifest.file_paths(data_prefix(Split.TRAIN)):
        raise TrainConfigError(f"--input {input_uri}: artifact has no data/train/*.parquet files")
    info = TrainReadyInfo.of(manifest)
    try:
        dpo_train.check_artifact(info, t, input_uri)
    except dpo_train.ObjectiveMismatch as e:
        raise TrainConfigError(str(e)) from None
    if info is not None:
        art_seq = info.seq_len
        check_tokenizer(info.tokenizer, base_config, t.base_model)
    else:  # manifests committed before the typed hand-off
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
    try:
        ds_config = engine_spec(t, dp, settings).ds_config
    except OptimizerConfigError as e:
        raise TrainConfigError(str(e)) from None
    device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if on_gpu else None
    recompute, every, memory = plan_recompute(t, hf_config, dp, settings, device_bytes)
    return Plan(cfg, input_uri, run_uri, run_id, world_size, t.pipeline_stages, dp, hf_config, base_config,
                ds_config, staging, settings, info.tokenizer if info else None, recompute, every, memory, manifest)


def plan_recompute(t, hf_config, dp: int, settings: Settings, device_bytes: int | None):
    """``train.recompute`` resolved and the fullest stage's memory checked against the device before
    any weight loads (training/memory.py); CPU runs (``device_bytes`` None): auto is none, no check."""
    shape = ModelShape.from_hf_config(hf_config)
    ts = TrainShape(seq_len=t.seq_len, micro_batch=t.micro_batch_size, stages=t.pipeline_stages, dp=dp,
                    micro_batches=t.gradient_accumulation_steps, bf16=settings.bf16,
                    grad_accum_fp32=t.grad_accum_dtype == "fp32",
                    fused_grad_accumulation=t.fused_grad_accumulation, fused_loss=settings.fast_kernels == "liger",
                    sliding_window=hf_config.sliding_window)
    mode, every = t.recompute, t.recompute_every
    if mode == "auto" and (device_bytes is None or t.activation_checkpoint_interval):
        mode = "none"  # CPU, or DeepSpeed's own interval checkpointing chosen by hand
    if device_bytes is None or t.activation_checkpoint_interval:
        return mode, every, None  # no estimate for DeepSpeed's checkpointing: not checked
    if mode == "auto":
        chosen = choose_recompute(shape, ts, device_bytes)
        if chosen is None:
            worst = max(estimate_stages(shape, ts, "full"), key=lambda m: m.total)
            raise TrainConfigError(_does_not_fit(worst, device_bytes, "train.recompute=auto found no mode that fits",
                                                 tokens_that_fit(shape, ts, device_bytes)))
        mode, every, worst = chosen
        log.info("train.recompute=auto -> %s%s (%s)", mode, f" (every {every})" if mode == "every_n" else "",
                 worst.describe())
        return mode, every, worst
    worst = max(estimate_stages(shape, ts, mode, every), key=lambda m: m.total)
    if not fits(worst, device_bytes):
        raise TrainConfigError(_does_not_fit(worst, device_bytes, f"train.recompute={mode}",
                                             tokens_that_fit(shape, ts, device_bytes)))
    return mode, every, worst


def _does_not_fit(worst: StageMemory, device_bytes: int, what: str, longest: int) -> str:
    return (f"estimated GPU memory does not fit: {what}: {worst.describe()} > "
            f"{USABLE_FRACTION:.0%} of {device_bytes / GIB:.0f} GiB. Lower train.micro_batch_size or train.seq_len "
            f"(with full recomputation this stage fits train.seq_len up to ~{longest} at this micro-batch size), set "
            "train.recompute to full (or auto), or raise train.pipeline_stages to spread the layers")


# ----------------------------------------------------------------------------- helpers
@torch.no_grad()
def logits_vs_hf(engine, probe: dict[str, torch.Tensor] | None, model_dir: Path, dtype: torch.dtype) -> float | None:
    """Max |pipeline logits - transformers logits| on the probe batch (on the last stage; None elsewhere)."""
    batch = None
    if probe is not None:
        batch = ((probe["input_ids"], probe["position_ids"]), probe["targets"])
    if engine.is_last_stage():
        engine.module.loss_fn.begin(1, 1, 1)  # the loss value is not used here
    _, logits = engine.eval_batch(iter([batch]), return_logits=True, num_micro_batches=1)
    if not engine.is_last_stage():
        return None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").eval()
    # use_cache=False: transformers only derives the packed-document mask from position_ids without a cache
    ref = hf(input_ids=probe["input_ids"].cpu(), position_ids=probe["position_ids"].cpu(), use_cache=False).logits
    del hf
    return float((logits.float().cpu() - ref.float()).abs().max())


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
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
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


# ----------------------------------------------------------------------------- the trainer
@dataclass(frozen=True)
class Role:
    """This rank's place in the job: who fetches, who holds data, who logs."""

    rank: int
    local_rank: int
    world_size: int
    stage: int
    first: bool  # holds the embedding: needs input_ids
    last: bool  # holds the head: needs labels, computes the loss
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def has_data(self) -> bool:
        return self.first or self.last


@dataclass
class BadSteps:
    """Non-finite steps: each one is skipped by the optimizer; ``limit`` in a row stop the run."""

    limit: int
    total: int = 0
    in_a_row: int = 0

    def record(self, step: int, bad: bool) -> None:
        if not bad:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        log.warning("step %d: non-finite loss or gradients, update skipped (%d in a row)", step, self.in_a_row)
        if self.in_a_row >= self.limit:
            raise TrainingDiverged(
                f"{self.in_a_row} non-finite steps in a row (last: step {step}) reached train.max_bad_steps="
                f"{self.limit}: lower train.learning_rate, check the data, or resume from an earlier checkpoint")


@dataclass
class RunState:
    """What the phases hand each other."""

    t0: float
    start_step: int = 0
    position: int = 0
    restored: Any = None  # ckpt.Restored
    summary: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    def __init__(self, plan: Plan, lease: RunLease | None = None):
        self.plan = plan
        self.lease = lease  # rank 0's hold on runs/<run_id>/: every store write of the run checks it
        self.ckpt_key: bytes | None = None  # checkpoint signing key (rank 0)
        self.cfg = plan.cfg
        self.t = plan.cfg.train
        self.storage = plan.cfg.storage
        self.settings = plan.settings
        self.dtype = torch.bfloat16 if plan.settings.bf16 else torch.float32
        self.dpo = self.t.objective == "dpo"
        self.reference: dict[str, np.ndarray] = {}  # objective dpo: per split, [rows, 2] reference log-probs
        self.reference_summary: dict[str, Any] = {}
        # Everything a run holds, declared here: setup() builds the engine side (and the uploader,
        # the parity probe); resume() loads the checkpoint and opens the metrics log it restores.
        self.io_group: Any = None
        self.model_dir: Path | None = None
        self.engine: Any = None
        self.optimizer: Any = None
        self.loss: TokenMeanLoss | None = None
        self.fast_paths: FastPaths | None = None
        self.ckpt_writer: Any = None
        self.role: Role | None = None
        self.val_files: list[Path] = []
        self.uploader: ckpt.CheckpointUploader | None = None  # rank 0
        self.probe: dict[str, torch.Tensor] | None = None  # train.verify_parity: a fixed micro-batch
        self.report_dir = plan.staging / "report" / "data"
        self.metrics: MetricsLog | None = None  # rank 0, opened by resume() from the restored CSVs
        self.tracker: Tracker | None = None

    def run(self) -> int:
        import torch.distributed as dist

        state = RunState(t0=time.time())
        self.setup(state)
        self.resume(state)
        self.fit(state)
        final = self.evaluate(self.t.steps)
        state.summary.update({k: v for k, v in final.items() if k != "step"})
        self.export_and_publish(state)
        dist.barrier()
        dist.destroy_process_group()
        return 0

    # ---------------------------------------------------------------- setup
    def setup(self, state: RunState) -> None:
        import deepspeed
        import torch.distributed as dist

        plan, t = self.plan, self.t
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.settings.on_gpu:
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        # Long transfers wait on this CPU group, whose timeout is sized to them; the NCCL group
        # keeps its short timeout for compute collectives.
        self.io_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=t.io_timeout_s))
        plan.staging = agreed_staging(plan.staging, self.io_group)
        log.info("settings: precision=%s attention_backend=%s fast_kernels=%s grad_accum_dtype=%s device=%s "
                 "compile_layers=%s sync_free_attention=%s pin_memory=%s async_checkpoint=%s "
                 "fused_wgrad_accumulation=%s fp8=%s recompute=%s%s",
                 self.settings.precision, self.settings.attention_backend, self.settings.fast_kernels,
                 t.grad_accum_dtype if self.settings.bf16 else "fp32", device, t.compile_layers,
                 t.sync_free_attention, t.pin_memory, t.async_checkpoint, self.settings.fused_wgrad, t.fp8, plan.recompute,
                 f" (every {plan.recompute_every})" if plan.recompute == "every_n" else "")
        torch.manual_seed(t.seed)
        np.random.seed(t.seed)
        random.seed(t.seed)
        self.model_dir = self._fetch_inputs(dist.get_rank(), local_rank)

        pipe = build_pipeline_module(
            plan.hf_config, num_stages=plan.stages, partition_method=t.partition_method,
            attention_backend=self.settings.attention_backend,
            activation_checkpoint_interval=t.activation_checkpoint_interval, device=device,
            sync_free_attention=t.sync_free_attention, causal_rows_sdpa=t.causal_rows_sdpa,
            recompute=plan.recompute, recompute_every=plan.recompute_every,
            loss_fn=dpo_train.make_loss(t) if self.dpo else None,
        )
        self.loss: TokenMeanLoss = pipe.loss_fn
        built = build_engine(pipe, plan.ds_config, device, plan.converters(),
                             load_weights=self._load_weights, async_checkpoint=t.async_checkpoint)
        engine, self.engine, self.optimizer = built.engine, built.engine, built.optimizer
        self.fast_paths, self.ckpt_writer = built.fast_paths, built.ckpt_writer
        self.role = Role(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(),
                         stage=engine.stage_id, first=engine.is_first_stage(), last=engine.is_last_stage(),
                         dp_rank=engine.grid.get_data_parallel_rank(),
                         dp_size=engine.grid.get_data_parallel_world_size(), device=device)
        self.val_files = split_files(plan.staging / "input", Split.VAL)
        self.probe = self._probe() if t.verify_parity else None
        if self.role.is_rank0:
            self.uploader = ckpt.CheckpointUploader(
                plan.run_uri, self.storage,
                ckpt.PushPolicy(t.keep_last, t.max_failed_pushes, t.max_pending_pushes, t.push_backoff_s),
                config=self.cfg.model_dump(mode="json"), inputs=[plan.input_uri], key=self.ckpt_key, lease=self.lease)
        state.summary.update(run=plan.run_uri, input=plan.input_uri, precision=self.settings.precision,
                             attention_backend=self.settings.attention_backend,
                             fast_kernels=self.settings.fast_kernels,
                             grad_accum_dtype=t.grad_accum_dtype if self.settings.bf16 else "fp32",
                             fp8=t.fp8, recompute=plan.recompute, recompute_every=plan.recompute_every,
                             estimated_stage_gib=round(plan.memory.total / GIB, 2) if plan.memory else None,
                             **dataclasses.asdict(self.fast_paths),
                             optimizer_wrapper=type(engine.optimizer).__name__)

    def _load_weights(self, pipe) -> None:
        from training.weights import load_stage_weights

        n = load_stage_weights(pipe_layers(pipe), self.model_dir)
        log.info("stage %d: loaded %d base tensors from %s", pipe.stage_id, n, self.model_dir)

    def _fetch_inputs(self, rank: int, local_rank: int) -> Path:
        """Rank 0 fetches the dataset while each node's local rank 0 fetches the base weights, in
        parallel, then everyone meets on the side group (no NCCL collective is pending)."""
        from training.tiny import ensure_tiny_model
        from training.weights import resolve_model_dir

        plan, base = self.plan, self.t.base_model

        def get_model() -> Path:
            if base == "tiny":
                return ensure_tiny_model(TINY_CACHE)
            return base_model.fetch(base, self.storage, STORE_MODELS) or resolve_model_dir(base)

        def get_data() -> None:
            # rank 0 holds the lease: earlier attempts are dead; push what they saved, drop the rest
            run_staging = plan.staging.parent.parent
            self.ckpt_key = ckpt.hmac_key(self.cfg.pipeline.staging_uri)
            ckpt.prepare_attempt(run_staging, plan.staging, plan.run_uri, self.storage, key=self.ckpt_key,
                                 keep_last=self.t.keep_last, lease=self.lease)
            plan.staging.mkdir(parents=True, exist_ok=True)
            (run_staging / "input").mkdir(parents=True, exist_ok=True)
            if not (plan.staging / "input").is_symlink():  # the verified input is shared by the run's attempts
                (plan.staging / "input").symlink_to(run_staging / "input", target_is_directory=True)
            fetch_artifact(plan.input_uri, plan.staging / "input", self.storage, prefix="data/")

        model_dir = None
        with ThreadPoolExecutor(2) as pool:
            data = pool.submit(get_data) if rank == 0 else None
            model = pool.submit(get_model) if local_rank == 0 else None
            if data is not None:
                data.result()
            if model is not None:
                model_dir = model.result()
        import torch.distributed as dist

        dist.barrier(group=self.io_group)
        return model_dir if model_dir is not None else get_model()  # cached by now: no transfer

    # ---------------------------------------------------------------- resume
    def resume(self, state: RunState) -> None:
        """The one place checkpoints are read (all ``ckpt.*`` resume calls live here)."""
        plan, role, engine = self.plan, self.role, self.engine
        restored = None
        if role.is_rank0:
            contract = ckpt.resume_contract(self.cfg.model_dump(mode="json"), plan.input_uri, self.storage,
                                            self.t.resume_across_changes)
            restored = ckpt.fetch_newest_valid(plan.run_uri, self.storage, plan.staging / "resume", contract=contract,
                                               key=self.ckpt_key, lease=self.lease)
            ckpt.discard_after(plan.run_uri, self.storage, restored.step if restored else 0,
                               restored.uri if restored else None, lease=self.lease)
        restored = broadcast(restored, group=self.io_group)  # the download may take long: side group
        if restored is not None:
            _, client = engine.load_checkpoint(str(restored.local_dir), tag=ckpt.TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
            if client is None:
                raise RuntimeError(f"DeepSpeed could not load checkpoint {restored.uri}")
            state.start_step, state.position = int(client["step"]), int(client["data_position"])
            ckpt.load_rng(restored.local_dir / ckpt.TAG, role.rank)
            log.info("resumed from %s: step %d, data position %d", restored.uri, state.start_step, state.position)
        state.restored = restored
        state.summary["resumed_from_step"] = state.start_step

        if role.is_rank0:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            csv_path = self.report_dir / "metrics.csv"
            csv_path.unlink(missing_ok=True)
            for name in ("metrics.csv", "eval.csv"):
                saved = restored.local_dir / ckpt.TAG / name if restored is not None else None
                if saved is not None and saved.exists():
                    shutil.copy(saved, self.report_dir / name)
            self.tracker = Tracker.create(self.cfg.tracking, plan.run_id)
            if self.tracker is not None:  # a resume logs into the same MLflow run (found by run id)
                self.tracker.log_config(self.cfg)
                self.tracker.set_tags({"mft.run_uri": plan.run_uri, "data.train_ready.uri": plan.input_uri})
                if plan.input_manifest is not None:
                    self.tracker.log_manifest("train_ready", plan.input_manifest)
            self.metrics = MetricsLog(csv_path, self.report_dir / "tensorboard", self.tracker)
            self.metrics.truncate(state.start_step)

    # ---------------------------------------------------------------- fit
    def train_batches(self, position: int) -> StepBatches:
        t, role = self.t, self.role
        source = None
        if role.has_data:
            shards = ShardSet(split_files(self.plan.staging / "input", Split.TRAIN), t.seq_len,
                              columns_for(role.first, role.last))
            source = self._batches_cls(Split.TRAIN)(
                shards, micro_batch=t.micro_batch_size, dp_rank=role.dp_rank, dp_size=role.dp_size,
                seed=t.seed, position=position, need_inputs=role.first, need_labels=role.last,
                device=role.device, pin_memory=t.pin_memory)
        return StepBatches(source, self.loss if role.last else None, micro_batches=t.gradient_accumulation_steps,
                           dp_size=role.dp_size, dp_group=self.engine.grid.get_data_parallel_group(),
                           device=role.device)

    def _batches_cls(self, split: str):
        """MicroBatches, or for objective dpo pair batches carrying the split's reference log-probs."""
        if not self.dpo:
            return MicroBatches
        from training.dpo_data import PairMicroBatches

        return functools.partial(PairMicroBatches, reference=self.reference.get(split))

    def fit(self, state: RunState) -> None:
        plan, t, role, engine = self.plan, self.t, self.role, self.engine
        if self.dpo:  # before the first update: the reference model is the engine's weights now
            splits = {s: ShardSet(f, t.seq_len, COLUMNS) for s in SPLITS
                      if role.has_data and (f := split_files(plan.staging / "input", s))}
            self.reference = dpo_train.ensure_reference(self, splits, resumed=state.restored is not None)
            state.summary.update(self.reference_summary)
        if t.verify_parity and state.restored is None:
            diff = gather_value(logits_vs_hf(engine, self.probe, self.model_dir, self.dtype))
            state.summary["parity_base_max_abs_diff"] = diff
            log.info("parity vs transformers (base model): max |diff| = %.3g", diff)
            self._check_parity(diff, "base model")

        batches = self.train_batches(state.position)
        tokens_per_step = t.micro_batch_size * t.gradient_accumulation_steps * plan.dp * t.seq_len
        fpt = flops_per_token(ModelShape.from_hf_config(plan.hf_config), t.seq_len)
        peak = peak_tflops(t.peak_tflops) if role.device.type == "cuda" else None
        bad = BadSteps(t.max_bad_steps)
        if role.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        train_t0 = time.time()
        for step in range(state.start_step + 1, t.steps + 1):
            t_step = time.time()
            loss = float(engine.train_batch(data_iter=batches.next_step()))
            dt = time.time() - t_step
            grad_norm = engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
            skipped = self._step_was_skipped(loss, grad_norm)
            bad.record(step, skipped)
            targets = gather_value(self.loss.targets if role.last and role.dp_rank == 0 else None)
            dpo = self._dpo_metrics("")
            if self.metrics is not None:
                done, left = step - state.start_step, t.steps - step
                tps = tokens_per_step / dt
                self.metrics.add({
                    "step": step, "loss": loss, "lr": engine.get_lr()[0], "grad_norm": grad_norm,
                    "tokens_per_s": tps, "step_time_s": dt, "target_tokens": targets, "skipped": int(skipped),
                    "mfu": None if peak is None else fpt * tps / (peak * 1e12 * plan.world_size), **dpo,
                }, eta_s=(time.time() - train_t0) / done * left)
            if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                state.evals.append(self.evaluate(step))
            if step % t.checkpoint_every == 0 or step == t.steps:
                self.save_checkpoint(step, step * t.gradient_accumulation_steps)
        if self.ckpt_writer is not None:
            self.ckpt_writer.flush()  # this rank's checkpoint files are on disk before eval/export
        state.summary.update(train_time_s=time.time() - train_t0, steps_run=t.steps - state.start_step,
                             skipped_steps=bad.total, tokens_per_step=tokens_per_step,
                             flops_per_token=fpt)
        if role.device.type == "cuda":
            peaks = gather_all(torch.cuda.max_memory_allocated() / 2**30)
            state.summary["peak_memory_gib"] = max(peaks)

    def _step_was_skipped(self, loss: float, grad_norm: float | None) -> bool:
        """Non-finite steps are skipped by the optimizer (ours, or DeepSpeed's BF16 optimizer on an
        invalid global norm); the loss is the same on every rank, the norm is global."""
        inner = getattr(self.engine.optimizer, "overflow", False) or self.optimizer.last_skipped
        return bool(inner) or not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))

    # ---------------------------------------------------------------- evaluate
    def evaluate(self, step: int) -> dict[str, Any]:
        """Token-weighted loss and perplexity over a shuffled sample of the whole val split (every
        file), the same sample at every evaluation so values compare across steps."""
        t, role = self.t, self.role
        if not self.val_files or t.eval_batches == 0:
            log.warning("no validation split or train.eval_batches=0: skipping evaluation")
            return {"eval_loss": None, "eval_perplexity": None}
        source, n_batches = None, t.eval_batches
        if role.has_data:
            shards = ShardSet(self.val_files, t.seq_len, columns_for(role.first, role.last))
            source = self._batches_cls(Split.VAL)(
                shards, micro_batch=t.micro_batch_size, dp_rank=role.dp_rank, dp_size=role.dp_size,
                seed=t.seed, shuffle=True, need_inputs=role.first, need_labels=role.last, device=role.device)
            n_batches = min(n_batches, source.per_epoch)
        n_batches = min(v for v in gather_all(n_batches) if v is not None)
        batches = StepBatches(source, self.loss if role.last else None, micro_batches=n_batches,
                              dp_size=role.dp_size, dp_group=self.engine.grid.get_data_parallel_group(),
                              device=role.device)
        loss = float(self.engine.eval_batch(batches.next_step(), num_micro_batches=n_batches))
        targets = gather_value(self.loss.targets if role.last and role.dp_rank == 0 else None)
        dpo = self._dpo_metrics("eval_")
        ppl = None if self.dpo else math.exp(min(loss, 50.0))
        log.info("validation at step %d: loss %.4f perplexity %s (%d micro-batches per replica, %s targets)%s",
                 step, loss, ppl, n_batches, targets, f" {dpo}" if dpo else "")
        row = {"step": step, "eval_loss": loss, "eval_perplexity": ppl, "eval_micro_batches": n_batches,
               "eval_target_tokens": targets, **dpo}
        if self.metrics is not None:
            self.metrics.add_eval(row)
        return row

    def _dpo_metrics(self, prefix: str) -> dict[str, Any]:
        """objective dpo: reward accuracy, rewards and margin of the pairs since the last call, on every rank."""
        if not self.dpo:
            return {}
        m = dpo_train.step_metrics(self.loss, self.role, self.engine)
        m = gather_value(m if self.role.last and self.role.dp_rank == 0 else None)
        return m.as_row(prefix)

    # ---------------------------------------------------------------- export / publish
    def export_and_publish(self, state: RunState) -> None:
        plan, t, role = self.plan, self.t, self.role
        summary = state.summary
        export_dir = self._export()
        summary.update(self._check_render(export_dir / "data"))
        if t.verify_parity:
            diff = gather_value(logits_vs_hf(self.engine, self.probe, export_dir / "data", self.dtype))
            summary["parity_export_max_abs_diff"] = diff
            log.info("parity vs transformers (exported model): max |diff| = %.3g", diff)
            self._check_parity(diff, "exported model")
        if not role.is_rank0:
            return
        self.uploader.close()  # every checkpoint is in the store before the run is declared done
        rows = self.metrics.rows
        summary.update(best_eval(self.metrics.eval_rows, plan.run_uri, t.checkpoint_every, t.steps))
        self.metrics.close()
        summary.update(
            steps=t.steps, checkpoints_pushed=self.uploader.pushed, world_size=plan.world_size,
            pipeline_stages=plan.stages, data_parallel=plan.dp, wall_time_s=time.time() - state.t0,
            final_train_loss=rows[-1]["loss"] if rows else None,
            mean_step_time_s=float(np.mean([r["step_time_s"] for r in rows[1:]] or [math.nan])),
        )
        write_report(self.report_dir, rows, summary)
        (self.report_dir / "ds_config.json").write_text(json.dumps(plan.ds_config, indent=2, sort_keys=True))
        cfg_json = self.cfg.model_dump(mode="json")
        self.lease.check()  # a trainer that lost its run's lease publishes nothing
        publish_artifact(export_dir, layout.model_uri(plan.run_uri), kind="model", config=cfg_json,
                         inputs=[plan.input_uri], counts={}, extra={"format": "huggingface", "step": t.steps},
                         storage=self.storage)
        publish_artifact(self.report_dir.parent, layout.report_uri(plan.run_uri), kind="report", config=cfg_json,
                         inputs=[plan.input_uri], extra=RunReportInfo(**{k: summary.get(k) for k in (
                             "eval_loss", "eval_perplexity", "final_train_loss", *dpo_train.REPORT_KEYS * self.dpo)}).to_extra(),
                         storage=self.storage)
        if self.tracker is not None:  # bounded wait: a slow or dead server drops what is left, never fails
            self.tracker.finish()
            self.tracker.close()
        log.info("run complete: %s", json.dumps({k: summary.get(k) for k in
                 ("final_train_loss", "eval_loss", "eval_perplexity", "mean_step_time_s", "skipped_steps")}))

    # ---------------------------------------------------------------- pieces
    def _probe(self) -> dict[str, torch.Tensor] | None:
        """A fixed validation micro-batch with every column (for the parity check)."""
        if not self.role.has_data:
            return None
        files = self.val_files or split_files(self.plan.staging / "input", Split.TRAIN)
        it = MicroBatches(ShardSet(files, self.t.seq_len, COLUMNS), micro_batch=self.t.micro_batch_size,
                          dp_rank=0, dp_size=1, seed=0, shuffle=False, device=self.role.device)
        (ids, pos), targets = next(it)
        return {"input_ids": ids, "position_ids": pos, "targets": targets}

    def _check_render(self, model_dir: Path) -> dict[str, int]:
        """Rank 0 renders the input's render sample with the exported tokenizer (training.render_check);
        a mismatch fails every rank before anything is published."""
        from training.render_check import RenderMismatch

        result: tuple[str, Any] = ("ok", {})
        if self.role.is_rank0:
            from pipeline_core.render_sample import read_sample
            from training.render_check import check_rendering

            try:
                check = check_rendering(model_dir, read_sample(self.plan.staging / "input"))
                result = ("ok", check.as_summary())
                if check.documents:
                    log.info("render check: the exported tokenizer reproduces %d training documents and %d "
                             "generation prompts token for token", check.documents, check.generation_prompts)
                else:
                    log.warning("render check skipped: the input artifact has no render sample (filtered before "
                                "data/render_sample existed); the exported tokenizer is not checked against it")
            except RenderMismatch as e:
                result = ("mismatch", str(e))
        status, value = broadcast(result)
        if status != "ok":
            raise RenderMismatch(value)
        return value

    def _check_parity(self, diff: float, what: str) -> None:
        if diff > self.t.parity_tolerance:
            raise RuntimeError(f"pipeline logits differ from transformers' ({what}) by {diff:.3g} > "
                               f"train.parity_tolerance={self.t.parity_tolerance}")

    def save_checkpoint(self, step: int, position: int) -> None:
        """The one place checkpoints are written (the ``ckpt`` upload seam)."""
        import torch.distributed as dist

        local = self.plan.staging / "checkpoints" / f"step-{step}"
        writer = self.ckpt_writer
        if writer is not None:
            writer.flush()  # one checkpoint in host memory at a time (normally written long ago)
        self.engine.save_checkpoint(str(local), tag=ckpt.TAG, save_latest=False,
                                    client_state={"step": step, "data_position": position})
        if writer is not None:  # async: the RNG file, this rank's completion marker, goes last
            writer.after(functools.partial(ckpt.save_rng, local / ckpt.TAG, self.role.rank, ckpt.rng_state()))
        else:
            ckpt.save_rng(local / ckpt.TAG, self.role.rank)
        if self.metrics is not None:
            shutil.copy(self.metrics.csv_path, local / ckpt.TAG / "metrics.csv")
            if self.metrics.eval_path.exists():
                shutil.copy(self.metrics.eval_path, local / ckpt.TAG / "eval.csv")
        if writer is not None:
            if self.uploader is not None:  # the upload thread waits for every rank's files, then pushes
                self.uploader.submit(step, local, {"data_position": position},
                                     ready=functools.partial(self._checkpoint_written, local))
            return
        dist.barrier()  # every rank's files are on disk before the push starts
        if self.uploader is not None:
            ckpt.check_all_ranks(local, self.plan.world_size)
            self.uploader.submit(step, local, {"data_position": position})  # raises once pushing failed for good

    def _checkpoint_written(self, local: Path) -> None:
        """On the upload thread: this rank's writer is done and every rank's marker is there."""
        self.ckpt_writer.flush()
        ckpt.wait_for_all_ranks(local, self.plan.world_size, timeout_s=self.t.io_timeout_s)

    def _export(self) -> Path:
        """Every stage's dp-rank-0 writes its shard; rank 0 adds index/config/tokenizer."""
        import torch.distributed as dist

        from training.weights import finish_export, save_stage_shard

        out = self.plan.staging / "export"
        data = out / "data"
        part = None
        if self.role.dp_rank == 0:
            part = save_stage_shard(pipe_layers(self.engine.module), data, self.role.stage, self.plan.stages,
                                    self.dtype)
        parts = gather_all(part)
        if self.role.is_rank0:
            finish_export(data, [p for p in parts if p], self.model_dir, self.plan.base_config, self.dtype,
                          tokenizer=self.plan.tokenizer)
        dist.barrier()
        return out


def best_eval(rows: list[dict[str, Any]], run_uri: str, checkpoint_every: int, last_step: int) -> dict[str, Any]:
    """The lowest validation loss and, when a checkpoint was saved at that step, its URI."""
    rows = [r for r in rows if r.get("eval_loss") is not None]
    if not rows:
        return {}
    best = min(rows, key=lambda r: r["eval_loss"])
    step = int(best["step"])
    saved = step % checkpoint_every == 0 or step == last_step
    return {"best_eval_loss": best["eval_loss"], "best_eval_step": step,
            "best_checkpoint": layout.checkpoint_uri(run_uri, step) if saved else None}


if __name__ == "__main__":
    sys.exit(main())
