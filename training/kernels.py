"""The registry of optional fast paths: config names -> what attaches them. train.py and the
benchmark go through here, so the model (training/model.py) and the kernels
(training/fast_kernels.py) never import each other."""

from __future__ import annotations

from torch import nn

FAST_KERNELS = ("none", "liger")


def register_attention(backend: str) -> None:
    """Register a custom attention backend with transformers before any forward uses it."""
    if backend == "torch_varlen":
        from training.fast_kernels import register_torch_varlen_attention

        register_torch_varlen_attention()


def apply_fast_kernels(name: str, module: nn.Module, loss=None) -> dict[str, int]:
    """Swap the named kernel set into a built pipeline module (``loss``: its TokenMeanLoss, or
    None to keep materialised logits, e.g. for the parity check)."""
    if name not in FAST_KERNELS:
        raise ValueError(f"train.fast_kernels: unknown {name!r}, expected one of {list(FAST_KERNELS)}")
    if name == "none":
        return {}
    from training.fast_kernels import apply_liger
    from training.model import DecoderLayerPipe, LMHeadPipe

    return apply_liger(module, decoder_cls=DecoderLayerPipe, head_cls=LMHeadPipe, loss=loss)
