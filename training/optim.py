"""Optimizer, schedule and the resolved DeepSpeed config.

The optimizer is torch's AdamW handed to DeepSpeed as a client optimizer (``fused=True`` on a
GPU): no JIT build at start-up (DeepSpeed's FusedAdam build fails on arch lists such as
``9.0a``), and one code path for the benchmark and the user. Weight decay skips norms, biases and
the embedding. A step whose gradients are not all finite is skipped on every rank alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_DS_CONFIG = Path(__file__).with_name("ds_config.json")
_SCHEDULERS = {"linear": "WarmupDecayLR", "cosine": "WarmupCosineLR", "constant": "WarmupLR"}
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


class OptimizerConfigError(ValueError):
    pass


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: matrices decay; norms, biases and embedding tables do not."""
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for p in module.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embeddings else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class SkipNonFiniteAdamW(torch.optim.AdamW):
    """AdamW that leaves the weights alone when any gradient is non-finite. The verdict is
    all-reduced over ``group`` (every rank that steps), so replicas and ZeRO partitions agree."""

    def __init__(self, params, *, device: torch.device, group=None, **kwargs):
        super().__init__(params, **kwargs)
        self.device, self.sync_group = device, group
        self.skipped = 0
        self.last_skipped = False

    def _all_finite(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        bad = torch.zeros(1, device=self.device)
        if grads:  # a ZeRO partition may hold none
            norms = torch._foreach_norm(grads)
            bad = (~torch.isfinite(torch.stack(norms).sum())).float().reshape(1).to(self.device)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.sync_group)
        return bool(bad.item() == 0)

    @torch.no_grad()
    def step(self, closure=None):
        self.last_skipped = not self._all_finite()
        if self.last_skipped:
            self.skipped += 1
            return None
        return super().step(closure)


def build_optimizer(module: nn.Module, ds_config: dict[str, Any], device: torch.device,
                    group=None) -> SkipNonFiniteAdamW:
    params = ds_config["optimizer"]["params"]
    kwargs = {k: params[k] for k in _ADAMW_KEYS if k in params}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return SkipNonFiniteAdamW(decay_groups(module, kwargs.pop("weight_decay", 0.0)), device=device, group=group,
                              fused=True if device.type == "cuda" else None, **kwargs)


def schedule(t, from_file: dict[str, Any] | None) -> dict[str, Any]:
    """``train.lr_schedule`` picks the scheduler (else the file's, else linear decay); warm-up,
    peak LR and total steps always come from ``train``."""
    name = _SCHEDULERS[t.lr_schedule] if t.lr_schedule else (from_file or {}).get("type", "WarmupDecayLR")
    if name not in _SCHEDULERS.values():
        raise OptimizerConfigError(f"train.ds_config: scheduler.type={name!r}; expected one of "
                                   f"{sorted(_SCHEDULERS.values())} (or set train.lr_schedule)")
    params = dict((from_file or {}).get("params", {})) if not t.lr_schedule else {}
    params["warmup_num_steps"] = t.warmup_steps
    params.setdefault("warmup_type", "linear")
    total = max(t.steps, t.warmup_steps + 1)
    if name == "WarmupCosineLR":
        params.update(total_num_steps=total)
        params.setdefault("warmup_min_ratio", 0.0)
        params.setdefault("cos_min_ratio", 0.0)
        return {"type": name, "params": params}
    params.setdefault("warmup_min_lr", 0.0)
    params["warmup_max_lr"] = t.learning_rate
    if name == "WarmupDecayLR":
        params["total_num_steps"] = total
    return {"type": name, "params": params}


