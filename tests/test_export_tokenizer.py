"""The exported model's tokenizer reproduces the training tokens (issue 27), with the real Mistral
tokenizers (mistral-common's SentencePiece models, v1 and v3):

- its plain encoding equals SentencePiece's on code, runs of spaces, tabs and random strings, where
  transformers' conversion (merges ranked by id) does not;
- `apply_chat_template` of a conversation (indentation of 1-8 spaces, tabs, trailing spaces, spaces
  after [INST], multi-turn, system prompt, tools) equals the packed training document token for
  token, and `add_generation_prompt=True` equals the trained prompt of the final answer;
- the export check (training.render_check, Trainer._check_render) passes on those documents and
  refuses a tokenizer or template that does not reproduce them, naming the document and position;
- the pad token is the one packing filled rows with.
"""

from __future__ import annotations

import glob
import random
import shutil
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline_core.handoffs import IGNORE_INDEX
from pipeline_core.hf_tokenizer import mistral_common_file
from pipeline_core.render_sample import SampleDocument, read_sample, write_sample
from spark_jobs.conversations.chat_format import MISTRAL_V1_TEMPLATE, load_tokenizer
from spark_jobs.conversations.conversation import Conversation, ToolCall, Turn
from spark_jobs.packing import LengthLimits, make_document, pack, split_documents
from training.export_tokenizer import export_tokenizer, set_chat_template
from training.render_check import RenderMismatch, check_rendering, final_answer_start

SPECS = ("mistral-v1", "mistral-v3")
CODE = ("def total(xs):\n" + "".join(" " * n + f"step_{n} = {n}  # {n} spaces\n" for n in range(1, 9))
        + "\tif xs:\t\n\t\treturn sum(xs)   \n    return 0")
