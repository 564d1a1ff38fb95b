"""Mistral as a DeepSpeed ``PipelineModule``.

Layer list: ``EmbeddingPipe`` -> ``DecoderLayerPipe`` x N -> ``FinalNormPipe`` -> ``LMHeadPipe``.
Every pipe layer subclasses/holds the transformers Mistral module, so its parameters carry the
Hugging Face names (``hf_prefix`` + local name) and its numerics are transformers' own.

Between stages only tensors travel: ``(hidden_states, position_ids)``. Each stage derives what
attention needs from ``position_ids`` (a packed document starts where ``position_id == 0``):
rotary cos/sin and the block-diagonal causal mask, computed once per micro-batch per stage
(``PackedAttentionContext``), in the form the selected backend wants:

- ``sdpa``         exact dense boolean mask; the CPU / reference path.
- ``flex``         ``torch.nn.attention.flex_attention`` BlockMask with document masking (GPU fast path).
- ``flash_varlen`` flash-attn varlen via ``cu_seqlens`` (needs the ``flash_attn`` package, GPU only).

Layer classes are deliberately small so fused kernels (RMSNorm/SwiGLU/RoPE, fused linear+CE,
per-layer ``torch.compile``) can be swapped in by subclassing or patching one class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)

from pipeline_core.handoffs import IGNORE_INDEX

# config value -> transformers attention implementation name
ATTENTION_BACKENDS: dict[str, str] = {
    "sdpa": "sdpa",
    "flex": "flex_attention",
    "flash_varlen": "flash_attention_2",
    # PyTorch's built-in FlashAttention-2 varlen kernel (no flash_attn package), see fast_kernels.py
    "torch_varlen": "mft_torch_varlen",
}


# ----------------------------------------------------------------------------- packing helpers
def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, S]: True where a packed document starts (position 0, and the row start)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Int [B, S]: index of the packed document each token belongs to (per row)."""
    return torch.cumsum(document_starts(position_ids).to(torch.int32), dim=-1)


def dense_document_mask(position_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Bool [B, 1, S, S], True = may attend: causal, same document, inside the sliding window."""
    seq = position_ids.shape[-1]
    doc = document_ids(position_ids)
    idx = torch.arange(seq, device=position_ids.device)
    allowed = (idx[:, None] >= idx[None, :])[None] & (doc[:, :, None] == doc[:, None, :])
    if sliding_window is not None and sliding_window < seq:
        allowed &= (idx[:, None] - idx[None, :] < sliding_window)[None]
    return allowed[:, None]


def flex_document_mask(position_ids: torch.Tensor, sliding_window: int | None = None):
    """flex-attention BlockMask equivalent to ``dense_document_mask`` (sparse, no S x S tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = position_ids.shape
    doc = document_ids(position_ids)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])
        if sliding_window is not None and sliding_window < seq:
            keep = keep & (q_idx - kv_idx < sliding_window)
        return keep

    return create_block_mask(mask_mod, batch, None, seq, seq, device=position_ids.device)


def varlen_kwargs(position_ids: torch.Tensor, exact_max_len: bool = True) -> dict:
    """cu_seqlens over the flattened batch (every row start is also a document start).
    ``exact_max_len=False`` bounds max_seqlen by the row length (no document is longer) instead
    of reading the longest document back from the GPU: one host sync less per micro-batch; the
    kernel only sizes its grid by it (tiles past a document's end exit at once)."""
    flat_starts = document_starts(position_ids).reshape(-1)
    total = flat_starts.numel()
    starts = torch.nonzero(flat_starts).flatten()  # still one sync: the document count sizes cu
    cu = torch.cat([starts, torch.tensor([total], device=starts.device)]).to(torch.int32)
    if exact_max_len:
        max_len = int((cu[1:] - cu[:-1]).max().item())
    else:
        max_len = int(position_ids.shape[-1])
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def shift_targets(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Targets aligned with logits: target[t] = labels[t+1], except across a document boundary
    (the last token of a document must not learn to predict the next document's first token)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    boundary = document_starts(position_ids)[:, 1:]
    targets[:, :-1][boundary] = IGNORE_INDEX
    return targets


def causal_lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over targets != -100 (already shifted, see ``shift_targets``): the
    per-micro-batch part of the token-mean step loss (training/loss.py)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1).long(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )



# ----------------------------------------------------------------------------- attention context
@dataclass
class _Cached:
    position_ids: torch.Tensor
    version: int
    dtype: torch.dtype
    value: tuple


class PackedAttentionContext:
    """Per-stage helper shared by all decoder layers of a stage (passed to every LayerSpec).

    Computes (attention mask, rotary cos/sin, extra attention kwargs) from position_ids once per
    micro-batch: a one-entry cache keyed on the identity of the position_ids tensor, which all
    layers of a stage receive unchanged. Holding a strong reference means the key cannot be
    recycled by another tensor. Not an nn.Module: the rotary inv_freq must stay fp32 when the
    engine casts the model to bf16.
    """

    def __init__(self, config: MistralConfig, backend: str, sync_free: bool = False, causal_rows_sdpa: bool = False):
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"train.attention_backend: unknown {backend!r}, expected one of {sorted(ATTENTION_BACKENDS)}")
        self.backend = backend
        self.sync_free = sync_free  # train.sync_free_attention
        self.causal_rows_sdpa = causal_rows_sdpa and backend == "torch_varlen"  # train.causal_rows_sdpa
        self.sliding_window = getattr(config, "sliding_window", None)
        with torch.device("cpu"):
            self.rope = MistralRotaryEmbedding(config=config)
        self._cache: _Cached | None = None

    def _build_mask(self, position_ids: torch.Tensor):
        if self.backend == "sdpa":
            return dense_document_mask(position_ids, self.sliding_window), {}
        if self.backend == "flex":
            return flex_document_mask(position_ids, self.sliding_window), {}
        extra = varlen_kwargs(position_ids, exact_max_len=not self.sync_free)
        if self.causal_rows_sdpa and extra["cu_seq_lens_q"].numel() - 1 == position_ids.shape[0]:
            extra["whole_rows"] = True  # one document per row: plain causal attention (torch_varlen's SDPA path)
        return None, extra

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        c = self._cache
        if (
            c is not None
            and c.position_ids is position_ids
            and c.version == position_ids._version
            and c.dtype == hidden.dtype
        ):
            return c.value
        if self.rope.inv_freq.device != hidden.device:
            self.rope.to(hidden.device)
        cos_sin = self.rope(hidden, position_ids)
        mask, extra = self._build_mask(position_ids)
        value = (mask, cos_sin, extra)
        self._cache = _Cached(position_ids, position_ids._version, hidden.dtype, value)
        return value


