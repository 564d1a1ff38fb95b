"""Long contexts (issue 29), CPU: the sliding window on the pipeline layers vs transformers'
MistralForCausalLM (fp32, <= 1e-5), the recompute modes (same loss and gradients as none), and the
memory estimate / auto rule that runs before weights load."""

from __future__ import annotations

import pytest
import torch

from tests.training_helpers import causal_lm_loss, load_model_config, make_tiny_model
from training.flops import ModelShape
from training.memory import GIB, TrainShape, choose_recompute, estimate_stages, layer_elements
from training.model import layer_recompute, layer_specs, prepare_hf_config, shift_targets
from training.weights import load_stage_weights

WINDOW = 64


def _tiny(tmp_path_factory, window):
    # same seed, same weights: the two models differ only in the window
    return make_tiny_model(tmp_path_factory.mktemp(f"window{window}"), max_shard_size=None, sliding_window=window,
                           max_position_embeddings=8192, num_hidden_layers=2)


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    return _tiny(tmp_path_factory, WINDOW)


@pytest.fixture(scope="module")
def unwindowed_dir(tmp_path_factory):
    return _tiny(tmp_path_factory, None)


def build_layers(model_dir, seq_len, backend="sdpa", recompute="none", every=1, train=False):
    cfg = prepare_hf_config(load_model_config(model_dir), backend, seq_len)
    layers = [spec.build() for spec in layer_specs(cfg, backend, recompute=recompute, recompute_every=every)]
    load_stage_weights(layers, model_dir)
    for m in layers:
        m.train(train)
    return cfg, layers


def run(layers, ids, pos):
    x = (ids, pos)
    for layer in layers:
        x = layer(x)
    return x


