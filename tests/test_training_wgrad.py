"""The weight-gradient GEMM that accumulates into an fp32 buffer (training/wgrad_fusion.py) and the
FP8 linear layers (training/fp8.py), on CPU. The DeepSpeed step with the fusion is compared with
the unfused one in tests/test_training_loss.py (test_fused_wgrad_accumulation_equals_the_unfused_step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline_core.config import load_config
from training.fp8 import convert_linears_to_fp8
from training.runtime import resolve_settings
from training.wgrad_fusion import MainGradLinear, use_main_grad_linears


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 48, bias=False)
        self.down = nn.Linear(48, 32, bias=True)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _fused_and_plain(seed: int = 0):
    torch.manual_seed(seed)
    plain = nn.Sequential(Block(), nn.Linear(32, 16, bias=False)).to(torch.bfloat16)
    fused = nn.Sequential(Block(), nn.Linear(32, 16, bias=False)).to(torch.bfloat16)
    fused.load_state_dict(plain.state_dict())
    return fused, plain


def test_swap_is_in_place_and_only_inside_the_given_blocks():
    fused, plain = _fused_and_plain()
    before = {n: p for n, p in fused.named_parameters()}
    weights = use_main_grad_linears(fused, Block)
    assert [type(m) for m in fused[0].children()] == [MainGradLinear, MainGradLinear]
    assert type(fused[1]) is nn.Linear  # outside every Block: untouched
    assert dict(fused.named_parameters()) == before  # same Parameter objects, same names
    assert [id(w) for w in weights] == [id(fused[0].up.weight), id(fused[0].down.weight)]


def test_main_grad_linear_accumulates_the_exact_fp32_sum_over_micro_batches():
    """Three micro-batches: main_grad = sum_i dy_i^T x_i in fp32 (no bf16 rounding in between), no
    ``.grad`` for the weight; input and bias gradients are those of nn.Linear."""
    torch.manual_seed(1)
    ref = nn.Linear(32, 48, bias=True).to(torch.bfloat16)
    lin = nn.Linear(32, 48, bias=True).to(torch.bfloat16)
    lin.load_state_dict(ref.state_dict())
    lin.__class__ = MainGradLinear
    lin.weight.main_grad = torch.full((48, 32), 0.25)  # accumulates onto what is there (beta = 1)
    expected = torch.full((48, 32), 0.25, dtype=torch.float64)
    bias_sum = torch.zeros(48)
    for _ in range(3):
        x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
        dy = torch.randn(2, 5, 48, dtype=torch.bfloat16)
        x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref.zero_grad()
        ref(x_ref).backward(dy)
        lin(x_fused).backward(dy)
        assert torch.equal(x_fused.grad, x_ref.grad)
        expected += dy.double().reshape(-1, 48).t() @ x.double().reshape(-1, 32)
        bias_sum += ref.bias.grad.float()
    assert lin.weight.grad is None
    torch.testing.assert_close(lin.weight.main_grad.double(), expected, rtol=1e-6, atol=1e-5)
    # the bias gradient is autograd's as usual (accumulated by it in bf16 over the three)
    torch.testing.assert_close(lin.bias.grad.float(), bias_sum, rtol=2e-2, atol=2e-2)


def test_unbound_or_without_grad_it_is_a_plain_linear():
    fused, plain = _fused_and_plain(2)
    use_main_grad_linears(fused, Block)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    fused(x).float().sum().backward()
    plain(x).float().sum().backward()
    for (n, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n
    fused[0].up.weight.main_grad = torch.zeros(48, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)  # eval: no custom function


@pytest.mark.parametrize(("overrides", "fused"), [
    ({}, True),  # the default under bf16 + fp32 accumulation
    ({"train.compile_layers": True}, False),  # compiled layers do not run the custom backward
    ({"train.grad_accum_dtype": "bf16"}, False),  # no fp32 buffers to accumulate into
    ({"train.precision": "fp32"}, False),
    ({"train.fused_wgrad_accumulation": False}, False),
])
def test_fused_wgrad_is_in_effect_only_where_it_can_be(overrides, fused):
    cfg = load_config(overrides={"train.precision": "bf16", **overrides})
    assert resolve_settings(cfg.train, on_gpu=False).fused_wgrad is fused


def test_an_unknown_fp8_recipe_is_refused_at_load():
    with pytest.raises(Exception, match="fp8"):
        load_config(overrides={"train.fp8": "blockwise"})


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_converts_the_decoder_linears_and_keeps_names(recipe):
    """torchao's Float8Linear in every decoder layer (q, k, v, o, gate, up, down), names and
    parameter objects unchanged (weight loading and export rely on them), the head left in bf16;
    one forward/backward stays close to bf16's (float8 casts on CPU are emulated, same numerics)."""
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(3)
    ref = MistralForCausalLM(cfg).to(torch.bfloat16)
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    params = dict(model.named_parameters())
    assert convert_linears_to_fp8(model, MistralDecoderLayer, recipe) == 7 * 2
    assert dict(model.named_parameters()).keys() == params.keys()
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Float8Linear"
    assert type(model.lm_head) is nn.Linear
    ids = torch.randint(0, 256, (2, 32))
    losses = []
    for m in (ref, model):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    g_ref, g = ref.model.layers[0].mlp.up_proj.weight.grad.float(), model.model.layers[0].mlp.up_proj.weight.grad.float()
    assert float((g - g_ref).norm() / g_ref.norm()) < 0.25  # float8 gradients: ~10% per element here
    with pytest.raises(ValueError, match="train.fp8"):
        convert_linears_to_fp8(model, MistralDecoderLayer, "blockwise")
