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


def check_attention_window(backend: str, sliding_window: int | None) -> None:
    """Refuse a backend that would silently drop the model's sliding window (``sliding_window`` is
    what ``model.prepare_hf_config`` kept: None when the window covers train.seq_len). sdpa and flex
    build the window into their masks; the varlen kernels take it as a left window size."""
    if sliding_window is None:
        return
    if backend == "torch_varlen":
        from training.fast_kernels import varlen_supports_window

        ok, where = varlen_supports_window(), "this torch's torch.nn.attention.varlen.varlen_attn has no window_size"
    elif backend == "flash_varlen":
        import inspect

        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:
            return  # the backend itself fails with its own message
        ok = "window_size" in inspect.signature(flash_attn_varlen_func).parameters
        where = "the installed flash_attn has no window_size"
    else:
        return
    if not ok:
        raise ValueError(
            f"train.attention_backend={backend!r}: {where}, so the base model's sliding_window={sliding_window} "
            "(< train.seq_len) would be ignored; use attention_backend flex or sdpa, a newer torch/flash_attn, "
            "or train.seq_len <= sliding_window")


def apply_fast_kernels(name: str, module: nn.Module, loss=None, in_layers: bool = True) -> dict[str, int]:
    """Swap the named kernel set into a built pipeline module (``loss``: its TokenMeanLoss, or
    None to keep materialised logits, e.g. for the parity check). ``in_layers=False`` keeps the
    decoder layers as they are (compiled layers: Inductor fuses their norms and activations)."""
    if name not in FAST_KERNELS:
        raise ValueError(f"train.fast_kernels: unknown {name!r}, expected one of {list(FAST_KERNELS)}")
    if name == "none":
        return {}
    from training.fast_kernels import apply_liger
    from training.model import DecoderLayerPipe, LMHeadPipe

    return apply_liger(module, decoder_cls=DecoderLayerPipe if in_layers else None, head_cls=LMHeadPipe, loss=loss)


def compile_decoder_layers(module: nn.Module, backend: str = "inductor") -> int:
    """Regional compilation (torchtitan's per-block ``torch.compile``): every local decoder layer
    runs one compiled function of the layer's computation; layers share the graph (parameters are
    graph inputs), so it compiles once. The context lookup stays eager. Returns the layer count."""
    import functools

    import torch

    from training.model import DecoderLayerPipe, decoder_block

    # dynamic=None: shapes start static; a dimension seen changing (cu_seqlens' length on packed rows,
    # one per document count) becomes symbolic on its first recompile instead of one graph per count,
    # which hits dynamo's recompile limit within a few micro-batches and leaves the rest eager
    # decoder_block: the layer with its train.recompute (a checkpointed region compiles as one
    # higher-order op; layers of two modes, as every_n gives, compile two graphs)
    compiled = torch.compile(decoder_block, dynamic=None, backend=backend)
    layers = [m for m in module.modules() if isinstance(m, DecoderLayerPipe)]
    for layer in layers:
        layer.block = functools.partial(compiled, layer)
    return len(layers)


def convert_fp8(recipe: str, module: nn.Module) -> int:
    """``train.fp8``: the decoder layers' linear layers as torchao Float8Linear (training/fp8.py);
    ``off`` changes nothing. Returns how many were converted."""
    if recipe == "off":
        return 0
    from training.fp8 import convert_linears_to_fp8
    from training.model import DecoderLayerPipe

    return convert_linears_to_fp8(module, DecoderLayerPipe, recipe)


def main_grad_linears(module: nn.Module) -> list:
    """``train.fused_wgrad_accumulation``: the decoder layers' plain linear layers accumulate their
    weight gradient into a bound fp32 buffer (training/wgrad_fusion.py); returns their weights."""
    from training.model import DecoderLayerPipe
    from training.wgrad_fusion import use_main_grad_linears

    return use_main_grad_linears(module, DecoderLayerPipe)
