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

Per-turn training flags (`metadata.train_turns`, one boolean per message; with
`ConversationOptions.use_flags`): the conversation ends at the last trained assistant turn, and
each assistant `Turn.trained` says whether the loss looks at it (`Conversation.flags`). With
`train_on_reasoning`, a trained earlier turn that has reasoning becomes its own prefix document
with its reasoning (`build_documents`); the whole conversation then trains its other flagged turns.
A flag list whose length is not the messages' is `bad_train_turns`.

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

from spark_jobs.conversations.family import tool_schemas as family_tool_schemas
from spark_jobs.conversations.normalize import message_parts, split_reasoning

THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


class RenderError(ValueError):
    """The record cannot be rendered as asked; `reason` is the reject reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


RENDER_FAILED = "render_failed"
BAD_TRAIN_TURNS = "bad_train_turns"
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
    trained: bool | None = None  # assistant turns of a flagged record: the loss looks at it


@dataclass(frozen=True)
class Conversation:
    system: str | None
    turns: tuple[Turn, ...]
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def flags(self) -> tuple[bool, ...] | None:
        """Per assistant turn, in order: trained or not; None when the record has no flags."""
        if not any(t.trained is not None for t in self.turns):
            return None
        return tuple(bool(t.trained) for t in self.turns if t.role == "assistant")

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
    use_flags: bool = False  # metadata.train_turns decide the trained turns (filter.train_on=dataset_flags)


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except (ValueError, RecursionError):
        return s


def tool_schemas(metadata: str | None) -> tuple[dict[str, Any], ...]:
    """Tool definitions from the record's metadata JSON (`tools`, any shape `family.tool_schema`
    reads, MCP's included); () when there are none."""
    meta = _metadata(metadata)
    return tuple(family_tool_schemas(meta.get("tools"))) if "tools" in meta else ()


def _metadata(metadata: str | None) -> dict[str, Any]:
    if not metadata:
        return {}
    try:
        meta = json.loads(metadata)
    except (ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def train_turns(metadata: str | None) -> list[bool] | None:
    """`metadata.train_turns` (one boolean per message) or None when the record has none."""
    flags = _metadata(metadata).get("train_turns")
    if flags is None:
        return None
    return list(flags) if isinstance(flags, list) and all(isinstance(f, bool) for f in flags) else []


def _answer_index(msgs: Sequence[Mapping[str, Any]]) -> int:
    roles = [str(m.get("role") or "").strip().lower() for m in msgs]
    first_user = next((i for i, r in enumerate(roles) if r == "user"), None)
    if first_user is not None:
        for i in range(len(msgs) - 1, first_user, -1):
            if roles[i] == "assistant" and split_reasoning(msgs[i].get("content") or "")[0]:
                return i
    raise RenderError(RENDER_FAILED, "no assistant turn with visible text answers a user turn")


def _flags(messages: Sequence[Mapping[str, Any]], metadata: str | None, opts: ConversationOptions) -> list[bool] | None:
    if not opts.use_flags:
        return None
    flags = train_turns(metadata)
    if flags is not None and len(flags) != len(messages):
        raise RenderError(BAD_TRAIN_TURNS, f"metadata.train_turns has {len(flags)} entries for {len(messages)} messages")
    return flags


def _trained_turns(messages: Sequence[Mapping[str, Any]], flags: list[bool]) -> list[int]:
    out = [i for i, (m, f) in enumerate(zip(messages, flags, strict=True))
           if f and str(m.get("role") or "").strip().lower() == "assistant"
           and (message_parts(m)[0] or m.get("tool_calls"))]
    if not out:
        raise RenderError(BAD_TRAIN_TURNS, "metadata.train_turns marks no assistant turn with text or tool calls")
    return out


def build_conversation(messages: Sequence[Mapping[str, Any]], metadata: str | None, reasoning: str | None,
                       opts: ConversationOptions) -> Conversation:
    """The whole conversation (the record's last document: `build_documents(...)[-1]`)."""
    return build_documents(messages, metadata, reasoning, opts)[-1]


def build_documents(messages: Sequence[Mapping[str, Any]], metadata: str | None, reasoning: str | None,
                    opts: ConversationOptions) -> list[Conversation]:
    """The documents one record trains: with flags and `train_on_reasoning`, one prefix conversation
    per trained earlier turn that has reasoning (trained on that turn only, with its reasoning),
    then the whole conversation; otherwise the whole conversation alone."""
    if not messages:
        raise RenderError(RENDER_FAILED, "messages is empty")
    flags = _flags(messages, metadata, opts)
    if flags is None:
        a = _answer_index(messages)
        return [_build(messages, metadata, reasoning, opts, a, None)]
    trained = _trained_turns(messages, flags)
    a = trained[-1]
    own = [k for k in trained[:-1] if opts.train_on_reasoning and message_parts(messages[k])[1]]
    docs = [_build(messages, metadata, reasoning, opts, k, {k}) for k in own]
    docs.append(_build(messages, metadata, reasoning, opts, a, set(trained) - set(own)))
    return docs


def _build(messages: Sequence[Mapping[str, Any]], metadata: str | None, reasoning: str | None,
           opts: ConversationOptions, a: int, trained: set[int] | None) -> Conversation:
    """Messages up to and including turn `a` (whose reasoning is shown with `train_on_reasoning`);
    `trained`: indices of the trained assistant turns, None = unflagged."""
    msgs = list(messages[: a + 1])
    offset = 0
    system = None
    if str(msgs[0].get("role") or "").strip().lower() == "system":
        system = (msgs.pop(0).get("content") or "").strip() or None
        offset = 1
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
            visible, trace = message_parts(m)
            if opts.train_on_reasoning and trace and (i == last or opts.earlier_reasoning):
                visible = f"{THINK_OPEN}{trace}{THINK_CLOSE}{visible}"
            calls = tuple(
                ToolCall(c.get("id"), c["function"]["name"], _arguments(c["function"].get("arguments")))
                for c in (m.get("tool_calls") or ())
            )
            if not visible and not calls:
                raise RenderError(RENDER_FAILED, f"assistant turn {i} has neither text nor tool calls")
            turns.append(Turn("assistant", visible, calls,
                              trained=None if trained is None else (i + offset) in trained))
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
        flag = "" if t.trained is None else f"\u0004{int(t.trained)}"  # flagged rows differ by what they train
        parts.append(f"{t.role}\u0001{normalise_text(t.content)}{calls}{flag}")
    return "\u0003".join(parts)


def prompt_text(conv: Conversation) -> str:
    """The prompt the split hashes: the conversation up to (not including) the final answer."""
    return _canonical(conv, conv.turns[:-1])


def seed_prompt_key(metadata: str | None) -> str | None:
    """Rows cut from one seed conversation (the SFT collection: `metadata.seed_dataset` +
    `seed_prompt_sha256`) are one prompt for the split, whatever turns each row keeps."""
    meta = _metadata(metadata)
    seed, sha = meta.get("seed_dataset"), meta.get("seed_prompt_sha256")
    if isinstance(seed, str) and isinstance(sha, str) and seed.strip() and sha.strip():
        return f"seed\u0001{seed.strip()}\u0001{sha.strip().lower()}"
    return None


def dedup_text(conv: Conversation) -> str:
    """What exact deduplication hashes: the whole conversation, final answer included."""
    return _canonical(conv, conv.turns)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
