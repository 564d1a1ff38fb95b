"""Jinja chat templates that reproduce, as text, the token layout the mistral-common renderers train on.

The train-ready manifest records one of these (`TokenizerSpec.chat_template`) and the exported
model carries it in `tokenizer_config.json`, so `apply_chat_template`, vLLM and TGI format prompts
the way training did. Tokenized by an HF tokenizer of the same SentencePiece vocabulary (control
tokens as special tokens), `apply_chat_template` gives mistral-common's ids token for token
(tests/test_chat_templates.py checks it against `encode_chat_completion` and against the
renderer). The HF tokenizer must be the exported one (`pipeline_core.hf_tokenizer`: merges ranked by
SentencePiece's scores); transformers' plain conversion merges runs of `▁` in another order and
serves indented code in tokens the model never saw (issue 27; the trainer's render check refuses it).
One limit of the template: JSON given as text (tool arguments, tool results) is emitted as written,
where mistral-common re-serialises it with `json.dumps`: the ids agree when the text is what
`json.dumps` writes (what tool runtimes send) or when it is given as an object.

Only plain Jinja (no `{% generation %}`, which TGI's minijinja lacks); the whitespace around each
piece is what SentencePiece's dummy prefix needs under both Metaspace prepend schemes
(`legacy=True` / `False`).
"""

from __future__ import annotations

# A tool argument / tool result as mistral-common writes it: json.dumps of the parsed value. Objects
# go through tojson (transformers' tojson is json.dumps(ensure_ascii=False), mistral-common's too);
# text that is JSON (an object, an array, a number, true/false/null) is emitted as it is; other text
# is a JSON string.
_JSON_VALUE = (
    "{%- macro json_value(v) -%}"
    "{%- if v is string -%}{%- set t = v|trim -%}"
    "{%- if t[:1] in ['{', '['] or t in ['true', 'false', 'null'] or (t|int(none)|string) == t"
    " or (t|float(none)|string) == t -%}{{- t -}}"
    "{%- else -%}{{- v|tojson -}}{%- endif -%}"
    "{%- else -%}{{- v|tojson -}}{%- endif -%}"
    "{%- endmacro -%}"
)
_SPLIT_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set system = messages[0]['content'] -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
)

# mistral-common v1 (InstructTokenizerV1): `<s> [INST] {system}\n\n{user} [/INST] {answer}</s>`, the
# system prompt in the first user turn. v1 has no tool tokens; tools are the renderer's text format
# (chat_format.MistralCommonTokenizer._v1_system / _v1_messages): schemas appended to the system
# prompt, a call `[TOOL_CALLS] [{name, arguments}]` as assistant text, consecutive results one
# user turn `[TOOL_RESULTS] [{name, content}] [/TOOL_RESULTS]`.
MISTRAL_V1_TEMPLATE = (
    _JSON_VALUE + _SPLIT_SYSTEM
    + "{%- if tools -%}{%- set tools_text = '[AVAILABLE_TOOLS] ' + tools|tojson + ' [/AVAILABLE_TOOLS]' -%}"
    "{%- set system = (system + '\\n\\n' + tools_text) if system else tools_text -%}{%- endif -%}"
    "{{- bos_token -}}{%- set ns = namespace(first=true) -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "{%- if ns.first and system -%}{{- ' [INST] ' + system + '\\n\\n' + m['content'] + ' [/INST]' -}}"
    "{%- else -%}{{- ' [INST] ' + m['content'] + ' [/INST]' -}}{%- endif -%}{%- set ns.first = false -%}"
    "{%- elif m['role'] == 'assistant' -%}{{- ' ' -}}"
    "{%- if m.get('tool_calls') -%}{%- if m['content'] -%}{{- m['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '[TOOL_CALLS] [' -}}{%- for c in m['tool_calls'] -%}"
    "{{- '{\"name\": ' + c['function']['name']|tojson + ', \"arguments\": ' + json_value(c['function']['arguments']) + '}' -}}"
    "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}{%- endfor -%}{{- ']' -}}"
    "{%- else -%}{{- m['content'] -}}{%- endif -%}{{- eos_token -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.previtem is not defined or loop.previtem['role'] != 'tool' -%}{{- ' [INST] [TOOL_RESULTS] [' -}}"
    "{%- else -%}{{- ', ' -}}{%- endif -%}"
    "{{- '{\"name\": ' + m.get('name')|tojson + ', \"content\": ' + json_value(m['content']) + '}' -}}"
    "{%- if loop.nextitem is not defined or loop.nextitem['role'] != 'tool' -%}{{- '] [/TOOL_RESULTS] [/INST]' -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
)

# mistral-common v3 (InstructTokenizerV3): `<s>[INST] {user}[/INST] {answer}</s>`; the system prompt and
# `[AVAILABLE_TOOLS] [{type, function: {name, description, parameters}}][/AVAILABLE_TOOLS]` in the
# last user turn; a call `[TOOL_CALLS] [{name, arguments, id}]</s>`; a result
# `[TOOL_RESULTS] {content, call_id}[/TOOL_RESULTS]`; calls and results before the last user turn
# are kept (as mistral-common >= 1.5 encodes them).
MISTRAL_V3_TEMPLATE = (
    _JSON_VALUE + _SPLIT_SYSTEM
    + "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in loop_messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{{- bos_token -}}{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "{%- if loop.index0 == ns.last and tools -%}{{- '[AVAILABLE_TOOLS] [' -}}{%- for t in tools -%}"
    "{%- set f = t['function'] if t['function'] is defined else t -%}"
    "{{- {'type': 'function', 'function': {'name': f['name'], 'description': f.get('description') or '',"
    " 'parameters': f.get('parameters') or {}}}|tojson -}}"
    "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}{%- endfor -%}{{- ']' -}}{{- '[/AVAILABLE_TOOLS]' -}}{%- endif -%}"
    "{%- if loop.index0 == ns.last and system -%}{{- '[INST] ' + system + '\\n\\n' + m['content'] + '[/INST]' -}}"
    "{%- else -%}{{- '[INST] ' + m['content'] + '[/INST]' -}}{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if m.get('tool_calls') -%}{{- '[TOOL_CALLS] [' -}}{%- for c in m['tool_calls'] -%}"
    "{{- '{\"name\": ' + c['function']['name']|tojson + ', \"arguments\": ' + json_value(c['function']['arguments']) -}}"
    "{%- if c.get('id') and c['id'] != 'null' -%}{{- ', \"id\": ' + c['id']|tojson -}}{%- endif -%}{{- '}' -}}"
    "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}{%- endfor -%}{{- ']' + eos_token -}}"
    "{%- else -%}{{- ' ' + m['content'].rstrip(' ') + eos_token -}}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + json_value(m['content']) + ', \"call_id\": ' + m['tool_call_id']|tojson + '}[/TOOL_RESULTS]' -}}"
    "{%- endif -%}{%- endfor -%}"
)