CONVERSATIONS = {
    "indentation_1_to_8_spaces_and_tabs": Conversation(None, (
        Turn("user", "Write a total function in Python."), Turn("assistant", f"```python\n{CODE}\n```"))),
    "trailing_spaces": Conversation(None, (
        Turn("user", "Echo with spaces:   "), Turn("assistant", "Here they are:    \nand a tab\t \n  "))),
    "leading_spaces_after_inst": Conversation(None, (
        Turn("user", "    indented question?"), Turn("assistant", "  two leading spaces, then    four"))),
    "multi_turn": Conversation(None, (
        Turn("user", "Hi!"), Turn("assistant", "Hello.  How can I help?"), Turn("user", "Fix:\n  x  =  1"),
        Turn("assistant", "```\nx = 1\n```"), Turn("user", "   And   y?"), Turn("assistant", "    y = 2"))),
    "system_prompt": Conversation("  You are a pirate.   Answer like one.", (
        Turn("user", "Where is the  treasure?"), Turn("assistant", "Arr,\n    under the palm!"))),
    "tools": Conversation("Use tools.", (
        Turn("user", "Weather   in Oslo?"),
        Turn("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),)),
        Turn("tool", '{"temp_c": 3, "sky": "snow"}', (), "get_weather", "call_1"),
        Turn("assistant", "It is 3 °C:\n    snowing."))),
}


def sentencepiece_texts(n_random: int = 4000, n_source: int = 300) -> list[str]:
    """Runs of spaces before words, digits, line ends; tabs; unicode; source code of the stdlib."""
    rng = random.Random(0)
    texts = [f"x{' ' * n}{tail}" for n in range(1, 41) for tail in ("total", "3", "", "\n", "中", "\tx", " y")]
    texts += [" " * n + "lead" for n in range(1, 9)]
    parts = [" ", "  ", "\t", "\n", "a", "Z", "1", "é", "中", "💡", "x ", "-", ".", "  \n", "t", "o", " " * 7, " " * 15]
    texts += ["".join(rng.choice(parts) for _ in range(rng.randint(1, 40))) for _ in range(n_random)]
    stdlib = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    for f in stdlib[: n_source // 10]:
        lines = Path(f).read_text(errors="replace").split("\n")
        texts += ["\n".join(lines[i:i + 12]) for i in range(0, min(len(lines), 120), 12)]
    # HF's Metaspace adds no dummy '▁' to a text that starts with one (a documented limit of plain
    # encode; chat templates write that space themselves): compare such texts after a first word
    return [t if t and not t.startswith(" ") else "w" + t for t in texts]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per spec: the filter's tokenizer and the tokenizer directory the trainer exports for it."""
    out = {}
    for spec in SPECS:
        tok = load_tokenizer(spec)
        d = tmp_path_factory.mktemp(spec)
        export_tokenizer(d, Path("/nonexistent-base"), tok.spec_for_manifest())  # mistral-common: no base files
        out[spec] = SimpleNamespace(tok=tok, dir=d)
    return out


def converted(name: str, out: Path) -> Path:
    """transformers' conversion of the same model file (what a base model ships): merges ranked by id."""
    from transformers import LlamaTokenizer

    src = out / "src"
    src.mkdir(parents=True)
    shutil.copy(mistral_common_file(name), src / "tokenizer.model")
    LlamaTokenizer.from_pretrained(str(src), add_bos_token=True, add_eos_token=False).save_pretrained(str(out))
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_exported_tokenizer_encodes_like_sentencepiece_where_the_converted_one_does_not(exported, spec, tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(mistral_common_file(spec)))
    hf = AutoTokenizer.from_pretrained(str(exported[spec].dir))
    texts = sentencepiece_texts()
    bad = [t for t in texts if hf.encode(t, add_special_tokens=False) != sp.encode(t)]
    assert not bad, (len(bad), bad[:3])
    assert sp.encode("x    total", out_type=str) == ["▁x", "▁▁▁", "▁total"]
    old = AutoTokenizer.from_pretrained(str(converted(spec, tmp_path / "converted")))
    assert old.convert_ids_to_tokens(old.encode("x    total", add_special_tokens=False)) == ["▁x", "▁▁▁▁", "total"]
    assert sum(old.encode(t, add_special_tokens=False) != sp.encode(t) for t in texts) > len(texts) // 10


def packed_document(tok, conv: Conversation):
    """The conversation rendered by the filter, packed into a row after another document, and cut
    back out of the row: (ids, labels) exactly as the trainer reads them."""
    filler = tok.render(Conversation(None, (Turn("user", "Hi"), Turn("assistant", "Hello!"))))
    limits = LengthLimits(seq_len=2048, max_tokens=2048, min_answer_tokens=1, overflow="reject")
    docs = [make_document(r.input_ids, r.targets, limits, tok.eos_id) for r in (tok.render(conv), filler)]
    (row,) = pack([(d.input_ids, d.labels) for d in docs], 2048, tok.pad_id)
    ids, labels, positions = row
    (a, b), _, _ = split_documents(positions)  # longest first: the conversation, the filler, padding
    return ids[a:b].tolist(), labels[a:b].tolist()


def template_ids(hf, messages, tools, generation=False) -> list[int]:
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                 add_generation_prompt=generation)
    return [int(i) for i in out["input_ids"]]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("spec", SPECS)
def test_apply_chat_template_equals_the_packed_training_document(exported, spec, name):
    from transformers import AutoTokenizer

    tok = exported[spec].tok
    hf = AutoTokenizer.from_pretrained(str(exported[spec].dir))  # as a client loads the exported model
    ids, labels = packed_document(tok, CONVERSATIONS[name])
    assert ids == tok.reference_ids(CONVERSATIONS[name])  # what mistral-common encodes is what was packed
    messages, tools = tok.template_messages(CONVERSATIONS[name])
    assert template_ids(hf, messages, tools) == ids
    start = final_answer_start(labels)
    assert start is not None and labels[start - 1] == IGNORE_INDEX
    assert template_ids(hf, messages[:-1], tools, generation=True) == ids[:start]


def sample_docs(tok) -> list[SampleDocument]:
    out = []
    for name, conv in sorted(CONVERSATIONS.items()):
        ids, labels = packed_document(tok, conv)
        out.append(SampleDocument(name, "train", *tok.template_messages(conv), ids, labels, False))
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_the_export_check_passes_the_exported_tokenizer_and_refuses_the_converted_one(exported, spec, tmp_path):
    tok = exported[spec].tok
    write_sample(tmp_path / "artifact", sample_docs(tok))
    docs = list(read_sample(tmp_path / "artifact"))  # through the artifact's Parquet, as the trainer reads it
    check = check_rendering(exported[spec].dir, docs)
    assert (check.documents, check.generation_prompts) == (len(CONVERSATIONS), len(CONVERSATIONS))

    old = converted(spec, tmp_path / "converted")  # what the export copied before: the base's conversion
    set_chat_template(old, tok.chat_template())
    with pytest.raises(RenderMismatch, match=r"document 'indentation_1_to_8_spaces_and_tabs' \(train\), whole "
                       r"conversation, first difference at token \d+ of \d+: trained \[.*'▁', '▁#'.*\] but "
                       r"apply_chat_template gives \[.*'▁▁', '#'.*\]; the model is not published"):
        check_rendering(old, docs)


def test_the_export_check_refuses_a_template_that_differs_in_a_space_or_only_in_the_generation_prompt(
        exported, tmp_path):
    tok = exported["mistral-v1"].tok
    docs = sample_docs(tok)
    broken = tmp_path / "broken"
    shutil.copytree(exported["mistral-v1"].dir, broken)
    set_chat_template(broken, MISTRAL_V1_TEMPLATE.replace("' [/INST]'", "'[/INST]'"))
    with pytest.raises(RenderMismatch, match=r"document 'indentation_1_to_8_spaces_and_tabs' .* whole conversation, "
                       r"first difference at token \d+"):
        check_rendering(broken, docs)
    # renders every whole conversation right, but prompts a client differently (a stray newline)
    set_chat_template(broken, MISTRAL_V1_TEMPLATE + "{%- if add_generation_prompt -%}{{- '\\n' -}}{%- endif -%}")
    with pytest.raises(RenderMismatch, match=r"prompt of the final answer \(add_generation_prompt=True\), first "
                       r"difference at token (\d+) of \1"):
        check_rendering(broken, docs)


def test_the_exported_tokenizer_pads_with_the_packing_pad_token(exported, tmp_path):
    import json

    import numpy as np
    from transformers import AutoTokenizer

    for spec in SPECS:
        tok = exported[spec].tok
        hf = AutoTokenizer.from_pretrained(str(exported[spec].dir))
        assert (hf.pad_token, hf.pad_token_id) == ("<unk>", tok.pad_id) == ("<unk>", 0)
        ids, _, _ = next(pack([(np.array([1, 5, 2]), np.array([IGNORE_INDEX, 5, 2]))], 8, tok.pad_id))
        padded = hf.pad({"input_ids": [[1, 5, 2]]}, padding="max_length", max_length=8, padding_side="right")
        assert padded["input_ids"][0] == ids.tolist() == [1, 5, 2] + [tok.pad_id] * 5  # a client pads as packing did
    # an HF-spec export (the base's tokenizer copied) gets the spec's pad token too; the base defines none
    base = converted("mistral-v1", tmp_path / "base")
    assert AutoTokenizer.from_pretrained(str(base)).pad_token_id is None
    out = tmp_path / "hf-export"
    out.mkdir()
    spec = load_tokenizer("mistral-v1").spec_for_manifest().model_copy(update={"name": str(base), "pad_id": 2})
    export_tokenizer(out, base, spec)
    assert AutoTokenizer.from_pretrained(str(out)).pad_token_id == 2
    assert json.loads((out / "tokenizer_config.json").read_text())["pad_token"] == "</s>"


def test_finish_export_writes_the_pad_id_into_config_and_generation_config(tmp_path):
    import torch
    from transformers import AutoConfig, GenerationConfig, MistralConfig

    from training.tiny import TINY_CONFIG
    from training.weights import finish_export

    spec = load_tokenizer("mistral-v1").spec_for_manifest()
    out, base = tmp_path / "out", tmp_path / "base"
    out.mkdir()
    base.mkdir()
    finish_export(out, [], base, MistralConfig(**TINY_CONFIG), torch.float32, tokenizer=spec)
    assert AutoConfig.from_pretrained(str(out)).pad_token_id == spec.pad_id == 0
    assert GenerationConfig.from_pretrained(str(out)).pad_token_id == 0
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").read_text() == spec.chat_template


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_trainer_raises_before_publishing_when_the_export_does_not_reproduce_its_input(
        exported, tmp_path, single_process_group):
    from training.train import Trainer

    tok = exported["mistral-v1"].tok
    trainer = SimpleNamespace(role=SimpleNamespace(is_rank0=True), plan=SimpleNamespace(staging=tmp_path))
    assert Trainer._check_render(trainer, exported["mistral-v1"].dir) == {
        "render_check_documents": 0, "render_check_generation_prompts": 0}  # an artifact without a sample
    write_sample(tmp_path / "input", sample_docs(tok))
    n = len(CONVERSATIONS)
    assert Trainer._check_render(trainer, exported["mistral-v1"].dir) == {
        "render_check_documents": n, "render_check_generation_prompts": n}
    old = converted("mistral-v1", tmp_path / "converted")
    set_chat_template(old, tok.chat_template())
    with pytest.raises(RenderMismatch, match="indentation_1_to_8_spaces_and_tabs"):
        Trainer._check_render(trainer, old)
