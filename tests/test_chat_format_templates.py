"""The Jinja chat templates the exported model carries (spark_jobs/conversations/chat_templates.py), rendered the
HF way (`apply_chat_template`, tokenized by an HF tokenizer of the same SentencePiece vocabulary built
offline) give mistral-common's ids token for token: against `encode_chat_completion` of the same
OpenAI-style messages (through mistral-common's own `from_openai`), and against the renderer the
filter trains with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spark_jobs.conversations.chat_format import MISTRAL_V1_TEMPLATE, MISTRAL_V3_TEMPLATE, load_tokenizer
from spark_jobs.conversations.conversation import ConversationOptions, build_conversation

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# key order and a missing description as a schema may come from a record's metadata
TIME = {"type": "function", "function": {"parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
                                         "name": "get_time"}}


def user(c):
    return {"role": "user", "content": c}


def assistant(c):
    return {"role": "assistant", "content": c}


def calls(*cs):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}} for cid, name, args in cs]}


def result(cid, name, content):
    return {"role": "tool", "tool_call_id": cid, "name": name, "content": content}


CONVERSATIONS = {
    "single_turn": ([user("What is the capital of France?"), assistant("Paris.")], None),
    "multi_turn": ([user("Hi there!"), assistant("Hello. How can I help?"), user("What is 2 + 2?"),
                    assistant("It is 4."), user("And 3 + 3?"), assistant("6.")], None),
    "system": ([{"role": "system", "content": "You are a pirate. Answer like one."}, user("Where is the treasure?"),
                assistant("Arr, under the palm tree!"), user("Which one?"), assistant("The tallest, matey.")], None),
    "tools_without_a_call": ([{"role": "system", "content": "Use tools when needed."}, user("Tell me a joke."),
                              assistant("Why did the chicken cross the road?")], [WEATHER, TIME]),
    "tool_call_and_result": ([user("What is the weather in Oslo?"), calls(("abcdefghi", "get_weather", {"city": "Oslo"})),
                              result("abcdefghi", "get_weather", json.dumps({"temp_c": 3, "sky": "snow"})),
                              assistant("It is 3 °C and snowing in Oslo.")], [WEATHER]),
    "parallel_calls": ([{"role": "system", "content": "Be brief."}, user("Weather in Oslo and Rome, and the time in Rome?"),
                        calls(("abcdefghi", "get_weather", {"city": "Oslo"}), ("bcdefghij", "get_weather", {"city": "Rome"}),
                              ("cdefghijk", "get_time", {"tz": "Europe/Rome"})),
                        result("abcdefghi", "get_weather", json.dumps({"temp_c": 3})),
                        result("bcdefghij", "get_weather", "sunny and warm"),  # plain text: a JSON string
                        result("cdefghijk", "get_time", "1830"),  # a number
                        assistant("Oslo 3 °C, Rome sunny; it is 18:30 in Rome.")], [WEATHER, TIME]),
    "calls_before_the_last_user_turn": ([user("Weather in Oslo?"), calls(("abcdefghi", "get_weather", {"city": "Oslo"})),
                                         result("abcdefghi", "get_weather", json.dumps([3, "snow"])),
                                         assistant("3 °C, snow."), user("Thanks! Should I wear a coat?"),
                                         assistant("Yes, a warm one.")], [WEATHER]),
}


def hf_tokenizer(tmp: Path, model_file: str, legacy: bool, template: str):
    """An HF tokenizer of a mistral-common SentencePiece model (its control tokens become special
    tokens), saved with save_pretrained and loaded back, carrying `template` as the exported model would."""
    import mistral_common
    from transformers import AutoTokenizer, LlamaTokenizer

    src = tmp / "src"
    src.mkdir()
    shutil.copy(Path(mistral_common.__file__).parent / "data" / model_file, src / "tokenizer.model")
    out = tmp / f"hf-legacy-{legacy}"
    LlamaTokenizer.from_pretrained(str(src), legacy=legacy, add_bos_token=True, add_eos_token=False).save_pretrained(str(out))
    hf = AutoTokenizer.from_pretrained(str(out))
    hf.chat_template = template
    return hf


def template_ids(hf, messages, tools, add_generation_prompt=False):
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                 add_generation_prompt=add_generation_prompt)
    return [int(i) for i in out["input_ids"]]


def mistral_common_ids(spec: str, messages, tools, mode: str) -> list[int]:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    mt = MistralTokenizer.from_file(str(load_tokenizer(spec).path), mode=ValidationMode[mode])
    return list(mt.encode_chat_completion(ChatCompletionRequest.from_openai(messages, tools=tools)).tokens)


@pytest.fixture(scope="module", params=[True, False], ids=["legacy", "non_legacy"])
def v3_hf(request, tmp_path_factory):
    return hf_tokenizer(tmp_path_factory.mktemp("v3"), "mistral_instruct_tokenizer_240323.model.v3", request.param,
                        MISTRAL_V3_TEMPLATE)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_v3_template_equals_encode_chat_completion(v3_hf, name):
    messages, tools = CONVERSATIONS[name]
    # the whole conversation, as the filter trains on it
    assert template_ids(v3_hf, messages, tools) == mistral_common_ids("mistral-v3", messages, tools, "finetuning")
    # the prompt for the final answer, as vLLM / TGI would send it
    prompt = messages[:-1]
    assert template_ids(v3_hf, prompt, tools, add_generation_prompt=True) == \
        mistral_common_ids("mistral-v3", prompt, tools, "test")


def nemotron(messages):
    """The dataset's shape: content always a string, tool results without ids or names."""
    out = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if m["role"] == "tool":
            m = {"role": "tool", "content": m["content"]}
        out.append(m)
    return out


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_v3_template_equals_the_renderer(v3_hf, name):
    """What the filter trained on (`render`, mistral-common ids) is what the exported template gives
    for the same record's conversation."""
    messages, tools = CONVERSATIONS[name]
    tok = load_tokenizer("mistral-v3")
    conv = build_conversation(nemotron(messages), json.dumps({"tools": tools}) if tools else None, "off",
                              ConversationOptions())
    assert template_ids(v3_hf, conv.to_messages(), list(conv.tools) or None) == tok.render(conv).input_ids