# ----------------------------------------------------------------------------- pipe layers
class EmbeddingPipe(nn.Module):
    """(input_ids, position_ids) -> (hidden_states, position_ids)."""

    hf_prefix = "model."

    def __init__(self, config: MistralConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, inputs):
        input_ids, position_ids = inputs
        return self.embed_tokens(input_ids), position_ids


# train.recompute: what a decoder layer recomputes in backward instead of keeping for it
RECOMPUTE_MODES = ("none", "full", "attention", "mlp", "every_n")
LAYER_RECOMPUTE = ("none", "full", "attention", "mlp")  # per layer (every_n: full on every n-th, else none)


def layer_recompute(mode: str, layer_idx: int, every: int = 1) -> str:
    """The per-layer mode of ``train.recompute``: ``every_n`` checkpoints layers 0, n, 2n, ... whole."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute: unknown {mode!r}, expected one of {list(RECOMPUTE_MODES)}")
    if mode == "every_n":
        return "full" if layer_idx % every == 0 else "none"
    return mode


def _recomputed(fn, *args, **kwargs):
    # non-reentrant: kwargs and non-tensor arguments pass through, and torch.compile traces it
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _attention_part(layer, hidden_states, **kwargs):
    """input RMSNorm + self-attention (projections, RoPE, attention core, output projection)."""
    out, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
    return out


def _mlp_part(layer, hidden_states):
    """post-attention RMSNorm + SwiGLU MLP."""
    return layer.mlp(layer.post_attention_layernorm(hidden_states))


def decoder_block(layer, hidden_states, **kwargs):
    """One decoder layer's computation (transformers' MistralDecoderLayer.forward, same order of
    operations) with the layer's recomputation: ``full`` keeps only the layer input for backward,
    ``attention`` / ``mlp`` keep only the input of that half (its activations are recomputed)."""
    mode = layer.recompute if torch.is_grad_enabled() else "none"
    if mode == "none":
        return MistralDecoderLayer.forward(layer, hidden_states, **kwargs)
    if mode == "full":
        return _recomputed(MistralDecoderLayer.forward, layer, hidden_states, **kwargs)
    attn = _recomputed if mode == "attention" else _call
    mlp = _recomputed if mode == "mlp" else _call
    hidden_states = hidden_states + attn(_attention_part, layer, hidden_states, **kwargs)
    return hidden_states + mlp(_mlp_part, layer, hidden_states)


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


class DecoderLayerPipe(MistralDecoderLayer):
    """transformers' MistralDecoderLayer with a tuple-in/tuple-out pipeline interface."""

    def __init__(self, config: MistralConfig, layer_idx: int, context: PackedAttentionContext,
                 recompute: str = "none"):
        super().__init__(config, layer_idx)
        if recompute not in LAYER_RECOMPUTE:
            raise ValueError(f"layer recompute {recompute!r}: expected one of {LAYER_RECOMPUTE}")
        self.hf_prefix = f"model.layers.{layer_idx}."
        self.attention_context = context  # plain object, not a submodule
        self.recompute = recompute

    def block(self, hidden_states, **kwargs):
        """The layer's computation without the per-micro-batch context lookup: the seam where
        ``kernels.compile_decoder_layers`` puts one compiled function shared by every layer."""
        return decoder_block(self, hidden_states, **kwargs)

    def forward(self, inputs):
        hidden_states, position_ids = inputs
        mask, position_embeddings, extra = self.attention_context(hidden_states, position_ids)
        hidden_states = self.block(
            hidden_states,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            **extra,
        )
        return hidden_states, position_ids


