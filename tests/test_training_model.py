"""In-process checks of the pipeline layers against transformers' MistralForCausalLM (fp32, CPU).

The layers are built from the same LayerSpecs the PipelineModule uses and run in sequence, so
these tests pin the numerics without a process group; the 2-stage torchrun run is in
test_training_e2e.py."""

from __future__ import annotations

import pytest
import torch

from tests.training_helpers import causal_lm_loss, load_model_config, make_tiny_model
from training.model import (
    IGNORE_INDEX,
    dense_document_mask,
    layer_specs,
    prepare_hf_config,
    shift_targets,
)
from training.weights import load_stage_weights


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), attn_implementation="eager", dtype=torch.float32).eval()


def build_stack(tiny_dir, seq_len=64, backend="sdpa"):
    cfg = prepare_hf_config(load_model_config(tiny_dir), backend, seq_len)
    layers = [spec.build() for spec in layer_specs(cfg, backend)]
    assert load_stage_weights(layers, tiny_dir) == 3 + 9 * cfg.num_hidden_layers  # embed, norm, head
    for m in layers:
        m.eval()

    @torch.no_grad()
    def run(input_ids, position_ids):
        x = (input_ids, position_ids)
        for layer in layers:
            x = layer(x)
        return x

    return run


def test_logits_match_hf(tiny_dir, hf_model):
    run = build_stack(tiny_dir)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (2, 48), generator=g)
    pos = torch.arange(48).expand(2, -1)
    ours = run(ids, pos)
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits
    assert (ours - ref).abs().max().item() <= 1e-5


def test_packed_documents_are_independent(tiny_dir, hf_model):
    """Each document of a packed row gets exactly the logits it gets alone, positions restart,
    and changing one document leaves the others' logits untouched."""
    run = build_stack(tiny_dir)
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(3, 32000, (n,), generator=g) for n in (20, 17, 27))
    row = torch.cat([a, b, c])[None]
    pos = torch.cat([torch.arange(20), torch.arange(17), torch.arange(27)])[None]
    packed = run(row, pos)
    with torch.no_grad():
        for start, doc in ((0, a), (20, b), (37, c)):
            alone = hf_model(input_ids=doc[None]).logits[0]
            assert (packed[0, start:start + len(doc)] - alone).abs().max().item() <= 1e-5

    b2 = torch.randint(3, 32000, (17,), generator=g)
    changed = run(torch.cat([a, b2, c])[None], pos)
    assert torch.equal(changed[0, :20], packed[0, :20])
    assert torch.equal(changed[0, 37:], packed[0, 37:])
    assert not torch.equal(changed[0, 20:37], packed[0, 20:37])
    # positions drive rotary: the same row with positions 0..63 is a different computation
    assert not torch.allclose(run(row, torch.arange(64)[None])[0, 37:], packed[0, 37:])


def test_loss_ignores_masked_labels_and_document_boundaries():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11)
    labels = torch.tensor([[IGNORE_INDEX, 4, 5, IGNORE_INDEX, 7, 8]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    targets = shift_targets(labels, pos)
    # t=2 would predict the next document's first token: masked like the prompt token
    assert targets.tolist() == [[4, 5, IGNORE_INDEX, 7, 8, IGNORE_INDEX]]
    loss = causal_lm_loss(logits, targets)
    keep = [0, 1, 3, 4]
    ref = torch.nn.functional.cross_entropy(logits[0, keep], targets[0, keep])
    assert torch.allclose(loss, ref)
    # changing logits where the target is masked does not change the loss
    logits2 = logits.clone()
    logits2[0, [2, 5]] += 100.0
    assert torch.equal(causal_lm_loss(logits2, targets), loss)
    # nothing to learn -> 0, not NaN
    assert causal_lm_loss(logits, torch.full_like(targets, IGNORE_INDEX)).item() == 0.0


def test_loss_matches_hf_loss(tiny_dir, hf_model):
    run = build_stack(tiny_dir)
    ids = torch.randint(3, 32000, (1, 40), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :10] = IGNORE_INDEX
    pos = torch.arange(40)[None]
    ours = causal_lm_loss(run(ids, pos), shift_targets(labels, pos))
    with torch.no_grad():
        ref = hf_model(input_ids=ids, labels=labels).loss
    assert abs(ours.item() - ref.item()) <= 1e-5


def test_document_mask_and_window():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    m = dense_document_mask(pos)[0, 0]
    assert m.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [False, False, False, True, False],
        [False, False, False, True, True],
    ]
    w = dense_document_mask(torch.arange(5)[None], sliding_window=2)[0, 0]
    assert w[4].tolist() == [False, False, False, True, True]


def test_invalid_model_settings_name_the_field(tiny_dir):
    cfg = load_model_config(tiny_dir)
    with pytest.raises(ValueError, match="train.seq_len=4096 exceeds .*max_position_embeddings=2048"):
        prepare_hf_config(cfg, "sdpa", 4096)
    with pytest.raises(ValueError, match="train.attention_backend"):
        prepare_hf_config(cfg, "nope", 64)
