"""Every shape of the Nemotron data family -> one normalised record (pure Python, no Spark).

Shapes read (docs/data-sources.md lists them with their recovery recipes):
  - Nemotron-Post-Training-Dataset v1 / v2 Parquet: `messages` (v1 with `tool_calls`), `metadata`
    a JSON *string* (v1 `tool_calling` keeps its tool schemas in `metadata.tools`);
  - the Nemotron SFT collection (JSONL / Parquet, e.g. Nemotron-SFT-Instruction-Following-Chat-v3):
    `reasoning_content` on assistant turns, `null` system / first user turns (withheld: restored
    from `metadata.seed_dataset` by `metadata.seed_prompt_sha256`), `metadata.train_turns`, `tools`,
    `used_in`, `model`, `reward_model`; `metadata` an *object*;
  - code-reasoning rows (OpenCodeReasoning style): `input` / `output` (or messages) with a `"-"`
    prompt and `dataset` / `split` / `index` addressing the question in its source.

`from_record` returns a `FamilyRecord`: messages in the v1 message shape (role system / user /
assistant / tool, `content` text or None = *withheld*, `reasoning_content` on assistant turns
when it has text, tool calls `{id, type, function: {name, arguments}}` with `arguments` JSON text
of the object, whatever came in), the record's `metadata` (tools in one schema under `tools`,
`train_turns`), provenance, and the key that can restore a withheld prompt. It never raises and
never rejects: shapes it cannot fix pass through unchanged, so `normalize.normalise` rejects them
with its usual reasons.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_jobs.conversations.normalize import is_placeholder

# A code-reasoning row's `dataset` value -> the hub id its `prompt_sources` entry is keyed by.
DATASET_HUB_IDS = {
    "taco": "BAAI/TACO",
    "apps": "codeparrot/apps",
    "code_contests": "deepmind/code_contests",
    "codeforces": "open-r1/codeforces",
}
ROLE_ALIASES = {"developer": "system"}
_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)


@dataclass(frozen=True)
class RestoreKey:
    """Where a withheld prompt comes back from: `source` (a hub id, the `enrich.prompt_sources`
    key), `recipe` ("sha256": the seed's first user turn's sha256; "index": `<split>/<row>`)."""

    source: str
    recipe: str
    key: str


@dataclass
class FamilyRecord:
    id: str | None
    messages: list[Any] | None
    metadata: str | None  # JSON text; unchanged from the input when nothing had to move into it
    license: str | None = None
    generator: str | None = None
    used_in: list[str] = field(default_factory=list)
    seed_dataset: str | None = None
    restore: RestoreKey | None = None
    train_turns: list[bool] | None = None


def repair_text(s: str) -> str:
    """LaTeX written into JSON without escaping its backslash: `\\b` (\\boxed, \\beta) decodes to a
    backspace and `\\f` (\\frac) to a form feed before a letter. Neither occurs in real text."""
    if "\x08" in s:
        s = s.replace("\x08", "\\b")
    if "\x0c" in s:
        s = re.sub(r"\x0c(?=[A-Za-z])", r"\\f", s)
    return s


def _json(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except (ValueError, RecursionError):
            return v
    return v


def flatten_content(content: Any) -> Any:
    """Text of a turn: a list of typed parts (`{"type": "text", "text": ...}` or strings) is
    joined with newlines; a JSON object (a structured tool result) becomes its JSON text. Anything
    else (an image part) is returned unchanged and rejected downstream as `bad_content`."""
    if content is None or isinstance(content, str):
        return None if content is None else repair_text(content)
    if isinstance(content, Mapping):
        return repair_text(json.dumps(content, ensure_ascii=False))
    if isinstance(content, list):
        texts = []
        for p in content:
            if isinstance(p, str):
                texts.append(p)
            elif isinstance(p, Mapping) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                texts.append(p["text"])
            else:
                return content
        return repair_text("\n".join(texts))
    return content


def arguments_text(args: Any) -> Any:
    """A call's arguments as JSON text: an object is dumped, a string is kept as it came (it is
    parsed where it is rendered, so '{"a": 1}' and {"a": 1} render alike)."""
    if isinstance(args, (Mapping, list)):
        return json.dumps(args, ensure_ascii=False)
    return repair_text(args) if isinstance(args, str) else args


def _call(c: Any) -> Any:
    c = _json(c)
    if not isinstance(c, Mapping):
        return c
    fn = c.get("function")
    if fn is None and isinstance(c.get("name"), str):  # flat {name, arguments}
        fn = {"name": c["name"], "arguments": c.get("arguments")}
    fn = _json(fn)
    if not isinstance(fn, Mapping):
        return {"id": c.get("id"), "type": c.get("type") or "function", "function": fn}
    return {"id": c.get("id"), "type": c.get("type") or "function",
            "function": {"name": fn.get("name"), "arguments": arguments_text(fn.get("arguments"))}}


def message(m: Any) -> Any:
    """One turn in the v1 shape; a turn that is not an object passes through unchanged."""
    if not isinstance(m, Mapping):
        return m
    role = m.get("role")
    if isinstance(role, str):
        role = ROLE_ALIASES.get(role.strip().lower(), role)
    out: dict[str, Any] = {"role": role, "content": flatten_content(m.get("content"))}
    calls = _json(m.get("tool_calls"))
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [_call(c) for c in calls]
    elif calls not in (None, [], ""):
        out["tool_calls"] = calls  # not a list: normalise rejects it (bad_tool_call)
    reasoning = m.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        out["reasoning_content"] = repair_text(reasoning.strip())
    return out


def tool_schema(t: Any) -> dict[str, Any] | None:
    """One tool definition in the OpenAI shape `{"type": "function", "function": {name,
    description, parameters}}`, from that shape, a bare function object, or MCP's
    `{name, description, inputSchema}`; None when it is none of them."""
    t = _json(t)
    if not isinstance(t, Mapping):
        return None
    f = t["function"] if isinstance(t.get("function"), Mapping) else t
    if not isinstance(f.get("name"), str):
        return None
    # one key order (name, description, parameters), whatever came in: the schema is rendered as JSON text
    fn: dict[str, Any] = {"name": f["name"]}
    if f.get("description") is not None:
        fn["description"] = f["description"]
    params = f.get("parameters", f.get("inputSchema", f.get("input_schema")))
    fn["parameters"] = _json(params) if params is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def tool_schemas(tools: Any) -> list[dict[str, Any]]:
    """A `tools` value (a list, a JSON string of one, MCP `{"tools": [...]}`) -> definitions."""
    tools = _json(tools)
    if isinstance(tools, Mapping) and isinstance(tools.get("tools"), list):
        tools = tools["tools"]
    if not isinstance(tools, list):
        return []
    return [s for s in (tool_schema(t) for t in tools) if s is not None]


def _tools_from_system(messages: list[Any]) -> list[dict[str, Any]]:
    """Tool schemas written into the system prompt as `<tools>[...]</tools>` (a JSON list, or one
    JSON object per line); the block is removed from the prompt when it parses."""
    if not messages or not isinstance(messages[0], Mapping) or messages[0].get("role") != "system":
        return []
    text = messages[0].get("content")
    m = _TOOLS_BLOCK.search(text) if isinstance(text, str) else None
    if not m:
        return []
    body = m.group(1).strip()
    parsed = _json(body)
    if not isinstance(parsed, list):
        parsed = [_json(line) for line in body.splitlines() if line.strip()]
    schemas = tool_schemas(parsed)
    if not schemas or len(schemas) != len(parsed):
        return []
    rest = (text[: m.start()] + text[m.end():]).strip()
    messages[0] = {**messages[0], "content": rest}  # kept when empty: train_turns count every message
    return schemas


def _messages(rec: Mapping[str, Any]) -> list[Any] | None:
    msgs = _json(rec.get("messages"))
    if msgs is None and "input" in rec:  # OpenCodeReasoning / Llama-Nemotron: input (+ system_prompt) + output
        inp = _json(rec.get("input"))
        msgs = list(inp) if isinstance(inp, list) else [{"role": "user", "content": inp}]
        if isinstance(rec.get("system_prompt"), str) and rec["system_prompt"].strip():
            msgs.insert(0, {"role": "system", "content": rec["system_prompt"]})
        if rec.get("output") is not None:
            msgs.append({"role": "assistant", "content": rec.get("output")})
    if not isinstance(msgs, list):
        return msgs
    return [message(m) for m in msgs]


def _strings(v: Any) -> list[str]:
    v = _json(v)
    if v is None:
        return []
    if isinstance(v, list):
        return [str(x) for x in v if x is not None]
    return [str(v)]


def _first(*vals: Any) -> str | None:
    for v in vals:
        if v is not None and str(v).strip():
            return str(v)
    return None


def prompt_withheld(messages: Sequence[Any] | None) -> bool:
    """The system turn is null, or the first user turn is null / empty / a placeholder ("-")."""
    if not messages:
        return False
    turns = [m for m in messages if isinstance(m, Mapping)]
    if turns and turns[0].get("role") == "system" and turns[0].get("content") is None:
        return True
    user = next((m for m in turns if m.get("role") == "user"), None)
    return user is not None and (not isinstance(user.get("content"), str) or is_placeholder(user["content"]))


def restore_key(rec: Mapping[str, Any], meta: Mapping[str, Any]) -> RestoreKey | None:
    seed, sha = _first(meta.get("seed_dataset"), rec.get("seed_dataset")), \
        _first(meta.get("seed_prompt_sha256"), rec.get("seed_prompt_sha256"))
    if seed and sha:
        return RestoreKey(seed, "sha256", sha.strip().lower())
    dataset = _first(rec.get("dataset"), meta.get("dataset"))
    index = _first(rec.get("index"), meta.get("index"))
    if dataset and index is not None:
        split = _first(rec.get("split"), meta.get("split")) or "train"
        return RestoreKey(DATASET_HUB_IDS.get(dataset.strip().lower(), dataset.strip()), "index",
                          f"{split.strip()}/{index.strip()}")
    if seed:  # a seed named without a key: say so rather than "no source"
        return RestoreKey(seed, "sha256", "")
    return None


def _train_turns(v: Any) -> list[bool] | None:
    v = _json(v)
    if isinstance(v, list) and all(isinstance(x, bool) for x in v):
        return list(v)
    return None if v is None else []  # present but not booleans: a length that never matches


def from_record(rec: Mapping[str, Any]) -> FamilyRecord:
    raw_meta = rec.get("metadata")
    meta = _json(raw_meta)
    meta_is_dict = isinstance(meta, Mapping)
    meta = dict(meta) if meta_is_dict else {}
    messages = _messages(rec)
    moved: dict[str, Any] = {}
    meta_tools = meta.get("tools")
    schemas = tool_schemas(rec.get("tools")) if rec.get("tools") is not None else []
    if schemas:
        moved["tools"] = schemas
    elif meta_tools is not None:
        canonical = tool_schemas(meta_tools)
        if canonical != meta_tools:  # not already OpenAI-shaped: the canonical list replaces it
            moved["tools"] = canonical
    elif isinstance(messages, list):
        from_system = _tools_from_system(messages)
        if from_system:
            moved["tools"] = from_system
    turns = _train_turns(meta.get("train_turns", rec.get("train_turns")))
    if turns is not None and "train_turns" not in meta:
        moved["train_turns"] = turns
    if moved or (raw_meta is not None and not isinstance(raw_meta, str)):
        metadata = json.dumps({**meta, **moved}, ensure_ascii=False) if (meta or moved) else None
    else:
        metadata = raw_meta  # a string kept byte for byte (v1)
    rid = _first(rec.get("uuid"), rec.get("id"))
    return FamilyRecord(
        id=rid, messages=messages, metadata=metadata,
        license=_first(rec.get("license"), meta.get("license")),
        generator=_first(rec.get("generator"), rec.get("model"), meta.get("generator"), meta.get("model")),
        used_in=_strings(rec.get("used_in", rec.get("used_in_training", meta.get("used_in")))),
        seed_dataset=_first(meta.get("seed_dataset"), rec.get("seed_dataset")),
        restore=restore_key(rec, meta) if prompt_withheld(messages) else None,
        train_turns=turns,
    )


def restore_messages(messages: list[Any], prompt: str, system: str | None) -> list[Any]:
    """The withheld turns filled from the seed: the first user turn gets `prompt`; a withheld (null)
    system turn gets the seed's system prompt, or "" (no system prompt, the turn kept so that
    `train_turns` still count every message) when the seed has none."""
    out = list(messages)
    if out and isinstance(out[0], Mapping) and out[0].get("role") == "system" and out[0].get("content") is None:
        out[0] = {**out[0], "content": system if system is not None and system.strip() else ""}
    for i, m in enumerate(out):
        if isinstance(m, Mapping) and m.get("role") == "user":
            if not isinstance(m.get("content"), str) or is_placeholder(m["content"]):
                out[i] = {**m, "content": prompt}
            break
    return out
