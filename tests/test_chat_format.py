"""Conversation rendering (no Spark): real mistral-common encodings, assistant masks, the HF-style
chat template recorded for exported models, placeholders, reasoning, context segmentation."""

from __future__ import annotations

import json

import pytest

from pipeline_core.handoffs import IGNORE_INDEX
from spark_jobs.conversations.chat_format import MISTRAL_V1_TEMPLATE, load_tokenizer
from spark_jobs.conversations.conversation import ConversationOptions, RenderError, build_conversation
from spark_jobs.conversations.normalize import Rejected, normalise, split_reasoning
from spark_jobs.conversations.sentences import split_units
from spark_jobs.packing import LengthLimits, make_document


def m(role, content, tool_calls=None):
    return {"role": role, "content": content, "tool_calls": tool_calls}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CODE_CHAT = [
    m("system", "You are a pirate. Answer every question like a pirate would."),
    m("user", "How do I reverse a list in Python?"),
    m("assistant", "Arr, use slicing:\n```python\nitems = [1, 2, 3]\nprint(items[::-1])\n```\nThat be all."),
    m("user", "And in place?"),
    m("assistant", "Call `items.reverse()`, matey:\n```python\n    items.reverse()\n```"),
]
WEATHER_TOOLS = {"tools": [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}
TOOL_CHAT = [
    m("user", "What is the weather in Oslo?"),
    m("assistant", "", [call("call_0001", "get_weather", '{"city": "Oslo"}')]),
    m("tool", '{"temp_c": 3, "sky": "snow"}'),
    m("assistant", "It is 3 °C and snowing in Oslo."),
]
REASONING = [m("user", "What is 17 * 3?"), m("assistant", "17 * 3 = 51, check: 50 + 1.</think>\n\n51")]
LONG_REFERENCE = [m("system", " ".join(f"Fact {i}: the value of item {i} is {i * 7}." for i in range(40))),
                  m("user", "What is the value of item 12?"), m("assistant", "Item 12 has the value 84.")]
RECORDS = {"code_chat": (CODE_CHAT, None, "off"), "tools": (TOOL_CHAT, json.dumps(WEATHER_TOOLS), "off"),
           "reasoning": (REASONING, None, "on"), "long_reference": (LONG_REFERENCE, None, "off")}


def assistant_texts(tok, conv):
    """What each assistant turn must contribute as targets, encoded independently of the renderer."""
    out = []
    for t in conv.turns:
        if t.role == "assistant" and not t.tool_calls:
            out.append(list(tok._tok.encode(t.content, bos=False, eos=False)) + [tok.eos_id])
    return out


@pytest.mark.parametrize("spec", ["mistral-v1", "mistral-v3"])
@pytest.mark.parametrize("name", sorted(RECORDS))
@pytest.mark.parametrize("train_on_reasoning", [False, True])
def test_render_equals_encode_instruct_and_masks_exactly_the_assistant_turns(spec, name, train_on_reasoning):
    tok = load_tokenizer(spec)
    messages, meta, reasoning = RECORDS[name]
    conv = build_conversation(messages, meta, reasoning, ConversationOptions(train_on_reasoning=train_on_reasoning))
    r = tok.render(conv)
    assert r.input_ids == tok.reference_ids(conv)  # token for token what mistral-common produces
    targets = [i for i, t in zip(r.input_ids, r.targets, strict=True) if t]
    # the targets are the assistant turns, in order, each with its </s> (tool calls included)
    expected = assistant_texts(tok, conv)
    flat = [x for e in expected for x in e]
    if any(t.tool_calls for t in conv.turns):
        assert len(targets) > len(flat) and targets[-len(expected[-1]):] == expected[-1]
        assert targets.count(tok.eos_id) == sum(t.role == "assistant" for t in conv.turns)
    else:
        assert targets == flat
    # nothing outside the assistant turns is a target: prompt, system and tool results are masked
    assert not r.targets[0] and r.input_ids[0] == tok.bos_id and r.input_ids[-1] == tok.eos_id and r.targets[-1]
    last = tok.render(conv, "last_assistant_turn")
    assert last.input_ids == r.input_ids
    assert [i for i, t in zip(last.input_ids, last.targets, strict=True) if t] == expected[-1]


def test_system_prompt_placement_and_tools():
    v1, v3 = load_tokenizer("mistral-v1"), load_tokenizer("mistral-v3")
    conv = build_conversation(CODE_CHAT, None, "off", ConversationOptions())
    text1 = v1.decode(v1.render(conv).input_ids)
    assert text1.startswith("[INST] You are a pirate. Answer every question like a pirate would.\n\nHow do I reverse")
    assert "    items.reverse()" in text1 and "```python\nitems = [1, 2, 3]" in text1  # code verbatim
    tools = build_conversation(TOOL_CHAT, json.dumps(WEATHER_TOOLS), "off", ConversationOptions())
    r1 = v1.render(tools)
    t1 = v1.decode(r1.input_ids)
    assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"' in t1
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]' in t1
    assert '[INST] [TOOL_RESULTS] [{"name": "get_weather", "content": {"temp_c": 3, "sky": "snow"}}] [/TOOL_RESULTS] [/INST]' in t1
    call_text = v1.decode([i for i, t in zip(r1.input_ids, r1.targets, strict=True) if t])
    assert "[TOOL_CALLS]" in call_text and "temp_c" not in call_text  # the call trained, the result masked
    r3 = v3.render(tools)
    special = {v3._inst.BEGIN_AVAILABLE_TOOLS, v3._inst.TOOL_CALLS, v3._inst.BEGIN_TOOL_RESULTS}
    assert special <= set(r3.input_ids)
    trained = {i for i, t in zip(r3.input_ids, r3.targets, strict=True) if t}
    assert v3._inst.TOOL_CALLS in trained and v3._inst.BEGIN_TOOL_RESULTS not in trained