def build_ds_config(train, dp: int, settings) -> dict[str, Any]:
    """The DeepSpeed config the engine gets: the file (``train.ds_config`` or the bundled one) with
    the batch shape, precision, accumulation dtype, learning rate and schedule from ``train``.
    The ``optimizer`` section holds AdamW's hyper-parameters for ``build_optimizer``; the engine
    is given the client optimizer, so DeepSpeed never builds its own."""
    from pipeline_core import uris

    t = train
    path = uris.to_local_path(t.ds_config) if t.ds_config else DEFAULT_DS_CONFIG
    if not path.is_file():
        raise OptimizerConfigError(f"train.ds_config: {path} does not exist")
    ds = json.loads(path.read_text())
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    if zero > 1:
        raise OptimizerConfigError(
            f"train.ds_config: zero_optimization.stage={zero}; pipeline parallelism supports 0 or 1")
    opt = ds.get("optimizer") or {"type": "AdamW", "params": {}}
    if str(opt.get("type", "AdamW")).lower() not in ("adam", "adamw"):
        raise OptimizerConfigError(f"train.ds_config: optimizer.type={opt.get('type')!r}; the trainer runs AdamW")
    ds["optimizer"] = {"type": "AdamW", "params": {**opt.get("params", {}), "lr": t.learning_rate}}
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.gradient_accumulation_steps
    ds["train_batch_size"] = t.micro_batch_size * t.gradient_accumulation_steps * dp
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": settings.bf16}
    ds.pop("fp16", None)
    data_types = ds.setdefault("data_types", {})
    if settings.bf16:
        data_types["grad_accum_dtype"] = t.grad_accum_dtype
        if t.grad_accum_dtype == "fp32":  # accumulate into fp32 as backward goes (see fuse_hp_grad_accumulation)
            ds["bf16"]["immediate_grad_update"] = t.fused_grad_accumulation
        if t.grad_accum_dtype == "fp32" and zero != 1:
            raise OptimizerConfigError(
                "train.grad_accum_dtype=fp32 with bf16 needs zero_optimization.stage=1 in train.ds_config "
                f"(DeepSpeed's pipeline BF16 optimizer); it is {zero}. Set stage 1 or train.grad_accum_dtype=bf16")
    else:
        data_types.pop("grad_accum_dtype", None)
    ds["scheduler"] = schedule(t, ds.get("scheduler"))
    # ZeRO vets optimizers by exact type; SkipNonFiniteAdamW is torch's AdamW plus a guard
    ds["zero_allow_untested_optimizer"] = True
    ds.setdefault("pipeline", {})["activation_checkpoint_interval"] = t.activation_checkpoint_interval
    ds["steps_per_print"] = ds.get("steps_per_print", 10**9)
    return ds


def fuse_hp_grad_accumulation(bf16_optimizer) -> bool:
    """DeepSpeed's BF16 optimizer adds a bf16 gradient into its fp32 buffer as
    ``hp.add_(lp.grad.to(fp32))``: an fp32 temporary and two kernels per parameter and
    micro-batch. ``hp.add_(lp.grad)`` is one kernel that converts as it reads (10 bytes per
    parameter moved instead of 18). Replaces that one method on this instance; returns False (and
    changes nothing) where the optimizer is not the one this was written against (DeepSpeed
    0.19: ``_update_hp_grad``, ``fp32_groups_gradients``) or uses expert-parallel folding."""
    needed = ("_update_hp_grad", "fp32_groups_gradients", "fp32_groups_has_gradients")
    if not all(hasattr(bf16_optimizer, a) for a in needed) or getattr(bf16_optimizer, "autoep_folding_tp_group", None):
        return False
    opt = bf16_optimizer

    @torch.no_grad()
    def _update_hp_grad(lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None:
            return
        hp = opt.fp32_groups_gradients[group_idx][param_idx]
        hp.add_(lp.grad.view(hp.shape))
        lp._hp_grad = hp
        opt.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    opt._update_hp_grad = _update_hp_grad
    return True


def bind_main_grads(bf16_optimizer, weights) -> int:
    """Point each of ``weights`` (``wgrad_fusion.MainGradLinear`` weights) at its slot of DeepSpeed's
    BF16 optimizer's fp32 gradient buffer (``weight.main_grad``), so the weight-gradient GEMM
    accumulates there. Those weights never get a ``.grad``, so the optimizer's per-parameter
    "has a gradient" flags, which pick what the global norm, clipping and the step read, are kept
    set for them (also after each step's ``clear_hp_grads``); a slot that got nothing in a step holds
    zeros. Returns how many were bound; 0 (nothing changed) where the optimizer is not the one this
    was written against (DeepSpeed 0.19: ``bf16_groups``, ``fp32_groups_gradients``,
    ``fp32_groups_has_gradients``, ``clear_hp_grads``)."""
    needed = ("bf16_groups", "fp32_groups_gradients", "fp32_groups_has_gradients", "clear_hp_grads")
    if not all(hasattr(bf16_optimizer, a) for a in needed) or getattr(bf16_optimizer, "autoep_folding_tp_group", None):
        return 0
    opt, wanted = bf16_optimizer, {id(w) for w in weights}
    slots = [(i, j) for i, group in enumerate(opt.bf16_groups) for j, lp in enumerate(group) if id(lp) in wanted]
    for i, j in slots:
        lp, hp = opt.bf16_groups[i][j], opt.fp32_groups_gradients[i][j]
        lp.main_grad = hp.view(lp.shape)
        lp._hp_grad = hp  # what DeepSpeed's own accumulation hook would have set
    clear = opt.clear_hp_grads

    def mark() -> None:
        for i, j in slots:
            opt.fp32_groups_has_gradients[i][j] = True

    def clear_hp_grads() -> None:
        clear()
        mark()

    opt.clear_hp_grads = clear_hp_grads
    mark()
    return len(slots)