class FinalNormPipe(MistralRMSNorm):
    """(hidden_states, position_ids) -> normed hidden_states (position_ids are not needed past here)."""

    hf_prefix = "model.norm."

    def __init__(self, config: MistralConfig):
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs):
        hidden_states, _position_ids = inputs
        return super().forward(hidden_states)


class LMHeadPipe(nn.Module):
    """hidden_states -> logits [B, S, vocab]."""

    hf_prefix = ""

    def __init__(self, config: MistralConfig):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden_states):
        return self.lm_head(hidden_states)


def prepare_hf_config(config: MistralConfig, attention_backend: str, seq_len: int) -> MistralConfig:
    """Copy of the model config set up for pipeline training. Validates what the model can hold."""
    if config.model_type != "mistral":
        raise ValueError(f"train.base_model: expected a Mistral architecture, got model_type={config.model_type!r}")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("train.base_model: tied input/output embeddings are not supported by the pipeline model")
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"train.seq_len={seq_len} exceeds the model's max_position_embeddings={config.max_position_embeddings}"
        )
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"train.attention_backend: unknown {attention_backend!r}, expected one of {sorted(ATTENTION_BACKENDS)}"
        )
    cfg = MistralConfig.from_dict(config.to_dict())
    # A window at least as long as the sequence is a no-op; dropping it keeps flash kernels mask-free.
    if cfg.sliding_window is not None and cfg.sliding_window >= seq_len:
        cfg.sliding_window = None
    # custom backends (torch_varlen) are registered with transformers by training/kernels.py
    cfg._attn_implementation = ATTENTION_BACKENDS[attention_backend]
    cfg.use_cache = False
    return cfg


def layer_specs(config: MistralConfig, attention_backend: str, sync_free_attention: bool = False,
                causal_rows_sdpa: bool = False, recompute: str = "none", recompute_every: int = 1) -> list:
    """LayerSpecs (built lazily, only on the stage that owns them)."""
    from deepspeed.pipe import LayerSpec

    context = PackedAttentionContext(config, attention_backend, sync_free=sync_free_attention,
                                     causal_rows_sdpa=causal_rows_sdpa)
    return [
        LayerSpec(EmbeddingPipe, config),
        *[LayerSpec(DecoderLayerPipe, config, i, context, layer_recompute(recompute, i, recompute_every))
          for i in range(config.num_hidden_layers)],
        LayerSpec(FinalNormPipe, config),
        LayerSpec(LMHeadPipe, config),
    ]


def build_pipeline_module(
    config: MistralConfig,
    *,
    num_stages: int,
    partition_method: str = "type:DecoderLayerPipe",
    attention_backend: str = "sdpa",
    activation_checkpoint_interval: int = 0,
    loss_fn: Callable | None = None,
    device: str | torch.device | None = None,
    sync_free_attention: bool = False,
    causal_rows_sdpa: bool = False,
    recompute: str = "none",
    recompute_every: int = 1,
):
    """The PipelineModule (needs torch.distributed initialised). Parameters are created directly
    on ``device`` so a stage never holds other stages' layers, nor a CPU copy of its own.
    ``loss_fn`` defaults to the token-mean loss; fused kernels are swapped in afterwards by
    ``training.kernels.apply_fast_kernels`` (names unchanged)."""
    from deepspeed.pipe import PipelineModule

    from training.loss import TokenMeanLoss

    if loss_fn is None:
        loss_fn = TokenMeanLoss(causal_lm_loss_sum)
    with torch.device(device or "cpu"):
        module = PipelineModule(
            layers=layer_specs(config, attention_backend, sync_free_attention, causal_rows_sdpa, recompute,
                               recompute_every),
            num_stages=num_stages,
            loss_fn=loss_fn,
            partition_method=partition_method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            # never checkpoint the embedding (its int input has no grad under reentrant checkpointing)
            checkpointable_layers=["DecoderLayerPipe"],
        )
    return module


def hf_named_tensors(modules) -> dict[str, torch.Tensor]:
    """HF-named parameters of the given pipe layers (those with an ``hf_prefix``)."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        prefix = getattr(module, "hf_prefix", None)
        if prefix is None:
            continue
        for name, tensor in module.state_dict().items():
            out[prefix + name] = tensor
    return out


def pipe_layers(module: nn.Module) -> list[nn.Module]:
    """The local pipe layers (anything carrying an ``hf_prefix``) in order."""
    return [m for m in module.modules() if hasattr(m, "hf_prefix")]