def test_mistral_v1_chat_template_reproduces_the_token_ids(tmp_path):
    """The template the manifest records (and the exported model carries), rendered the HF way by
    transformers, gives our ids: tokenized by the model's SentencePiece between special tokens (the
    code chat, indentation included), and by an HF tokenizer of the same vocabulary (a multi-turn
    chat without runs of spaces, which HF's converted tokenizer splits differently from SentencePiece)."""
    import re

    from transformers import AutoTokenizer

    from training.tiny import save_mistral_tokenizer

    save_mistral_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.chat_template = MISTRAL_V1_TEMPLATE
    tok = load_tokenizer("mistral-v1")
    assert tok.spec_for_manifest().chat_template == MISTRAL_V1_TEMPLATE
    conv = build_conversation(CODE_CHAT, None, "off", ConversationOptions())
    text = hf.apply_chat_template(conv.to_messages(), tokenize=False)
    ids = []
    for piece in re.split(r"(<s>|</s>)", text):
        if piece in ("<s>", "</s>"):
            ids.append(tok.bos_id if piece == "<s>" else tok.eos_id)
        elif piece:
            ids.extend(tok._tok.encode(piece[1:] if piece.startswith(" ") else piece, bos=False, eos=False))
    assert ids == tok.render(conv).input_ids
    plain = build_conversation([m("system", "Be brief."), m("user", "Hi there!"), m("assistant", "Hello."),
                                m("user", "What is 2 + 2?"), m("assistant", "It is 4.")], None, "off", ConversationOptions())
    text = hf.apply_chat_template(plain.to_messages(), tokenize=False)
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.render(plain).input_ids


def test_reasoning_marker_and_lone_close_think():
    assert split_reasoning("plan it out</think>\n\nThe answer.") == ("The answer.", "plan it out")
    assert split_reasoning("<think>a</think>b") == ("b", "a")
    conv = build_conversation(REASONING, None, "on", ConversationOptions(train_on_reasoning=True))
    assert conv.system == "/think" and conv.turns[-1].content == "<think>\n17 * 3 = 51, check: 50 + 1.\n</think>\n\n51"
    off = build_conversation(REASONING, None, "off", ConversationOptions(train_on_reasoning=True))
    assert off.system == "/no_think"
    plain = build_conversation(REASONING, None, "on", ConversationOptions())
    assert plain.system is None and plain.turns[-1].content == "51"  # the trace never leaks into the answer
    # earlier assistant turns keep only their visible text
    multi = build_conversation([m("user", "a"), m("assistant", "<think>x</think>b"), m("user", "c"), m("assistant", "d")],
                               None, "on", ConversationOptions(train_on_reasoning=True))
    assert multi.turns[1].content == "b"


@pytest.mark.parametrize("prompt", ["", "-", "   ", "\t-\n", None])
def test_placeholder_prompts_are_withheld(prompt):
    with pytest.raises(Rejected) as e:
        normalise([m("user", prompt), m("assistant", "Here is some code.")])
    assert e.value.reason == "prompt_withheld"