@pytest.fixture(scope="module")
def v1_hf(tmp_path_factory):
    return hf_tokenizer(tmp_path_factory.mktemp("v1"), "tokenizer.model.v1", True, MISTRAL_V1_TEMPLATE)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_v1_template_equals_the_renderer(v1_hf, name):
    """v1 has no tool tokens: the renderer's text format for tools (schemas in the system prompt,
    calls as assistant text, consecutive results one user turn) is what the template writes too."""
    messages, tools = CONVERSATIONS[name]
    tok = load_tokenizer("mistral-v1")
    conv = build_conversation(nemotron(messages), json.dumps({"tools": tools}) if tools else None, "off",
                              ConversationOptions())
    assert template_ids(v1_hf, conv.to_messages(), list(conv.tools) or None) == tok.render(conv).input_ids


@pytest.mark.parametrize("name", ["single_turn", "multi_turn", "system"])
def test_v1_template_equals_encode_chat_completion(v1_hf, name):
    messages, _ = CONVERSATIONS[name]
    assert template_ids(v1_hf, messages, None) == mistral_common_ids("mistral-v1", messages, None, "finetuning")
    assert template_ids(v1_hf, messages[:-1], None, add_generation_prompt=True) == \
        mistral_common_ids("mistral-v1", messages[:-1], None, "test")


def test_the_manifest_records_the_template_of_its_tokenizer():
    assert load_tokenizer("mistral-v1").spec_for_manifest().chat_template == MISTRAL_V1_TEMPLATE
    assert load_tokenizer("mistral-v3").spec_for_manifest().chat_template == MISTRAL_V3_TEMPLATE
