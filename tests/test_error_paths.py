"""Bad input gets a clear error and leaves nothing behind: each refusal names what is wrong and
what to change, and no artifact is committed. Driven through the stages' own entry points (the
command line, `run(...)`, `load_tokenizer`), real Spark local[2]."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest
from pipeline_core.config import load_config
from spark_jobs.enrich import job as enrich
from tests.conftest import REPO


def _cfg(tmp: Path):
    return load_config(env={}, overrides={"pipeline.staging_uri": uris.qualify(tmp / "staging"),
                                          "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2,
                                                     "splits": ["chat"]}})  # the one split these inputs have


def _out(tmp: Path) -> str:
    return uris.join(uris.qualify(tmp / "store"), "datasets", "v1", "enriched", "x")


def test_enrich_with_no_input_files_names_the_input_and_commits_nothing(spark, tmp_path):
    src = tmp_path / "empty"
    (src / "data").mkdir(parents=True)
    (src / "data" / "README.txt").write_text("not a data file")
    out = _out(tmp_path)
    with pytest.raises(FileNotFoundError, match="no input files") as e:
        enrich.run(uris.qualify(src), out, _cfg(tmp_path), spark=spark)
    assert uris.qualify(src) in str(e.value)
    assert read_manifest(out) is None


def test_enrich_refuses_parquet_without_messages(spark, tmp_path):
    src = tmp_path / "src" / "data"
    src.mkdir(parents=True)
    pq.write_table(pa.table({"uuid": ["a", "b"], "category": ["chat", "chat"], "text": ["hi", "there"]}),
                   src / "chat-00000-of-00001.parquet")
    out = _out(tmp_path)
    with pytest.raises(ValueError, match="no 'messages' column") as e:
        enrich.run(uris.qualify(src.parent), out, _cfg(tmp_path), spark=spark)
    assert "text" in str(e.value), "the message lists the columns found"
    assert read_manifest(out) is None


@pytest.mark.parametrize("bad", [
    "hf://nvidia/Nemotron-Post-Training-Dataset-v1",  # no datasets/ part
    "hf://datasets/",
    "hf://datasets/nvidia",  # no dataset name
    "hf://datasets/nvidia/Nemotron@",  # empty revision
    "hf://datasets/nvidia/../../etc@main",
])
def test_enrich_command_refuses_a_malformed_hub_uri_before_spark_starts(tmp_path, bad):
    cmd = [sys.executable, str(REPO / "spark_jobs" / "enrich" / "job.py"), "--input", bad, "--output", _out(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])  # argparse's usage error
    assert "hf://datasets/<owner>/<name>[@revision]" in r.stderr and bad in r.stderr, r.stderr[-2000:]
    assert "SparkContext" not in r.stderr and "Spark" not in r.stdout


def test_a_well_formed_hub_uri_passes_the_command_line():
    from spark_jobs.common import parse_stage_args

    a = parse_stage_args("x", ["--input", "hf://datasets/nvidia/Nemotron-Post-Training-Dataset-v1@v1.1",
                               "--output", "s3://bucket/datasets/v1/enriched/x"])
    assert a.input == "hf://datasets/nvidia/Nemotron-Post-Training-Dataset-v1@v1.1"
    with pytest.raises(SystemExit):
        parse_stage_args("x", ["--input", "file:///data", "--output", "hf://datasets/me/out"])


# An HF chat template whose generation prompt is not how the conversation renders the assistant
# turn: prompt tokens are then not a prefix of the whole, and no loss mask can be cut from them.
NOT_A_PREFIX_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] }}"
    "{% else %}{{ '\\nBOT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\nASSISTANT:' }}{% endif %}"
)


def _hf_tokenizer_dir(path: Path, chat_template: str) -> str:
    """The v1 SentencePiece model as a Hugging Face tokenizer directory with `chat_template`."""
    import json
    import shutil

    import mistral_common

    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", path / "tokenizer.model")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": chat_template}))
    return str(path)


def test_filter_refuses_a_chat_template_whose_prompt_is_not_a_prefix(tmp_path):
    from samples.enriched import publish_enriched
    from spark_jobs.filter import job as similarity_filter
    from tests.filter_helpers import FILTER_SETTINGS, crafted_table

    store = uris.qualify(tmp_path / "store")
    enriched = uris.join(store, "datasets", "v1", "enriched", "x")
    publish_enriched(crafted_table(), tmp_path / "enriched", enriched)
    tok_dir = _hf_tokenizer_dir(tmp_path / "tok", NOT_A_PREFIX_TEMPLATE)
    cfg = load_config(env={}, overrides={
        "pipeline.staging_uri": uris.qualify(tmp_path / "staging"),
        "filter": {**FILTER_SETTINGS, "tokenizer": tok_dir, "spark_master": "local[2]", "shuffle_partitions": 2}})
    out = uris.join(store, "datasets", "v1", "train", "x")
    with pytest.raises(Exception, match="filter.tokenizer") as e:
        similarity_filter.run(enriched, out, cfg)
    assert "prefix" in str(e.value) and tok_dir in str(e.value), str(e.value)[-2000:]
    assert read_manifest(out) is None
    assert not (tmp_path / "staging").exists(), "refused only after compute had started"


def _changed(original, wrong: bool):
    """mistral-common's `encode_user_message` as a future release might change it: the keyword
    arguments `encode_instruct` passes keep working, a positional-only call (the tokenizer's fast
    prompt path) raises -- or, with `wrong=True`, silently returns different tokens."""

    def encode_user_message(inst, *args, **kwargs):
        out = original(inst, *args, **kwargs)
        if "settings" in kwargs:
            return out
        if not wrong:
            raise TypeError("encode_user_message() missing 1 required keyword-only argument: 'settings'")
        return ([*out[0], out[0][-1]], *out[1:])

    return encode_user_message


@pytest.mark.parametrize("wrong", [False, True], ids=["raises", "disagrees"])
def test_prompt_encoding_survives_a_changed_mistral_common_fast_path(monkeypatch, wrong):
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import InstructRequest

    from spark_jobs.conversations.chat_format import load_tokenizer

    load_tokenizer.cache_clear()
    probe = load_tokenizer("mistral-v1")
    cls = next(c for c in type(probe._inst).__mro__ if "encode_user_message" in vars(c))
    monkeypatch.setattr(cls, "encode_user_message", _changed(vars(cls)["encode_user_message"], wrong))
    load_tokenizer.cache_clear()
    try:
        tok = load_tokenizer("mistral-v1")
        inst = tok._inst
        from spark_jobs.conversations.conversation import ConversationOptions, build_conversation

        for prompt, answer in [("What is 2+2?", "4."), ("Context: ü 漢字.\n\nWhich?", "That one.")]:
            conv = build_conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                                      None, None, ConversationOptions())
            got = list(tok.render(conv).input_ids)
            want = inst.encode_instruct(InstructRequest(messages=[UserMessage(content=prompt),
                                                                  AssistantMessage(content=answer)])).tokens
            assert got == list(want), "prompt encoding differs from mistral-common's own"
    finally:
        load_tokenizer.cache_clear()
