"""Filter building blocks without Spark: chat template + real Mistral tokenizers, length limits, packing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from spark_jobs.conversations.chat_format import load_tokenizer
from spark_jobs.conversations.conversation import Conversation, Turn
from spark_jobs.filter.split import split_of
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

MISTRAL_V01_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
# The same layout with the assistant turns marked for `return_assistant_tokens_mask`.
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{% generation %}{{ ' ' + message['content'] + eos_token }}"
    "{% endgeneration %}{% endif %}{% endfor %}"
)
# Renders the last user turn differently from the same turn earlier: prefixes are not prefixes.
SHIFTING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% if loop.last %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] }}{% endif %}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
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


TWO_TURNS = Conversation(None, (Turn("user", "What is 2+2?"), Turn("assistant", "It is 4."),
                                Turn("user", "And 3+3?"), Turn("assistant", "It is 6.")))


def target_runs(r):
    runs, cur = [], []
    for i, t in zip(r.input_ids, r.targets, strict=True):
        if t:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("template", [MISTRAL_V01_TEMPLATE, GENERATION_TEMPLATE])
def test_hf_tokenizer_masks_assistant_turns_from_its_own_template(tmp_path, template):
    tok = load_tokenizer(hf_dir(tmp_path, template))
    assert tok.identity()["kind"] == "huggingface"
    assert tok.identity()["assistant_mask"] == ("generation blocks" if "generation" in template else "prefix renderings")
    assert tok.spec_for_manifest().chat_template == template  # the tokenizer's own template is recorded
    r = tok.render(TWO_TURNS)
    assert r.input_ids[0] == tok.bos_id and r.input_ids[-1] == tok.eos_id
    assert tok.decode(r.input_ids) == "[INST] What is 2+2? [/INST] It is 4.[INST] And 3+3? [/INST] It is 6."
    assert [tok.decode(s) for s in target_runs(r)] == ["It is 4.", "It is 6."]
    assert all(s[-1] == tok.eos_id for s in target_runs(r))  # each turn's </s> is trained
    assert [tok.decode(s) for s in target_runs(tok.render(TWO_TURNS, "last_assistant_turn"))] == ["It is 6."]


def test_hf_templates_that_cannot_be_masked_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="has no chat_template"):
        load_tokenizer(hf_dir(tmp_path / "a"))
    # refused when it loads (a probe conversation), before any executor renders a record
    with pytest.raises(ValueError, match="template_unsupported.*prefix"):
        load_tokenizer(hf_dir(tmp_path / "b", SHIFTING_TEMPLATE))


LIMITS = LengthLimits(seq_len=16, max_tokens=20, min_answer_tokens=2, overflow="reject")


def pc(prompt, completion):
    """(ids, targets) of a prompt followed by one trained completion."""
    return [*prompt, *completion], [False] * len(prompt) + [True] * len(completion)


def test_length_limits_reject_with_reasons():
    eos = 2
    doc = make_document(*pc([1, 5, 6], [7, 8, eos]), LIMITS, eos)
    assert isinstance(doc, Document) and doc.n_prompt == 3 and doc.n_answer == 3 and not doc.truncated
    assert doc.labels.tolist() == [IGNORE_INDEX] * 3 + [7, 8, eos] and doc.input_ids.dtype == np.int32
    assert make_document(*pc([1, 5], [7, eos]), LIMITS, eos)[0] == ANSWER_TOO_SHORT
    assert make_document(*pc([1] * 10, [7] * 11), LIMITS, eos)[0] == TOO_LONG
    assert make_document(*pc([1] * 10, [7] * 8), LIMITS, eos)[0] == EXCEEDS_SEQ_LEN
    # multi-turn: targets anywhere, the count is over all of them
    multi = make_document([1, 5, 7, 2, 6, 8, 9, 2], [False, False, True, True, False, False, True, True], LIMITS, eos)
    assert multi.labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 7, 2, IGNORE_INDEX, IGNORE_INDEX, 9, 2]


def test_truncate_cuts_only_the_answer_tail_and_counts_it():
    eos = 2
    limits = LengthLimits(seq_len=16, max_tokens=40, min_answer_tokens=2, overflow="truncate")
    doc = make_document(*pc(list(range(100, 110)), list(range(200, 210)) + [eos]), limits, eos)
    assert doc.truncated and len(doc.input_ids) == 16 and doc.n_answer == 6
    assert doc.input_ids.tolist()[:10] == list(range(100, 110))  # the prompt is whole
    assert doc.labels.tolist()[10:] == list(range(200, 206))
    assert make_document(*pc(list(range(15)), [7, 8, eos]), limits, eos)[0] == PROMPT_EXCEEDS_SEQ_LEN


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


def test_split_of_is_a_pure_function_of_prompt_key_and_seed():
    ids = [f"r{i}" for i in range(2000)]
    a = [split_of(i, 1, 0.25) for i in ids]
    assert a == [split_of(i, 1, 0.25) for i in ids]
    assert 0.2 < a.count("val") / len(a) < 0.3
    assert [split_of(i, 1, 0.0) for i in ids].count("val") == 0


def test_render_partitions_trains_on_the_reasoning_trace_only_when_configured():
    import json

    import pandas as pd

    from pipeline_core.config import FilterSection
    from spark_jobs.filter.render_docs import render_partitions

    tok = load_tokenizer("mistral-v1")
    raw = json.dumps({"id": "a", "question": "Q?"})
    msgs = [{"role": "system", "content": "Some context."}, {"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "content": "<think>Short wavelengths scatter more.</think>Rayleigh scattering."}]
    pdf = pd.DataFrame({"id": ["a", "b"], "category": ["stem", "chat"], "key": [1, 2], "split": ["train", None],
                        "reason": [None, "near_duplicate"], "raw": [None, raw],
                        "messages_json": [json.dumps(msgs), None], "metadata": [None, None], "reasoning": ["on", "off"],
                        "context_sentences": [None, None], "context_turns": [None, None],
                        "context_question_scores": [None, None]})
    for on in (False, True):
        (out,) = render_partitions(iter([pdf]), FilterSection(train_on_reasoning=on, seq_len=64, max_tokens=64))
        a, b = out.to_dict("records")
        answer = tok.decode([t for t, lab in zip(a["input_ids"], a["labels"], strict=True) if lab != IGNORE_INDEX])
        trace = "<think>\nShort wavelengths scatter more.\n</think>\n\n"
        assert answer == (trace if on else "") + "Rayleigh scattering."
        system = "Some context.\n\n/think" if on else "Some context."
        assert tok.decode(a["input_ids"]).startswith(f"[INST] {system}\n\nWhy is the sky blue? [/INST]")
        assert a["reason"] is None and b["reason"] == "near_duplicate" and b["input_ids"] is None and b["raw"] == raw


def test_render_partitions_keeps_the_conversation_of_sample_candidates_only():
    """`chat` (the template messages of the render sample) for kept rows with a key under the threshold;
    the threshold admits ~8x the wanted sample, or every key when that is most of the rows."""
    import json

    import pandas as pd

    from pipeline_core.config import FilterSection
    from pipeline_core.render_sample import key_threshold
    from spark_jobs.filter.render_docs import render_partitions

    tok = load_tokenizer("mistral-v3")
    calls = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "content": '{"t": 3}'}, {"role": "assistant", "content": "3 degrees."}]
    n = 4
    pdf = pd.DataFrame({"id": list("abcd"), "category": ["tool"] * n, "key": [-5, 7, -(2 ** 62), 2 ** 62],
                        "split": ["train"] * n, "reason": [None, None, "near_duplicate", None], "raw": [None] * n,
                        "messages_json": [json.dumps(calls)] * n, "metadata": [None] * n, "reasoning": ["off"] * n,
                        "context_sentences": [None] * n, "context_turns": [None] * n,
                        "context_question_scores": [None] * n})
    fcfg = FilterSection(tokenizer="mistral-v3", seq_len=256, max_tokens=256)
    (none,) = render_partitions(iter([pdf]), fcfg)
    assert none["chat"].isna().all()
    (out,) = render_partitions(iter([pdf]), fcfg, sample_below=0)
    assert [c is not None for c in out["chat"]] == [True, False, False, False]  # key < 0, and kept
    chat = json.loads(out["chat"][0])
    # v3 encodes a call id of 9 alphanumerics: the messages carry the one it encoded, on the call and its result
    cid = chat["messages"][1]["tool_calls"][0]["id"]
    assert len(cid) == 9 and cid.isalnum() and chat["messages"][2]["tool_call_id"] == cid
    assert f'"call_id": "{cid}"' in tok.decode(out["input_ids"][0])
    assert key_threshold(10, 80) == key_threshold(10, 0) == 2 ** 63
    assert key_threshold(10, 8000) == -(2 ** 63) + 2 ** 64 // 100


def test_overflow_drop_earlier_reasoning_keeps_the_answer_whole_and_counts_the_fit():
    """filter.overflow=drop_earlier_reasoning (issue 29): earlier turns keep their traces when the row
    fits; a row too long with them is rendered again without them (counted), its final answer's trace
    and the visible conversation unchanged; still too long: rejected, never cut. reject (default)
    renders as before. n_tokens / len_with_reasoning / len_without_reasoning feed the manifest's
    per-split fit counts (spark_jobs.filter.job.split_fit)."""
    import json

    import pandas as pd

    from pipeline_core.config import FilterSection
    from spark_jobs.filter.render_docs import render_partitions

    tok = load_tokenizer("mistral-v1")
    long_trace = " ".join(["step"] * 60)
    msgs = [{"role": "user", "content": "First?"},
            {"role": "assistant", "content": f"<think>{long_trace}</think>One."},
            {"role": "user", "content": "Second?"},
            {"role": "assistant", "content": "<think>Short.</think>Two."}]
    pdf = pd.DataFrame({"id": ["a"], "category": ["math"], "key": [1], "split": ["train"], "reason": [None],
                        "raw": [None], "messages_json": [json.dumps(msgs)], "metadata": [None], "reasoning": ["on"],
                        "context_sentences": [None], "context_turns": [None], "context_question_scores": [None]})

    def render(**kw):
        (out,) = render_partitions(iter([pdf]), FilterSection(train_on_reasoning=True, **kw))
        return out.to_dict("records")[0]

    big = render(seq_len=512, max_tokens=512, overflow="drop_earlier_reasoning")
    assert big["reason"] is None and not big["reasoning_dropped"]
    assert long_trace in tok.decode(big["input_ids"])  # fits: the earlier trace stays
    base = render(seq_len=512, max_tokens=512)  # overflow=reject: earlier traces dropped, as before
    assert long_trace not in tok.decode(base["input_ids"]) and base["n_tokens"] < big["n_tokens"]
    assert base["len_without_reasoning"] < base["n_tokens"] == base["len_with_reasoning"]  # the final trace counts

    limit = base["n_tokens"] + 4  # too long with the earlier trace, fits without it
    dropped = render(seq_len=limit, max_tokens=limit, overflow="drop_earlier_reasoning")
    assert dropped["reason"] is None and dropped["reasoning_dropped"] and not dropped["truncated"]
    assert list(dropped["input_ids"]) == list(base["input_ids"]) and list(dropped["labels"]) == list(base["labels"])
    assert dropped["n_tokens"] == big["n_tokens"] and dropped["category"] == "math"
    text = tok.decode(dropped["input_ids"])
    assert "One." in text and "<think>\nShort.\n</think>\n\nTwo." in text

    tight = base["n_tokens"] - 1  # too long even without: a reject, not a cut answer
    rejected = render(seq_len=tight, max_tokens=tight + 100, overflow="drop_earlier_reasoning")
    assert rejected["reason"] == "exceeds_seq_len" and rejected["input_ids"] is None


def test_fit_with_reasoning_counts_the_marker_when_not_training_reasoning():
    """len_with_reasoning is the conversation as train_on_reasoning renders it, also for a row whose
    final answer has no trace: the /no_think or /think marker (v1 `reasoning: off` / `on`) still costs
    tokens. (Once a shortcut counted such rows as equal both ways: the v1 sample's per-split
    fit with reasoning equalled the fit without it.)"""
    import json

    import pandas as pd

    from pipeline_core.config import FilterSection
    from spark_jobs.filter.render_docs import render_partitions

    plain = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "3 degrees."}]
    earlier = [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "<think>Think it over.</think>One."},
               {"role": "user", "content": "Second?"}, {"role": "assistant", "content": "Two."}]
    n = 3
    pdf = pd.DataFrame({"id": list("abc"), "category": ["chat"] * n, "key": [1, 2, 3], "split": ["train"] * n,
                        "reason": [None] * n, "raw": [None] * n,
                        "messages_json": [json.dumps(plain), json.dumps(plain), json.dumps(earlier)],
                        "metadata": [None] * n, "reasoning": ["off", None, "on"], "context_sentences": [None] * n,
                        "context_turns": [None] * n, "context_question_scores": [None] * n})
    fcfg = FilterSection(tokenizer="mistral-v3", seq_len=256, max_tokens=256, train_on_reasoning=False,
                         overflow="drop_earlier_reasoning")
    off, none, on = render_partitions(iter([pdf]), fcfg).__next__().to_dict("records")
    assert off["n_tokens"] == off["len_without_reasoning"] < off["len_with_reasoning"]  # "/no_think" in the system turn
    assert none["len_with_reasoning"] == none["len_without_reasoning"] == none["n_tokens"]  # nothing to add
    assert on["n_tokens"] == on["len_without_reasoning"] < on["len_with_reasoning"]
