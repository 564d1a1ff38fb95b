"""What the ``auto`` settings become on this machine, decided once before anything is built and
logged at start (precision, attention backend, fast kernels)."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Settings:
    precision: str  # bf16 | fp32
    attention_backend: str
    fast_kernels: str
    on_gpu: bool
    fused_wgrad: bool = False  # train.fused_wgrad_accumulation in effect (needs fp32 buffers, eager layers)

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU has bf16 instructions; without them bf16 matmuls are emulated (~8x slower)."""
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in _CPU_BF16_FLAGS)


def gpu_has_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_settings(train, on_gpu: bool) -> Settings:
    """``train`` is the TrainSection; explicit values are kept, ``auto`` is resolved here."""
    precision = train.precision
    if precision == "auto":
        precision = "bf16" if (gpu_has_bf16() if on_gpu else cpu_has_bf16()) else "fp32"
    attention = train.attention_backend
    if attention == "auto":
        attention = "torch_varlen" if on_gpu else "sdpa"
    kernels = train.fast_kernels
    if kernels == "auto":
        # the fused loss never materialises logits, which the parity check compares
        usable = on_gpu and not train.verify_parity and importlib.util.find_spec("liger_kernel") is not None
        kernels = "liger" if usable else "none"
    # the wgrad GEMM accumulates into the BF16 optimizer's fp32 buffers, from a custom backward that
    # compiled layers do not run
    fused_wgrad = (train.fused_wgrad_accumulation and precision == "bf16" and train.grad_accum_dtype == "fp32"
                   and not train.compile_layers)
    return Settings(precision, attention, kernels, on_gpu, fused_wgrad)
