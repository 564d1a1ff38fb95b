"""Regional compilation of the decoder layers (training/kernels.py ``compile_decoder_layers``): a
dimension that changes between micro-batches (on packed rows, ``cu_seqlens``' length, one value per
document count) becomes symbolic on the first recompile instead of compiling one graph per value,
which hit dynamo's recompile limit within a few micro-batches on an H200 and left the layers eager
(bench/RESULTS.md, fourth run). On CPU no attention input changes shape, so the test changes the
sequence length (the same mechanism); dynamo's ``eager`` backend keeps it fast."""

from __future__ import annotations

import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from transformers import MistralConfig

from training.kernels import compile_decoder_layers
from training.model import DecoderLayerPipe, PackedAttentionContext


def test_a_changing_dimension_turns_symbolic_instead_of_one_graph_per_value():
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    ctx = PackedAttentionContext(cfg, "sdpa")
    layers = nn.ModuleList([DecoderLayerPipe(cfg, i, ctx) for i in range(2)])
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(layers, backend="eager") == 2
    graphs = []
    for n in (8, 12, 16, 20, 24, 28):  # six "document counts"
        x = torch.randn(1, n, 32)
        pos = torch.arange(n)[None]
        emb = ctx.rope(x, pos)
        for layer in layers:
            x = layer.block(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
        graphs.append(counters["stats"]["unique_graphs"])
    # static for the first value, symbolic from the second on, then no more graphs (each value twice:
    # the first layer's input needs no grad, the second's does); dynamic=False: a graph per value, to 8
    assert graphs[1] == graphs[-1], graphs
    assert graphs[-1] <= 4, graphs