def hf_logits(model_dir, ids, pos):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids, position_ids=pos, use_cache=False).logits


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("windowed", [True, False])
def test_sliding_window_logits_match_transformers(windowed_dir, unwindowed_dir, backend, windowed):
    """seq 256 > window 64: the pipeline keeps the window (and has none when the model has none),
    on one whole row and on a packed row whose first document is longer than the window."""
    seq = 256
    model_dir = windowed_dir if windowed else unwindowed_dir
    cfg, layers = build_layers(model_dir, seq, backend)
    assert cfg.sliding_window == (WINDOW if windowed else None)
    ids = torch.randint(3, 32000, (1, seq), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(seq)[None]
    with torch.no_grad():
        whole = run(layers, ids, pos)
    ref = hf_logits(model_dir, ids, pos)
    assert (whole - ref).abs().max().item() <= 1e-5
    packed_pos = torch.cat([torch.arange(200), torch.arange(56)])[None]
    with torch.no_grad():
        packed = run(layers, ids, packed_pos)
    for start, n in ((0, 200), (200, 56)):
        alone = hf_logits(model_dir, ids[:, start:start + n], torch.arange(n)[None])
        assert (packed[:, start:start + n] - alone).abs().max().item() <= 1e-5
    # the window matters here: the other model's logits differ
    other = hf_logits(unwindowed_dir if windowed else windowed_dir, ids, pos)
    assert (whole - other).abs().max().item() > 1e-3


def test_sliding_window_at_8192(windowed_dir):
    """The issue's length: seq 8192 with the 64-token window, dense path vs transformers."""
    seq = 8192
    _, layers = build_layers(windowed_dir, seq)
    ids = torch.randint(3, 32000, (1, seq), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(seq)[None]
    with torch.no_grad():
        ours = run(layers, ids, pos)
    assert (ours - hf_logits(windowed_dir, ids, pos)).abs().max().item() <= 1e-5


def test_window_is_dropped_only_when_it_covers_the_sequence(windowed_dir):
    cfg = load_model_config(windowed_dir)
    assert prepare_hf_config(cfg, "sdpa", WINDOW).sliding_window is None
    assert prepare_hf_config(cfg, "sdpa", WINDOW + 1).sliding_window == WINDOW


def test_varlen_without_window_support_is_refused(monkeypatch):
    from training import fast_kernels
    from training.kernels import check_attention_window

    check_attention_window("torch_varlen", None)  # no window kept: nothing to check
    monkeypatch.setattr(fast_kernels, "_VARLEN_API", (None, frozenset({"is_causal", "scale"})))
    with pytest.raises(ValueError, match="sliding_window=4096 .*train.seq_len <= sliding_window"):
        check_attention_window("torch_varlen", 4096)
    monkeypatch.setattr(fast_kernels, "_VARLEN_API", (None, frozenset({"window_size", "scale"})))
    check_attention_window("torch_varlen", 4096)


@pytest.mark.parametrize("mode,every", [("full", 1), ("attention", 1), ("mlp", 1), ("every_n", 2)])
def test_recompute_modes_give_the_same_gradients(windowed_dir, mode, every):
    seq = 96
    ids = torch.randint(3, 32000, (2, seq), generator=torch.Generator().manual_seed(7))
    pos = torch.cat([torch.arange(70), torch.arange(26)]).expand(2, -1)
    targets = shift_targets(ids, pos)

    def grads(recompute, every):
        _, layers = build_layers(windowed_dir, seq, recompute=recompute, every=every, train=True)
        loss = causal_lm_loss(run(layers, ids, pos), targets)
        loss.backward()
        named = {f"{i}.{n}": p.grad for i, m in enumerate(layers) for n, p in m.named_parameters()}
        return loss.detach(), named, layers

    ref_loss, ref, _ = grads("none", 1)
    loss, got, layers = grads(mode, every)
    decoders = [m for m in layers if hasattr(m, "recompute")]
    assert [m.recompute for m in decoders] == [layer_recompute(mode, i, every) for i in range(len(decoders))]
    assert any(m.recompute != "none" for m in decoders)
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.allclose(got[name], g, atol=1e-6, rtol=1e-5), name


def test_recompute_saves_activations(windowed_dir):
    """What each mode keeps for backward, counted by the autograd saved-tensor hooks: fewer bytes
    than none, in the order the memory estimate assumes (full < mlp < attention < none)."""
    seq = 128
    ids = torch.randint(3, 32000, (1, seq), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(seq)[None]

    def saved_bytes(mode):
        _, layers = build_layers(windowed_dir, seq, recompute=mode, train=True)
        x = layers[0]((ids, pos))
        seen, total = set(), 0

        def pack(t):
            nonlocal total
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for layer in layers[1:-2]:
                x = layer(x)
        return total

    sizes = {m: saved_bytes(m) for m in ("none", "attention", "mlp", "full")}
    assert sizes["full"] < sizes["mlp"] < sizes["attention"] < sizes["none"], sizes


def test_auto_rule_and_the_fit_check():
    """Mistral-7B's 16-layer slice on a 141 GB H200: none at 8k and 16k, some recomputation at 32k;
    the trainer refuses (naming fields) what does not fit with any mode."""
    from transformers import MistralConfig

    from training.runtime import Settings
    from training.train import TrainConfigError, plan_recompute

    cfg = MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, sliding_window=None)
    shape = ModelShape.from_hf_config(cfg)
    h200 = 143771 * 2**20

    def ts(seq, stages=1, mb=1):
        return TrainShape(seq_len=seq, micro_batch=mb, stages=stages, dp=1, micro_batches=8)

    assert choose_recompute(shape, ts(8192), h200)[0] == "none"
    assert choose_recompute(shape, ts(16384), h200)[0] == "none"
    assert choose_recompute(shape, ts(32768), h200)[0] != "none"
    assert choose_recompute(shape, ts(131072, mb=4), h200) is None
    # every mode's estimate is ordered by what it keeps
    st = {m: estimate_stages(shape, ts(16384), m)[0].activations for m in ("none", "attention", "mlp", "full")}
    assert st["full"] < st["mlp"] < st["attention"] < st["none"]
    assert layer_elements(shape, "full") == 4096
    # 2 stages: stage 0 holds two micro-batches in flight, so it is the fuller one
    two = estimate_stages(shape, ts(16384, stages=2), "none")
    assert two[0].activations == pytest.approx(2 * two[1].activations, rel=1e-9)

    from pipeline_core.config import load_config

    t = load_config(overrides={"train.seq_len": 131072, "train.micro_batch_size": 4,
                               "train.gradient_accumulation_steps": 8, "train.pipeline_stages": 1}).train
    settings = Settings("bf16", "torch_varlen", "liger", True)
    with pytest.raises(TrainConfigError, match="train.micro_batch_size or train.seq_len.*train.pipeline_stages"):
        plan_recompute(t, cfg, 1, settings, h200)
    t.seq_len, t.micro_batch_size = 16384, 1
    assert plan_recompute(t, cfg, 1, settings, h200)[0] == "none"
    t.recompute = "none"
    t.seq_len = 65536
    with pytest.raises(TrainConfigError, match="train.recompute=none"):
        plan_recompute(t, cfg, 1, settings, h200)
    assert plan_recompute(t, cfg, 1, settings, None)[0] == "none"  # CPU: no check
    assert GIB == 1 << 30


def test_recompute_and_interval_are_not_combined():
    from pipeline_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="activation_checkpoint_interval"):
        load_config(overrides={"train.recompute": "mlp", "train.activation_checkpoint_interval": 1})


@pytest.mark.parametrize("mode", ["full", "mlp", "attention"])
def test_recompute_with_fused_wgrad_accumulation(windowed_dir, mode):
    """train.fused_wgrad_accumulation under recomputation: the weight gradients still land in the
    bound fp32 ``main_grad`` buffers, equal to the unrecomputed run's (seen failing on an H200 with
    'Tensor' object has no attribute 'main_grad' before the fix)."""
    from training.model import DecoderLayerPipe
    from training.wgrad_fusion import use_main_grad_linears

    seq = 64
    ids = torch.randint(3, 32000, (1, seq), generator=torch.Generator().manual_seed(9))
    pos = torch.arange(seq)[None]
    targets = shift_targets(ids, pos)

    def main_grads(recompute):
        _, layers = build_layers(windowed_dir, seq, recompute=recompute, train=True)
        holder = torch.nn.ModuleList(layers)
        weights = use_main_grad_linears(holder, DecoderLayerPipe)
        for w in weights:
            w.main_grad = torch.zeros_like(w)
        causal_lm_loss(run(layers, ids, pos), targets).backward()
        assert all(w.grad is None for w in weights)
        return [w.main_grad for w in weights]

    for got, want in zip(main_grads(mode), main_grads("none"), strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
