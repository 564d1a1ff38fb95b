"""Turn a record's `messages` into question, answer, reasoning trace and context (pure Python).

DESIGN.md "enrich": the question is the last user turn that an assistant turn answers, the
answer is that assistant turn, the context is everything before the question plus the tool
calls / tool results / interim assistant text between question and answer. Anything that
cannot be normalised raises `Rejected` with a stable reason code (the manifest counts by it).

Reason codes: empty_messages, bad_message, unknown_role, bad_content, roles_out_of_order,
bad_tool_call, bad_tool_arguments, no_answered_question, prompt_withheld (the question is empty or
a placeholder such as "-", as in v1's `code` split, or a system / user turn before the answer is
null: withheld and not restored), content_withheld (a tool result or an earlier assistant turn is
null: never rendered as "None" or as an empty turn), empty_answer.

An assistant turn's reasoning is its `reasoning_content` (the SFT collection; null, empty or white
space = none) or else its `<think>` block (v1/v2): `message_parts`.

Context units (for the relevance scores only; the filter renders the conversation itself from
`messages`) come from `sentences.split_units`: structured blocks whole, prose as sentences. Each
turn's text is bounded (`max_turn_chars`) before it is cut, so one huge turn cannot stall a task.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from spark_jobs.conversations.sentences import split_units

ROLES = ("system", "user", "assistant", "tool")
ReasoningMode = Literal["separate", "drop", "inline"]

_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>(.*)$", re.DOTALL | re.IGNORECASE)  # unclosed: the rest is thinking
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)  # a lone close: everything before it was thinking
PLACEHOLDER_PROMPTS = frozenset({"", "-", "--", "—", "n/a", "none", "null", "<empty>"})


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Normalised:
    question: str
    answer: str
    reasoning_trace: str | None
    context_sentences: list[str] = field(default_factory=list)
    context_turns: list[int] = field(default_factory=list)  # index in `messages` of each context unit


def split_reasoning(content: str) -> tuple[str, str | None]:
    """(visible text, reasoning trace or None): `<think>` blocks removed from the text and joined
    into the trace. An unclosed `<think>` makes the rest of the text reasoning; a `</think>` with no
    opening (templates that put `<think>` in the prompt) makes the text before it reasoning."""
    traces = [m.strip() for m in _THINK_BLOCK.findall(content)]
    visible = _THINK_BLOCK.sub("", content)
    lone = max(_THINK_CLOSE.finditer(visible), key=lambda m: m.start(), default=None)
    if lone is not None:
        traces.insert(0, visible[: lone.start()].strip())
        visible = visible[lone.end():]
    m = _THINK_OPEN.search(visible)
    if m:
        traces.append(m.group(1).strip())
        visible = visible[: m.start()]
    trace = "\n\n".join(t for t in traces if t) or None
    return visible.strip(), trace


def message_parts(m: Mapping[str, Any]) -> tuple[str, str | None]:
    """(visible text, reasoning trace or None) of an assistant turn: `reasoning_content` when it
    has text, else the `<think>` block of its content."""
    visible, trace = split_reasoning(m.get("content") or "")
    rc = m.get("reasoning_content")
    if isinstance(rc, str) and rc.strip():
        trace = rc.strip()
    return visible, trace


def render_tool_call(call: Mapping[str, Any]) -> str:
    """`name(arguments)`: one context unit per call; arguments must be JSON (an object, usually)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise Rejected("bad_tool_call", f"tool call without a function name: {call!r:.200}")
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        args = "{}"
    elif isinstance(args, str):
        try:
            json.loads(args)
        except ValueError as e:
            raise Rejected("bad_tool_arguments", f"{fn['name']}: {e}") from None
    else:  # already structured (JSON Lines input)
        args = json.dumps(args, ensure_ascii=False)
    return f"{fn['name']}({args})"


