"""`filter.tokenizer` = a Hugging Face tokenizer directory: the conversation rendered by the
tokenizer's own chat template through `apply_chat_template(tools=)`, the loss mask from the template
(`{% generation %}` blocks) or from prefix renderings, and templates that cannot give a mask refused
at load. The tokenizer is a real one built offline: a byte-level BPE trained on a few sentences,
wrapped as `PreTrainedTokenizerFast`, saved with `save_pretrained` with its chat template, and
loaded by the production path (`load_tokenizer` -> `AutoTokenizer.from_pretrained`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spark_jobs.conversations.chat_format import HFChatTokenizer, load_tokenizer
from spark_jobs.conversations.conversation import ConversationOptions, build_conversation

ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>"]

# A tool-aware template in the style of the hub's (schemas in a system block, calls as JSON in the
# assistant turn, results in a tool turn), each turn ending with eos and a newline.
# GEN marks where `{% generation %}` goes; the prefix-rendering variant has it removed.
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|system|>Tools: ' + tools|tojson + '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{- '<|system|>' + m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'user' %}{{- '<|user|>' + m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|assistant|>' }}GEN_OPEN"
    "{%- for c in m.get('tool_calls') or [] %}"
    "{{- '<tool_call>' + {'name': c['function']['name'], 'arguments': c['function']['arguments']}|tojson + '</tool_call>' }}"
    "{%- endfor %}{{- m['content'] + eos_token }}GEN_CLOSE{{- '\\n' }}"
    "{%- elif m['role'] == 'tool' %}{{- '<|tool|>' + m['content'] + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
GENERATION_TEMPLATE = TEMPLATE.replace("GEN_OPEN", "{% generation %}").replace("GEN_CLOSE", "{% endgeneration %}")
PREFIX_TEMPLATE = TEMPLATE.replace("GEN_OPEN", "").replace("GEN_CLOSE", "")

WEATHER_TOOLS = {"tools": [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}
TOOL_RECORD = [
    {"role": "system", "content": "You answer weather questions."},
    {"role": "user", "content": "What is the weather in Oslo and in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "content": '{"temp_c": 3, "sky": "snow"}'},
    {"role": "tool", "content": '{"temp_c": 21, "sky": "sun"}'},
    {"role": "assistant", "content": "Oslo: 3 °C and snow. Rome: 21 °C and sun."},
    {"role": "user", "content": "Which is warmer?"},
    {"role": "assistant", "content": "Rome is warmer."},
]


def build_tokenizer(path: Path, chat_template: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [json.dumps(TOOL_RECORD), json.dumps(WEATHER_TOOLS), "What is 2+2? It is 4. Hello there, how are you?"]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>", *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 additional_special_tokens=ROLE_TOKENS)
    hf.chat_template = chat_template
    hf.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_tokenizers")


def tokenizer(tokenizers_dir: Path, name: str, template: str) -> HFChatTokenizer:
    tok = load_tokenizer(build_tokenizer(tokenizers_dir / name, template))
    assert isinstance(tok, HFChatTokenizer)
    return tok


def targets_text(tok, r) -> list[str]:
    """The trained tokens, decoded span by span (special tokens kept)."""
    spans, cur = [], []
    for i, t in zip(r.input_ids, r.targets, strict=True):
        if t:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tok._tok.decode(s, skip_special_tokens=False) for s in spans]


EXPECTED_TARGETS = [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call></s>',
    "Oslo: 3 °C and snow. Rome: 21 °C and sun.</s>",
    "Rome is warmer.</s>",
]


@pytest.mark.parametrize("kind", ["generation", "prefix"])
def test_hf_template_renders_tools_and_masks_exactly_the_assistant_turns(tokenizers_dir, kind):
    tok = tokenizer(tokenizers_dir, kind, GENERATION_TEMPLATE if kind == "generation" else PREFIX_TEMPLATE)
    assert tok.identity()["assistant_mask"] == ("generation blocks" if kind == "generation" else "prefix renderings")
    conv = build_conversation(TOOL_RECORD, json.dumps(WEATHER_TOOLS), "off", ConversationOptions())
    r = tok.render(conv)
    # the ids are the template's own rendering of the conversation, tools passed as `tools=`
    direct = tok._tok.apply_chat_template(conv.to_messages(), tools=list(conv.tools), tokenize=True, return_dict=True)
    assert r.input_ids == list(direct["input_ids"])
    text = tok._tok.decode(r.input_ids, skip_special_tokens=False)
    assert text.startswith('<s><|system|>Tools: [{"type": "function", "function": {"name": "get_weather"')
    assert '<|tool|>{"temp_c": 3, "sky": "snow"}\n<|tool|>{"temp_c": 21' in text  # results in order
    # targets: each assistant turn with its </s>, nothing else (not the newline after it, not the
    # role header, not the schemas, the system prompt, the user turns or the tool results)
    assert targets_text(tok, r) == EXPECTED_TARGETS
    last = tok.render(conv, "last_assistant_turn")
    assert last.input_ids == r.input_ids and targets_text(tok, last) == EXPECTED_TARGETS[-1:]


def test_generation_blocks_and_prefix_renderings_give_the_same_mask(tokenizers_dir):
    gen = tokenizer(tokenizers_dir, "generation-2", GENERATION_TEMPLATE)
    pre = tokenizer(tokenizers_dir, "prefix-2", PREFIX_TEMPLATE)
    for record, meta in ((TOOL_RECORD, json.dumps(WEATHER_TOOLS)),
                         ([{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi, how are you?"}], None)):
        conv = build_conversation(record, meta, "off", ConversationOptions())
        assert gen.render(conv) == pre.render(conv)


# The generation prompt is '<|bot|>' but the conversation renders the assistant turn as '<|assistant|>':
# the prompt is not a prefix of the whole, no mask can be cut from prefix renderings.
NOT_A_PREFIX = PREFIX_TEMPLATE.replace("{{- '<|assistant|>' }}{%- endif %}", "{{- '<|tool|>' }}{%- endif %}")
# generation blocks around the role header instead of the answer: the mask would train the wrong tokens
MISPLACED_GENERATION = TEMPLATE.replace("{{- '<|assistant|>' }}GEN_OPEN", "{% generation %}{{- '<|assistant|>' }}{% endgeneration %}").replace("GEN_CLOSE", "")


@pytest.mark.parametrize("template, match", [
    (NOT_A_PREFIX, "not render a conversation's prefix as a prefix of the whole"),
    (MISPLACED_GENERATION, "does not mark the answer"),
    ("", "has no chat_template"),
], ids=["not_a_prefix", "misplaced_generation", "no_template"])
def test_templates_that_cannot_give_a_mask_are_refused_at_load(tokenizers_dir, template, match):
    assert NOT_A_PREFIX != PREFIX_TEMPLATE and MISPLACED_GENERATION != GENERATION_TEMPLATE
    path = build_tokenizer(tokenizers_dir / f"refused-{abs(hash(template))}", template)
    with pytest.raises(ValueError, match=match) as e:
        HFChatTokenizer(path)
    assert "filter.tokenizer" in str(e.value) and path in str(e.value)


def test_a_conversation_the_template_refuses_is_a_reject_not_a_crash(tokenizers_dir):
    from spark_jobs.conversations.conversation import RenderError

    strict = GENERATION_TEMPLATE.replace(
        "{%- elif m['role'] == 'tool' %}", "{%- elif m['role'] == 'tool' %}{{- raise_exception('no tools here') }}")
    tok = tokenizer(tokenizers_dir, "strict", strict)
    conv = build_conversation(TOOL_RECORD, json.dumps(WEATHER_TOOLS), "off", ConversationOptions())
    with pytest.raises(RenderError) as e:
        tok.render(conv)
    assert e.value.reason == "template_unsupported" and "no tools here" in e.value.detail
