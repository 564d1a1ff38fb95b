"""The one trainer-engine builder: a built pipeline module in, a DeepSpeed engine out.

The performance levers are model converters (torchtitan's ``ModelConverter`` pattern), chosen by
config in one ordered list (``model_converters``): each rewrites the module before the weights load
and the optimizer is built, and may finish its work on the engine's optimizer afterwards
(``post_optimizer``). ``build_engine`` is the only place DeepSpeed's engine is initialised: the
trainer, DPO, the benchmarks and the test probes all use it, so what the tests check is what runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline_core.config import TrainSection
from training.runtime import Settings

log = logging.getLogger(__name__)


@dataclass
class FastPaths:
    """The performance levers actually in effect (the summary records them)."""

    fp8_linears: int = 0  # linear layers converted to float8 (train.fp8)
    wgrad_fused_weights: int = 0  # weights whose wgrad GEMM accumulates into the fp32 buffer


class ModelConverter:
    """One lever: ``convert`` rewrites the module; ``post_optimizer`` runs on the engine's optimizer."""

    name = "converter"

    def convert(self, pipe, paths: FastPaths) -> None:
        pass

    def post_optimizer(self, optimizer, paths: FastPaths) -> None:
        pass


@dataclass
class FastKernels(ModelConverter):
    """``train.fast_kernels`` (liger): fused norms/activations and the fused cross-entropy loss."""

    kernels: str
    in_layers: bool
    name = "fast_kernels"

    def convert(self, pipe, paths):
        from training.kernels import apply_fast_kernels

        swapped = apply_fast_kernels(self.kernels, pipe, loss=pipe.loss_fn, in_layers=self.in_layers)
        if swapped:
            log.info("stage %d: fast kernels %s: %s", pipe.stage_id, self.kernels, swapped)


class DPOHiddenStates(ModelConverter):
    """objective dpo: the head returns hidden states to the loss, no logits (the fused-loss seam)."""

    name = "dpo_hidden_states"

    def convert(self, pipe, paths):
        from training import dpo_train

        dpo_train.use_hidden_states(pipe)


@dataclass
class Float8(ModelConverter):
    """``train.fp8``; before compiling: the compiled graph fuses the float8 casts."""

    recipe: str
    name = "fp8"

    def convert(self, pipe, paths):
        from training.kernels import convert_fp8

        paths.fp8_linears = convert_fp8(self.recipe, pipe)
        log.info("stage %d: %d linear layers in float8 (%s scaling)", pipe.stage_id, paths.fp8_linears, self.recipe)


class CompileLayers(ModelConverter):
    """``train.compile_layers``: regional compilation of the decoder layers."""

    name = "compile_layers"

    def convert(self, pipe, paths):
        from training.kernels import compile_decoder_layers

        log.info("stage %d: %d decoder layers compiled (one shared graph)", pipe.stage_id, compile_decoder_layers(pipe))


@dataclass
class FusedHPGradAccumulation(ModelConverter):
    """``train.fused_grad_accumulation`` (bf16, fp32 accumulation): one mixed-dtype add per parameter."""

    name = "fused_hp_grad_accumulation"

    def post_optimizer(self, optimizer, paths):
        from training.optim import fuse_hp_grad_accumulation

        fused = fuse_hp_grad_accumulation(optimizer)
        log.info("fp32 gradient accumulation: immediate, %s", "one mixed-dtype add per parameter" if fused
                 else "DeepSpeed's own add (its BF16 optimizer is not the one the fused add was written for)")


@dataclass
class WgradFusion(ModelConverter):
    """``train.fused_wgrad_accumulation``: the weight-gradient GEMM accumulates into the fp32 buffer."""

    name = "wgrad_fusion"
    weights: list = field(default_factory=list)

    def convert(self, pipe, paths):
        from training.kernels import main_grad_linears

        self.weights = main_grad_linears(pipe)

    def post_optimizer(self, optimizer, paths):
        from training.optim import bind_main_grads

        bound = paths.wgrad_fused_weights = bind_main_grads(optimizer, self.weights)
        log.info("weight-gradient GEMMs accumulate into the fp32 buffer: %d of %d linear weights%s", bound,
                 len(self.weights), "" if bound else " (not DeepSpeed's BF16 optimizer: plain linear layers)")


def model_converters(t: TrainSection, settings: Settings) -> list[ModelConverter]:
    """The levers ``t`` asks for, in the order they must be applied."""
    out: list[ModelConverter] = []
    if settings.fast_kernels != "none":  # apply_fast_kernels validates the name
        out.append(FastKernels(settings.fast_kernels, in_layers=not t.compile_layers))
    if t.objective == "dpo":
        out.append(DPOHiddenStates())
    if t.fp8 != "off":
        out.append(Float8(t.fp8))
    if t.compile_layers:
        out.append(CompileLayers())
    if t.fused_grad_accumulation and settings.bf16 and t.grad_accum_dtype == "fp32":
        out.append(FusedHPGradAccumulation())
    if settings.fused_wgrad:
        out.append(WgradFusion())
    return out


@dataclass
class EngineSpec:
    """What an engine is built from for one config: the DeepSpeed config and the converter list."""

    ds_config: dict[str, Any]
    converters: list[ModelConverter]


def engine_spec(t: TrainSection, dp: int, settings: Settings) -> EngineSpec:
    """The one derivation of both from ``train`` (train.py's plan and the test probes use it)."""
    from training.optim import build_ds_config

    return EngineSpec(build_ds_config(t, dp, settings), model_converters(t, settings))


@dataclass
class BuiltEngine:
    engine: Any  # deepspeed PipelineEngine
    optimizer: Any  # the client optimizer (SkipNonFiniteAdamW unless one was passed)
    converters: list[ModelConverter]
    fast_paths: FastPaths
    ds_config: dict[str, Any]  # the DeepSpeed config the engine was initialised with
    ckpt_writer: Any = None  # async_save.SnapshotCheckpointEngine when train.async_checkpoint


def build_engine(module, ds_config: dict[str, Any], device: torch.device, converters: list[ModelConverter], *,
                 load_weights: Callable[[Any], Any] | None = None, optimizer=None,
                 async_checkpoint: bool = False) -> BuiltEngine:
    """Convert ``module`` (a PipelineModule; the benchmark's ZeRO-2 peer passes its HF model, no
    converters), load its weights, build the optimizer from ``ds_config`` (unless given one),
    initialise DeepSpeed (the client optimizer replaces the config's), finish the converters."""
    import deepspeed

    from training.optim import build_optimizer

    paths = FastPaths()
    for c in converters:
        c.convert(module, paths)
    if load_weights is not None:
        load_weights(module)
    if optimizer is None:
        optimizer = build_optimizer(module, ds_config, device)
    ds = {k: v for k, v in ds_config.items() if k != "optimizer"}  # the client optimizer is used
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds)
    writer = None
    if async_checkpoint:  # saves snapshot to host memory; files are written in the background
        from training.async_save import SnapshotCheckpointEngine, checkpoint_nbytes

        writer = SnapshotCheckpointEngine(engine._config, pin_memory=device.type == "cuda")
        engine.checkpoint_engine = writer
        # page-lock the snapshot's host memory now, in the background, not in the first save's stall
        writer.reserve(checkpoint_nbytes(engine.module, engine.optimizer))
    for c in converters:
        c.post_optimizer(engine.optimizer, paths)
    return BuiltEngine(engine, optimizer, converters, paths, ds, writer)