def _check_shape(messages: Sequence[Any]) -> list[Mapping[str, Any]]:
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise Rejected("bad_message", f"turn {i} is {type(m).__name__}, not an object")
        role = m.get("role")
        if not isinstance(role, str) or role.strip().lower() not in ROLES:
            raise Rejected("unknown_role", f"turn {i} has role {role!r}; expected one of {ROLES}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise Rejected("bad_content", f"turn {i} content is {type(content).__name__}, not text")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, Sequence):
            raise Rejected("bad_tool_call", f"turn {i} tool_calls is not a list")
        turns.append(m)
    prev_calls = False
    for i, m in enumerate(turns):
        role = m["role"].strip().lower()
        if role == "system" and i != 0:
            raise Rejected("roles_out_of_order", f"system turn at position {i}; only the first turn may be system")
        if role == "tool" and not prev_calls:
            raise Rejected("roles_out_of_order", f"tool result at position {i} without a preceding tool call")
        if role == "assistant":
            prev_calls = bool(m.get("tool_calls"))
        elif role != "tool":
            prev_calls = False
    return turns


def _role(m: Mapping[str, Any]) -> str:
    return m["role"].strip().lower()


def is_placeholder(text: str | None) -> bool:
    """A withheld prompt: empty, white space, or a stand-in such as "-"."""
    return text is None or " ".join(text.split()).lower() in PLACEHOLDER_PROMPTS


def _units(m: Mapping[str, Any], max_turn_chars: int) -> list[str]:
    """Context units of one turn: its text's units (earlier reasoning removed), then one unit per
    tool call. A tool result that is JSON is one unit (splitting JSON on '.' makes no sense)."""
    content = (m.get("content") or "")[:max_turn_chars]
    role = _role(m)
    out: list[str] = []
    if role == "tool":
        try:
            json.loads(content)
            out.append(content.strip())
        except (ValueError, RecursionError):
            out.extend(split_units(content))
    else:
        if role == "assistant":
            content, _ = split_reasoning(content)
        out.extend(split_units(content))
    for call in m.get("tool_calls") or ():
        out.append(render_tool_call(call))
    return [u for u in out if u]


def normalise(
    messages: Sequence[Any] | None,
    *,
    reasoning: ReasoningMode = "separate",
    max_context_sentences: int = 256,
    max_sentence_chars: int = 2000,
    max_turn_chars: int = 200_000,
) -> Normalised:
    if not messages:
        raise Rejected("empty_messages", "messages is null or empty")
    turns = _check_shape(messages)
    for m in turns:  # every tool call must be well-formed, used in the context or not
        for call in m.get("tool_calls") or ():
            render_tool_call(call)

    # The answer: the last assistant turn with text that some user turn precedes.
    first_user = next((i for i, m in enumerate(turns) if _role(m) == "user"), None)
    a = None
    if first_user is not None:
        for i in range(len(turns) - 1, first_user, -1):
            if _role(turns[i]) == "assistant" and (turns[i].get("content") or "").strip():
                a = i
                break
    if a is None:
        raise Rejected("no_answered_question", "no assistant turn with text answers a user turn")
    q = max(i for i in range(a) if _role(turns[i]) == "user")
    question = (turns[q].get("content") or "").strip()
    if is_placeholder(question):
        raise Rejected("prompt_withheld", f"the user turn {q} answered by turn {a} is {question!r} (withheld or placeholder)")
    for i in range(a):
        m = turns[i]
        if m.get("content") is None and _role(m) in ("system", "user"):
            raise Rejected("prompt_withheld", f"the {_role(m)} turn {i} is null (withheld, not restored)")
        if m.get("content") is None and (_role(m) == "tool" or not m.get("tool_calls")):
            raise Rejected("content_withheld", f"the {_role(m)} turn {i} is null (withheld); it is never rendered")

    raw_answer = turns[a]["content"]
    visible, trace = message_parts(turns[a])
    if not visible:
        raise Rejected("empty_answer", f"assistant turn {a} holds only a reasoning trace")
    if reasoning == "inline":
        rc = turns[a].get("reasoning_content")
        answer = (f"<think>\n{trace}\n</think>\n\n{visible}" if isinstance(rc, str) and rc.strip()
                  else raw_answer.strip())
        trace = None
    elif reasoning == "drop":
        answer, trace = visible, None
    else:
        answer = visible

    units: list[tuple[int, str]] = []
    for i in [*range(q), *range(q + 1, a)]:
        units.extend((i, u) for u in _units(turns[i], max_turn_chars))
    # Very long contexts: keep the units nearest the question, each bounded in length.
    units = units[-max_context_sentences:]
    return Normalised(question=question, answer=answer, reasoning_trace=trace,
                      context_sentences=[u[:max_sentence_chars] for _, u in units], context_turns=[i for i, _ in units])
