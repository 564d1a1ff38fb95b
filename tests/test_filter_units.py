"""Filter building blocks without Spark: chat template + real Mistral tokenizers, length limits, packing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from spark_jobs.chat_format import load_tokenizer, render
from spark_jobs.packing import (
    ANSWER_TOO_SHORT,
    EXCEEDS_SEQ_LEN,
    IGNORE_INDEX,
    PROMPT_EXCEEDS_SEQ_LEN,
    TOO_LONG,
    Document,
    LengthLimits,
    best_fit_decreasing,
    make_document,
    pack,
    split_documents,
)
from spark_jobs.split import split_of

CASES = [
    ("What is 2+2?", "It is 4."),
    ("Context line one.\nLine two: ü, 漢字, emoji 🙂.\n\nWhat now?", "  Leading spaces and\nnew lines.\n"),
    ("[INST] looks like a tag [/INST]", "</s> is just text here"),
]


@pytest.mark.parametrize("spec", ["mistral-v1", "mistral-v3"])
def test_prompt_plus_completion_is_mistral_commons_own_encoding(spec):
    tok = load_tokenizer(spec)
    for prompt, completion in CASES:
        p, c = tok.encode(prompt, completion)
        assert p + c == tok.encode_full(prompt, completion)
        assert p == tok._prompt_slow(prompt)  # whichever prompt encoder was chosen at load
        assert p[0] == tok.bos_id and c[-1] == tok.eos_id
    assert tok._encode_prompt == tok._prompt_fast  # the fast path is in use with this mistral-common


def test_v1_template_text():
    tok = load_tokenizer("mistral-v1")
    p, c = tok.encode("Hello there?", "General Kenobi.")
    assert tok.decode(p + c) == "[INST] Hello there? [/INST] General Kenobi."
    assert tok.decode(c) == "General Kenobi."
    assert tok.identity()["template"]["format"] == "<s>[INST] {prompt} [/INST] {completion}</s>"


def test_render_context_question_and_reasoning():
    assert render([], " Q? ", " A. ") == ("Q?", "A.")
    assert render(["S1.", " ", "S2."], "Q?", "A.") == ("S1.\nS2.\n\nQ?", "A.")
    assert render(None, "Q?", "A.", reasoning_trace="think", train_on_reasoning=False) == ("Q?", "A.")
    assert render(None, "Q?", "A.", reasoning_trace="think", train_on_reasoning=True) == ("Q?", "<think>\nthink\n</think>\n\nA.")


MISTRAL_V01_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


def hf_dir(path, chat_template=None):
    """The v1 SentencePiece model as a Hugging Face tokenizer directory (what a model repo ships)."""
    import json
    import shutil

    shutil.copy(load_tokenizer("mistral-v1").path, path / "tokenizer.model")
    cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "add_bos_token": True, "add_eos_token": False, "legacy": False}
    if chat_template:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)


def test_hf_tokenizer_without_template_uses_the_v1_format(tmp_path):
    v1 = load_tokenizer("mistral-v1")
    tok = load_tokenizer(hf_dir(tmp_path))
    assert tok.identity()["tokenizer"]["kind"] == "huggingface"
    assert tok.identity()["template"]["name"] == "mistral-instruct-v1-text"
    # (HF's SentencePiece->BPE conversion merges runs of spaces differently, so plain text only)
    for prompt, completion in [CASES[0], ("France is in Europe.\n\nWhat is its capital?", "Paris.")]:
        assert tok.encode(prompt, completion) == v1.encode(prompt, completion)


def test_hf_tokenizer_with_chat_template_splits_prompt_and_answer(tmp_path):
    tok = load_tokenizer(hf_dir(tmp_path, MISTRAL_V01_TEMPLATE))
    assert tok.identity()["template"]["name"] == "hf-chat-template"
    p, c = tok.encode("What is 2+2?", "It is 4.")
    assert p[0] == tok.bos_id and c[-1] == tok.eos_id
    assert tok.decode(p) == "[INST] What is 2+2? [/INST]" and tok.decode(c) == "It is 4."


LIMITS = LengthLimits(seq_len=16, max_tokens=20, min_answer_tokens=2, overflow="reject")


def test_length_limits_reject_with_reasons():
    eos = 2
    doc = make_document([1, 5, 6], [7, 8, eos], LIMITS, eos)
    assert isinstance(doc, Document) and doc.n_prompt == 3 and doc.n_answer == 3 and not doc.truncated
    assert doc.labels.tolist() == [IGNORE_INDEX] * 3 + [7, 8, eos] and doc.input_ids.dtype == np.int32
    assert make_document([1, 5], [7, eos], LIMITS, eos)[0] == ANSWER_TOO_SHORT
    assert make_document([1] * 10, [7] * 11, LIMITS, eos)[0] == TOO_LONG
    assert make_document([1] * 10, [7] * 8, LIMITS, eos)[0] == EXCEEDS_SEQ_LEN


def test_truncate_cuts_only_the_answer_tail_and_counts_it():
    eos = 2
    limits = LengthLimits(seq_len=16, max_tokens=40, min_answer_tokens=2, overflow="truncate")
    doc = make_document(list(range(100, 110)), list(range(200, 210)) + [eos], limits, eos)
    assert doc.truncated and len(doc.input_ids) == 16 and doc.n_answer == 6
    assert doc.input_ids.tolist()[:10] == list(range(100, 110))  # the prompt is whole
    assert doc.labels.tolist()[10:] == list(range(200, 206))
    assert make_document(list(range(15)), [7, 8, eos], limits, eos)[0] == PROMPT_EXCEEDS_SEQ_LEN


def test_best_fit_decreasing_places_every_document_once_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    lower_bound = -(-sum(lengths) // 128)
    assert len(bins) <= lower_bound * 1.05 + 1  # near-optimal on uniform lengths
    assert bins == best_fit_decreasing(lengths, 128)  # deterministic
    with pytest.raises(ValueError, match="length limits must run first"):
        best_fit_decreasing([129], 128)


def test_pack_rows_follow_the_contract():
    docs = []
    for n_p, n_c in [(3, 4), (5, 2), (2, 9), (6, 6)]:
        ids = np.arange(10, 10 + n_p + n_c, dtype=np.int32)
        labels = ids.copy()
        labels[:n_p] = IGNORE_INDEX
        docs.append((ids, labels))
    rows = list(pack(docs, 16, pad_id=0))
    seen = []
    for ids, labels, pos in rows:
        assert ids.dtype == labels.dtype == pos.dtype == np.int32 and len(ids) == 16
        for s, e in split_documents(pos):
            assert pos[s:e].tolist() == list(range(e - s))
            if (ids[s:e] == 0).all():
                assert (labels[s:e] == IGNORE_INDEX).all() and e == 16
            else:
                seen.append(ids[s:e].tolist())
    assert sorted(seen) == sorted(d[0].tolist() for d in docs)


def test_split_of_is_a_pure_function_of_id_and_seed():
    ids = [f"r{i}" for i in range(2000)]
    a = [split_of(i, 1, 0.25) for i in ids]
    assert a == [split_of(i, 1, 0.25) for i in ids]
    assert 0.2 < a.count("val") / len(a) < 0.3
    assert [split_of(i, 1, 0.0) for i in ids].count("val") == 0


def test_tokenize_partitions_trains_on_the_reasoning_trace_only_when_configured():
    import json

    import pandas as pd

    from pipeline_core.config import FilterSection
    from spark_jobs.similarity_filter import tokenize_partitions

    tok = load_tokenizer("mistral-v1")
    raw = json.dumps({"id": "a", "question": "Q?"})
    pdf = pd.DataFrame({"id": ["a", "b"], "key": [1, 2], "split": ["train", "val"],
                        "relevant": [np.array(["Some context."]), np.array([], dtype=object)],
                        "question": ["Why is the sky blue?", "Q?"], "answer": ["Rayleigh scattering.", "A."],
                        "reasoning_trace": ["Short wavelengths scatter more.", None],
                        "reason": [None, "near_duplicate"], "raw": [raw, raw]})
    for on in (False, True):
        (out,) = tokenize_partitions(iter([pdf]), FilterSection(train_on_reasoning=on, seq_len=64, max_tokens=64))
        a, b = out.to_dict("records")
        answer = tok.decode([t for t, lab in zip(a["input_ids"], a["labels"], strict=True) if lab != IGNORE_INDEX])
        trace = "<think>\nShort wavelengths scatter more.\n</think>\n\n"
        assert answer == (trace if on else "") + "Rayleigh scattering."
        assert tok.decode(a["input_ids"]).startswith("[INST] Some context.\n\nWhy is the sky blue? [/INST]")
        assert a["reason"] is None and b["reason"] == "near_duplicate" and b["input_ids"] is None and b["raw"] == raw
