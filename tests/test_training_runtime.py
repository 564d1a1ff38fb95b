"""The trainer's start-up decisions and guards, without a process group: what `auto` resolves to,
the tokenizer/vocabulary refusal, the resolved DeepSpeed config, weight-decay groups, the
non-finite-step guard and its stop, the exported chat template."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline_core import uris
from pipeline_core.config import load_config
from pipeline_core.handoffs import TokenizerSpec
from spark_jobs.filter.train_ready import write_train_ready
from tests.training_helpers import make_tiny_model, tokenized_corpus
from training import runtime, train
from training.optim import OptimizerConfigError, SkipNonFiniteAdamW, build_ds_config, decay_groups


# ----------------------------------------------------------------------------- auto settings
def test_cpu_bf16_detection_reads_the_instruction_flags(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    bf16 = tmp_path / "bf16"
    bf16.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n")
    assert runtime.cpu_has_bf16(plain) is False
    assert runtime.cpu_has_bf16(bf16) is True
    assert runtime.cpu_has_bf16(tmp_path / "missing") is False


def test_auto_picks_fp32_sdpa_and_no_kernels_on_a_cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda *a: False)
    s = runtime.resolve_settings(load_config().train, on_gpu=False)
    assert (s.precision, s.attention_backend, s.fast_kernels) == ("fp32", "sdpa", "none")
    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda *a: True)
    assert runtime.resolve_settings(load_config().train, on_gpu=False).precision == "bf16"


def test_auto_on_a_gpu_picks_the_fast_paths_and_explicit_values_win(monkeypatch):
    monkeypatch.setattr(runtime, "gpu_has_bf16", lambda: True)
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: object() if name == "liger_kernel" else None)
    s = runtime.resolve_settings(load_config().train, on_gpu=True)
    assert (s.precision, s.attention_backend, s.fast_kernels) == ("bf16", "torch_varlen", "liger")
    parity = load_config(overrides={"train.verify_parity": True}).train
    assert runtime.resolve_settings(parity, on_gpu=True).fast_kernels == "none"  # parity needs logits
    explicit = load_config(overrides={"train.precision": "fp32", "train.attention_backend": "flex"}).train
    s = runtime.resolve_settings(explicit, on_gpu=True)
    assert (s.precision, s.attention_backend) == ("fp32", "flex")


# ----------------------------------------------------------------------------- DeepSpeed config
def _bf16():
    return runtime.Settings("bf16", "sdpa", "none", on_gpu=False)


def test_ds_config_accumulates_in_fp32_under_bf16_and_runs_the_client_adamw():
    t = load_config(overrides={"train.learning_rate": 3e-4, "train.lr_schedule": "cosine", "train.steps": 50}).train
    ds = build_ds_config(t, dp=2, settings=_bf16())
    assert ds["data_types"]["grad_accum_dtype"] == "fp32" and ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"]["lr"] == 3e-4
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["scheduler"]["params"]["total_num_steps"] == 50
    assert ds["train_batch_size"] == t.micro_batch_size * t.gradient_accumulation_steps * 2
    fp32 = build_ds_config(t, dp=1, settings=runtime.Settings("fp32", "sdpa", "none", on_gpu=False))
    assert "grad_accum_dtype" not in fp32["data_types"] and fp32["bf16"]["enabled"] is False


def test_fp32_accumulation_without_zero_1_is_refused_with_what_to_change(tmp_path):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    t = load_config(overrides={"train.ds_config": str(ds_file)}).train
    with pytest.raises(OptimizerConfigError, match=r"grad_accum_dtype=fp32 .* zero_optimization.stage=1.*bf16"):
        build_ds_config(t, dp=1, settings=_bf16())
    ok = load_config(overrides={"train.ds_config": str(ds_file), "train.grad_accum_dtype": "bf16"}).train
    assert build_ds_config(ok, dp=1, settings=_bf16())["data_types"]["grad_accum_dtype"] == "bf16"


def test_weight_decay_skips_norms_biases_and_embeddings():
    module = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "lin": torch.nn.Linear(4, 4),
                                  "norm": torch.nn.LayerNorm(4)})
    decay, no_decay = decay_groups(module, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p is module["lin"].weight for p in decay["params"]] == [True]
    assert {id(p) for p in no_decay["params"]} == {id(module["emb"].weight), id(module["lin"].bias),
                                                   id(module["norm"].weight), id(module["norm"].bias)}


# ----------------------------------------------------------------------------- non-finite steps
def test_a_non_finite_step_leaves_the_weights_alone_and_is_counted():
    w = torch.nn.Parameter(torch.ones(3))
    opt = SkipNonFiniteAdamW([w], device=torch.device("cpu"), lr=0.1)
    w.grad = torch.tensor([1.0, float("nan"), 1.0])
    opt.step()
    assert opt.last_skipped and opt.skipped == 1 and torch.equal(w.detach(), torch.ones(3))
    w.grad = torch.tensor([1.0, 1.0, 1.0])
    opt.step()
    assert not opt.last_skipped and opt.skipped == 1 and (w.detach() < 1).all()


def test_max_bad_steps_in_a_row_stop_the_run_with_a_clear_error():
    bad = train.BadSteps(limit=3)
    for step, skipped in enumerate([True, True, False, True, True], start=1):
        bad.record(step, skipped)  # two in a row, reset, two in a row: keeps going
    assert bad.total == 4 and bad.in_a_row == 2
    with pytest.raises(train.TrainingDiverged, match=r"3 non-finite steps in a row .*train.max_bad_steps=3"):
        bad.record(6, True)


# ----------------------------------------------------------------------------- tokenizer vs model
def _ready(tmp_path, store, spec: TokenizerSpec) -> str:
    docs = tokenized_corpus(12, 64)
    uri = uris.join(store, "datasets", "t", "train", spec.name)
    write_train_ready(uri, tmp_path / f"ready-{spec.name}", {"train": docs[:10], "val": docs[10:]}, seq_len=64,
                      tokenizer=spec, pad_id=0)
    return uri


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    (tmp / "store").mkdir()
    return tmp, uris.qualify(tmp / "store"), make_tiny_model(tmp / "tiny")


def _plan(tiny, input_uri):
    tmp, store, model = tiny
    cfg = load_config(overrides={"pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp / "staging"),
                                 "train.base_model": str(model), "train.seq_len": 64})
    return train.make_plan(cfg, input_uri, uris.join(store, "runs", "r"), world_size=2, on_gpu=False)


def test_data_tokenized_for_another_vocabulary_is_refused_naming_both(tiny, tmp_path):
    _, store, model = tiny
    v3 = _ready(tmp_path, store, TokenizerSpec(name="mistral-v3", vocab_size=32768, bos_id=1, eos_id=2))
    with pytest.raises(train.TrainConfigError, match=r"'mistral-v3' \(vocab 32768, bos 1, eos 2\) but "
                       r"train.base_model .*tiny.* has vocab 32000, bos 1, eos 2"):
        _plan(tiny, v3)
    v1 = _ready(tmp_path, store, TokenizerSpec(name="mistral-v1", vocab_size=32000, bos_id=1, eos_id=2,
                                               chat_template="{{ messages[0]['content'] }}"))
    plan = _plan(tiny, v1)
    assert plan.tokenizer.chat_template == "{{ messages[0]['content'] }}"


def test_the_export_carries_the_training_chat_template(tiny, tmp_path):
    from transformers import AutoTokenizer

    from training.export_tokenizer import copy_tokenizer, set_chat_template

    _, _, model = tiny
    out = tmp_path / "export"
    out.mkdir()
    copy_tokenizer(model, out)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    set_chat_template(out, template)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user] hi\n"


# ----------------------------------------------------------------------------- one engine builder
@pytest.mark.parametrize("precision,options", [
    ("fp32", {}),
    ("bf16", {}),  # fused fp32 accumulation and wgrad fusion: the levers the probe once lacked
    ("bf16", {"fused_wgrad_accumulation": False, "fused_grad_accumulation": False}),
    ("bf16", {"compile_layers": True}),
])
def test_the_loss_probe_builds_the_engine_train_py_builds(tiny, tmp_path, precision, options):
    """tests/training_loss_probe.py checks what users run: for the same config, its DeepSpeed
    config equals train.py's but for the keys it declares (PROBE_DS_CHANGES), and it gets the same
    ordered converter list (a lever applied by one path only fails here)."""
    from tests import training_loss_probe as probe

    _, store, model = tiny
    v1 = _ready(tmp_path, store, TokenizerSpec(name="mistral-v1", vocab_size=32000, bos_id=1, eos_id=2))
    cfg = probe.probe_config(2, 64, 4, precision, options)
    spec, _ = probe.probe_engine_spec(cfg, dp=1)
    tmp, _, _ = tiny
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={
        "store_uri": store, "staging_uri": uris.qualify(tmp / "staging")})})
    cfg.train.base_model = str(model)
    plan = train.make_plan(cfg, v1, uris.join(store, "runs", "r"), world_size=2, on_gpu=False)
    assert [c.name for c in spec.converters] == [c.name for c in plan.converters()]
    assert ({k: v for k, v in spec.ds_config.items() if k not in probe.PROBE_DS_CHANGES}
            == {k: v for k, v in plan.ds_config.items() if k not in probe.PROBE_DS_CHANGES})
    if precision == "bf16" and not options:
        assert [c.name for c in spec.converters] == ["fused_hp_grad_accumulation", "wgrad_fusion"]
