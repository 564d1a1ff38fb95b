"""Training FLOPs per token: the one accounting the trainer's MFU and the benchmark share.

The published convention (Megatron, torchtitan, llm-foundry; PaLM appendix B):

    FLOPs/token = 6 N + 12 L (heads x head_dim) s

with N the non-embedding parameter count (every parameter but the input embedding table, so
the LM head counts) and full S x S attention credit on plain causal rows of length s. Packed
rows whose document mask skips the cross-document blocks get ``document_attention_flops``
instead of the ``12 L h s`` term: the same per-row credit, computed over the documents present
(Σ len_d² / s per token rather than s).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def attention_width(self) -> int:
        return self.num_heads * self.head_dim

    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_parameters(self) -> int:
        """All parameters (embedding and LM head included), as a Mistral model holds them."""
        h = self.hidden_size
        attn = 2 * h * self.attention_width + 2 * h * self.num_kv_heads * self.head_dim  # q,o + k,v
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.embedding_parameters() + self.num_layers * per_layer + h + head

    def non_embedding_parameters(self) -> int:
        """N of the convention: everything but the input embedding (a tied head is the embedding,
        so it is still counted once, as the head's matmul)."""
        if self.tie_embeddings:
            return self.num_parameters()
        return self.num_parameters() - self.embedding_parameters()


# Datasheet dense bf16 peak TFLOP/s per device, by device-name fragment: the MFU denominator (the
# published convention), one table for the trainer's metrics and the benchmarks.
PEAK_BF16_TFLOPS: dict[str, float] = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}
H200_PEAK_FLOPS = PEAK_BF16_TFLOPS["H200"] * 1e12


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """6 N + 12 L (heads x head_dim) s: plain causal rows, full attention credit."""
    return 6.0 * shape.non_embedding_parameters() + 12.0 * shape.num_layers * shape.attention_width * seq_len


def document_attention_flops(shape: ModelShape, doc_lengths: Iterable[int]) -> float:
    """Attention FLOPs of one packed row (all its tokens), counting only each document's own
    len x len block (same full-block credit as the convention; no cross-document work)."""
    return 12.0 * shape.num_layers * shape.attention_width * float(sum(n * n for n in doc_lengths))


def document_flops_per_token(shape: ModelShape, doc_lengths: Iterable[int]) -> float:
    """FLOPs per token of a packed row with a document mask: 6 N + its document attention / s."""
    lengths = list(doc_lengths)
    tokens = sum(lengths)
    if tokens == 0:
        raise ValueError("a row without tokens has no FLOPs per token")
    return 6.0 * shape.non_embedding_parameters() + document_attention_flops(shape, lengths) / tokens


def mfu(tokens_per_s_per_device: float, flops_token: float, peak_flops: float) -> float:
    return tokens_per_s_per_device * flops_token / peak_flops