def test_unrenderable_shapes_are_rejects_not_crashes():
    v3 = load_tokenizer("mistral-v3")
    both = build_conversation([m("user", "q"), m("assistant", "Let me look.", [call("abcdefghi", "f", "{}")]),
                               m("tool", "1"), m("assistant", "one")], None, None, ConversationOptions())
    with pytest.raises(RenderError) as e:
        v3.render(both)
    assert e.value.reason == "template_unsupported" and "both text and tool calls" in e.value.detail
    assert load_tokenizer("mistral-v1").render(both).n_targets > 0  # v1 renders it as text


def test_length_limits_on_multi_turn_documents():
    tok = load_tokenizer("mistral-v1")
    r = tok.render(build_conversation(CODE_CHAT, None, "off", ConversationOptions()))
    n = len(r.input_ids)
    doc = make_document(r.input_ids, r.targets, LengthLimits(n, n, 1, "reject"), tok.eos_id)
    assert doc.n_answer == r.n_targets and (doc.labels != IGNORE_INDEX).sum() == r.n_targets
    assert make_document(r.input_ids, r.targets, LengthLimits(n - 1, n, 1, "reject"), tok.eos_id)[0] == "exceeds_seq_len"
    cut = make_document(r.input_ids, r.targets, LengthLimits(n - 5, n, 1, "truncate"), tok.eos_id)
    assert cut.truncated and len(cut.input_ids) == n - 5
    first = r.targets.index(True)
    assert make_document(r.input_ids, r.targets, LengthLimits(first, n, 1, "truncate"), tok.eos_id)[0] == "prompt_exceeds_seq_len"


def test_context_units_keep_structure():
    text = ("Intro sentence. Second one!\n```python\ndef f(x):\n    return x\n```\n| a | b |\n|---|---|\n| 1 | 2 |\n"
            '- item one. Still item one.\n  continued\n- item two\n{"k": {"v": [1, 2]},\n "s": "a}b"}\n    indented code\n'
            "    more code\n\nLast words.")
    assert split_units(text) == [
        "Intro sentence.", "Second one!", "```python\ndef f(x):\n    return x\n```", "| a | b |\n|---|---|\n| 1 | 2 |",
        "- item one. Still item one.\n  continued", "- item two", '{"k": {"v": [1, 2]},\n "s": "a}b"}',
        "    indented code\n    more code", "Last words.",
    ]
    assert split_units("{not json\nbut prose. Yes.") == ["{not json", "but prose.", "Yes."]
    big = "A sentence about Dr. Who, e.g. a film, and 3.5 km. " * 30000  # ~1.2 MB in one paragraph: linear (bench/segment_bench.py)
    assert len(split_units(big)) == 30000


def test_relevant_prompt_context_keeps_question_relevant_units_in_order_inside_the_system_turn():
    """`prompt_context: relevant` on a 20-unit reference document, scored by real MiniLM against the
    question only: the units kept are the relevant ones, in document order, verbatim (the code block
    whole), still in the system turn."""
    import numpy as np

    from samples.enriched import embed
    from spark_jobs.filter.render_docs import reduce_context

    filler = [f"The {w} festival in the old town attracts many visitors every summer." for w in
              ("music", "film", "food", "wine", "jazz", "book", "flower", "lantern", "kite", "boat", "cheese",
               "dance", "poetry", "chess", "sand", "tea", "glass")]
    # in document order; by score (MiniLM, vs the question) they rank in reverse: order is the code's doing
    relevant = ["Slicing with items[::-1] returns a reversed copy of a Python list.",
                "```python\nitems = [1, 2, 3]\nitems.reverse()\n```",
                "Python lists are reversed in place with the reverse method."]
    units = filler[:5] + relevant[:1] + filler[5:10] + relevant[1:2] + filler[10:13] + relevant[2:] + filler[13:]
    assert len(units) == 20
    system = "\n".join(units)
    question = "How do I reverse a Python list?"
    scores = (embed(units) @ embed([question])[0]).tolist()
    messages = [m("system", system), m("user", question), m("assistant", "Use items.reverse() or items[::-1].")]
    tok = load_tokenizer("mistral-v1")
    out = reduce_context(messages, units, [0] * len(units), scores, tok, budget=50, top_k=3)
    assert out[0]["role"] == "system" and out[0]["content"] == "\n".join(relevant)  # in document order
    assert out[1:] == messages[1:]
    assert int(np.argmax(scores)) == 15 and scores[5] < scores[11] < scores[15]
    short = reduce_context(messages, units, [0] * len(units), scores, tok, budget=10_000, top_k=3)
    assert short == messages  # under the token budget the turn stays verbatim
