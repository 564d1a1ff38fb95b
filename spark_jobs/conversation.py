"""A record's `messages` as the conversation the model is trained on (pure Python, no Spark).

`build_conversation` keeps every turn, in order, up to and including the final answer (the last
assistant turn with text that a user turn precedes; turns after it have no answer to learn):

- the first turn, when it is `system`, becomes the conversation's system prompt (each chat
  template places it its own way); with `train_on_reasoning` the record's mode is appended to it
  as a marker line (`/think` / `/no_think`, Nemotron's own convention; configurable);
- assistant turns keep only their visible text; the final answer keeps its reasoning trace as
  `<think>\\n...\\n</think>\\n\\n` before the text only with `train_on_reasoning` (a lone `</think>`
  counts: the text before it is the trace);
- tool calls stay on their assistant turn; each tool result answers the call at its position
  (the k-th result after a calling turn answers its k-th call), which gives it the call's name
  and id; the record's tool schemas come from `metadata` (`{"tools": [...]}`, as in v1's
  `tool_calling` split; bare function objects are wrapped as `{"type": "function", ...}`).

`prompt_text` / `dedup_text` are the canonical texts the split and exact dedup hash: NFKC,
Unicode white space collapsed, case folded, turns tagged by role; independent of the tokenizer,
so changing the base model never moves a prompt between train and validation.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spark_jobs.normalize import split_reasoning

THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


class RenderError(ValueError):
    """The record cannot be rendered as asked; `reason` is the reject reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


RENDER_FAILED = "render_failed"
TEMPLATE_UNSUPPORTED = "template_unsupported"


@dataclass(frozen=True)
class ToolCall:
    id: str | None
    name: str
    arguments: str  # JSON text, as in the dataset


@dataclass(frozen=True)
class Turn:
    role: str  # user | assistant | tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_name: str | None = None  # tool turns: the call this result answers
    tool_call_id: str | None = None


@dataclass(frozen=True)
class Conversation:
    system: str | None
    turns: tuple[Turn, ...]
    tools: tuple[dict[str, Any], ...] = ()

    def to_messages(self) -> list[dict[str, Any]]:
        """OpenAI/HF-style messages (what `apply_chat_template` takes)."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns:
            m: dict[str, Any] = {"role": t.role, "content": t.content}
            if t.tool_calls:
                m["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                                   for c in t.tool_calls]
            if t.role == "tool":
                m["name"], m["tool_call_id"] = t.tool_name, t.tool_call_id
            out.append(m)
        return out


@dataclass(frozen=True)
class ConversationOptions:
    train_on_reasoning: bool = False
    marker_on: str = "/think"
    marker_off: str = "/no_think"
    # with train_on_reasoning: earlier assistant turns keep their traces too (filter.overflow
    # drop_earlier_reasoning renders so first and drops them only from a row that would not fit)
    earlier_reasoning: bool = False


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except (ValueError, RecursionError):
        return s


def tool_schemas(metadata: str | None) -> tuple[dict[str, Any], ...]:
    """Tool definitions from the record's metadata JSON (`tools` list); () when there are none."""
    if not metadata:
        return ()
    try:
        meta = json.loads(metadata)
    except (ValueError, RecursionError):
        return ()
    tools = meta.get("tools") if isinstance(meta, Mapping) else None
    if isinstance(tools, str):
        tools = _json_or_text(tools)
    if not isinstance(tools, list):
        return ()
    out = []
    for t in tools:
        if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping):
            out.append(dict(t))
        elif isinstance(t, Mapping) and isinstance(t.get("name"), str):
            out.append({"type": "function", "function": dict(t)})
    return tuple(out)


def _answer_index(msgs: Sequence[Mapping[str, Any]]) -> int:
    roles = [str(m.get("role") or "").strip().lower() for m in msgs]
    first_user = next((i for i, r in enumerate(roles) if r == "user"), None)
    if first_user is not None:
        for i in range(len(msgs) - 1, first_user, -1):
            if roles[i] == "assistant" and split_reasoning(msgs[i].get("content") or "")[0]:
                return i
    raise RenderError(RENDER_FAILED, "no assistant turn with visible text answers a user turn")


def build_conversation(messages: Sequence[Mapping[str, Any]], metadata: str | None, reasoning: str | None,
                       opts: ConversationOptions) -> Conversation:
    if not messages:
        raise RenderError(RENDER_FAILED, "messages is empty")
    a = _answer_index(messages)
    msgs = list(messages[: a + 1])
    system = None
    if str(msgs[0].get("role") or "").strip().lower() == "system":
        system = (msgs.pop(0).get("content") or "").strip() or None
    if opts.train_on_reasoning and reasoning in ("on", "off"):
        marker = opts.marker_on if reasoning == "on" else opts.marker_off
        system = f"{system}\n\n{marker}" if system else marker
    turns: list[Turn] = []
    pending: list[ToolCall] = []
    last = len(msgs) - 1
    for i, m in enumerate(msgs):
        role = str(m.get("role") or "").strip().lower()
        content = m.get("content") or ""
        if role == "user":
            turns.append(Turn("user", content.strip()))
            pending = []
        elif role == "assistant":
            visible, trace = split_reasoning(content)
            if opts.train_on_reasoning and trace and (i == last or opts.earlier_reasoning):
                visible = f"{THINK_OPEN}{trace}{THINK_CLOSE}{visible}"
            calls = tuple(
                ToolCall(c.get("id"), c["function"]["name"], _arguments(c["function"].get("arguments")))
                for c in (m.get("tool_calls") or ())
            )
            if not visible and not calls:
                raise RenderError(RENDER_FAILED, f"assistant turn {i} has neither text nor tool calls")
            turns.append(Turn("assistant", visible, calls))
            pending = list(calls)
        elif role == "tool":
            call = pending.pop(0) if pending else None
            turns.append(Turn("tool", content.strip(), (), call.name if call else None, call.id if call else None))
        else:
            raise RenderError(RENDER_FAILED, f"turn {i} has role {role!r}")
    return Conversation(system, tuple(turns), tool_schemas(metadata))


def _arguments(args: Any) -> str:
    if args is None or (isinstance(args, str) and not args.strip()):
        return "{}"
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def normalise_text(text: str) -> str:
    """NFKC, every run of Unicode white space -> one space, case folded."""
    return " ".join(unicodedata.normalize("NFKC", text).split()).casefold()


def _canonical(conv: Conversation, turns: Sequence[Turn]) -> str:
    parts = [f"system\u0001{normalise_text(conv.system or '')}"]
    for t in turns:
        calls = "".join(f"\u0002{normalise_text(c.name)}({normalise_text(c.arguments)})" for c in t.tool_calls)
        parts.append(f"{t.role}\u0001{normalise_text(t.content)}{calls}")
    return "\u0003".join(parts)


def prompt_text(conv: Conversation) -> str:
    """The prompt the split hashes: the conversation up to (not including) the final answer."""
    return _canonical(conv, conv.turns[:-1])


def dedup_text(conv: Conversation) -> str:
    """What exact deduplication hashes: the whole conversation, final answer included."""
    return _canonical(conv, conv.turns)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
