"""Render a conversation with the base model's chat template: token ids + which tokens are trained.

`ChatTokenizer.render(conversation, train_on)` returns `Rendered(input_ids, targets)`: the ids the
model sees for the whole conversation and, per token, whether the loss looks at it. Targets are
the assistant turns' tokens including each turn's end-of-turn token (`</s>`); system prompt, user
turns, tool schemas and tool results are never targets. `train_on="last_assistant_turn"` keeps
only the final answer as target.

Tokenizers, by `filter.tokenizer`:
  - `mistral-v1` (default; Mistral-7B-v0.1 / Instruct-v0.1), `mistral-v3`: the tokenizer files
    shipped in `mistral-common`; the ids are exactly `encode_instruct`'s for the conversation
    (system prompt as mistral-common places it: v1 merges it into the first user turn, v3 into the
    last). The targets come from walking encode_instruct's own per-message encoders in its order;
    at load the walk is checked against `encode_instruct` on probe conversations, so a changed
    mistral-common fails loudly instead of shifting the mask. v3 renders tools natively
    (`[AVAILABLE_TOOLS]`, `[TOOL_CALLS]` as a target, `[TOOL_RESULTS]` masked). v1 has no tool
    tokens: tool schemas are appended to the system prompt as `[AVAILABLE_TOOLS] <json>
    [/AVAILABLE_TOOLS]`, a call is an assistant turn `[TOOL_CALLS] <json list of {name,
    arguments}>` (trained), and consecutive tool results are one user turn `[TOOL_RESULTS] <json
    list of {name, content}> [/TOOL_RESULTS]` (masked), in conversation order.
  - any other value: a Hugging Face tokenizer directory or hub id, rendered with its own
    `chat_template` (`tools=` passed when the record has schemas). The assistant mask comes from
    the template: its `{% generation %}` blocks when it has them, otherwise the ids of each
    prefix ending at an assistant turn (`add_generation_prompt=True`) and including it, up to its
    last eos (a separator written after it is not trained). Refused at load, naming the tokenizer:
    no eos, no chat_template, a template whose prefix is not a prefix of the whole rendering, or
    one whose mask does not cover a probe answer (generation block in the wrong place).
`TokenizerSpec` (pipeline_core.handoffs) records the identity, including a Jinja chat template
equivalent to the rendering (the model's own for HF; for mistral-common, `chat_templates`'
`MISTRAL_V1_TEMPLATE` / `MISTRAL_V3_TEMPLATE`, whose `apply_chat_template` gives the renderer's
ids), so exported models render the same way. Pure Python: loaded once per Spark executor process through `load_tokenizer`'s cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline_core.handoffs import TokenizerSpec
from pipeline_core.hf_tokenizer import MISTRAL_COMMON_FILES, mistral_common_file
from spark_jobs.conversations.chat_templates import MISTRAL_V1_TEMPLATE, MISTRAL_V3_TEMPLATE
from spark_jobs.conversations.conversation import (
    RENDER_FAILED,
    TEMPLATE_UNSUPPORTED,
    Conversation,
    RenderError,
    ToolCall,
    Turn,
)

TrainOn = Literal["all_assistant_turns", "last_assistant_turn", "dataset_flags"]

@dataclass(frozen=True)
class Rendered:
    input_ids: list[int]
    targets: list[bool]  # per token: the loss looks at it

    @property
    def n_targets(self) -> int:
        return sum(self.targets)


class ChatTokenizer(ABC):
    """Template + tokenizer of one `filter.tokenizer` spec."""

    spec: str
    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int

    @abstractmethod
    def render(self, conv: Conversation, train_on: TrainOn = "all_assistant_turns") -> Rendered: ...

    @abstractmethod
    def count(self, text: str) -> int:
        """Tokens of plain text (for budgets)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def chat_template(self) -> str | None: ...

    def template_messages(self, conv: Conversation) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) whose `apply_chat_template` with `chat_template()` gives this renderer's ids:
        what the filter keeps of sampled documents and the trainer renders at export."""
        return conv.to_messages(), list(conv.tools) or None

    def spec_for_manifest(self) -> TokenizerSpec:
        return TokenizerSpec(name=self.spec, vocab_size=self.vocab_size, bos_id=self.bos_id, eos_id=self.eos_id,
                             pad_id=self.pad_id, chat_template=self.chat_template())

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """Details beyond TokenizerSpec (files, hashes, versions) for the manifest."""


def _spans_to_targets(spans: list[tuple[int, int, bool]], n: int) -> list[bool]:
    targets = [False] * n
    for start, end, is_target in spans:
        if is_target:
            targets[start:end] = [True] * (end - start)
    return targets


def _choose_targets(spans: list[tuple[int, int, bool]], train_on: TrainOn,
                    flags: Sequence[bool] | None = None) -> list[tuple[int, int, bool]]:
    """`dataset_flags`: the k-th assistant span is trained iff the conversation's k-th assistant
    turn is flagged (`Conversation.flags`); a conversation without flags trains every turn."""
    if train_on == "dataset_flags" and flags is not None:
        n = sum(1 for s in spans if s[2])
        if n != len(flags):
            raise RenderError(RENDER_FAILED, f"{n} assistant spans for {len(flags)} flagged assistant turns")
        it = iter(flags)
        return [(a, b, t and next(it)) for a, b, t in spans]
    if train_on in ("all_assistant_turns", "dataset_flags"):
        return spans
    last = max((i for i, s in enumerate(spans) if s[2]), default=None)
    return [(a, b, t and i == last) for i, (a, b, t) in enumerate(spans)]


_CALL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def _v3_call_id(call: ToolCall, turn: int, k: int) -> str:
    """mistral v3 call ids are 9 alphanumerics; other ids (v1 data has 'call_...' or none) get a
    deterministic one from their position, shared by the call and its result."""
    if call.id and _CALL_ID.match(call.id):
        return call.id
    return hashlib.sha256(f"{call.id}:{turn}:{k}".encode()).hexdigest()[:9]


def _v3_turn_ids(conv: Conversation) -> list[tuple[str, ...]]:
    """Per turn, the call ids v3 encodes: an assistant turn's calls' ids, a tool result's call id (the
    k-th result after a calling turn answers its k-th call; '000000000' when no call is pending)."""
    out: list[tuple[str, ...]] = []
    pending: list[str] = []
    for i, t in enumerate(conv.turns):
        if t.role == "assistant" and t.tool_calls:
            pending = [_v3_call_id(c, i, k) for k, c in enumerate(t.tool_calls)]
            out.append(tuple(pending))
        elif t.role == "tool":
            out.append((pending.pop(0) if pending else "000000000",))
        else:
            out.append(())
    return out


class MistralCommonTokenizer(ChatTokenizer):
    def __init__(self, spec: str):
        import mistral_common
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.spec = spec
        self.path = mistral_common_file(spec)
        self._mt = MistralTokenizer.from_file(str(self.path))
        self._inst = self._mt.instruct_tokenizer
        self._tok = self._inst.tokenizer
        self.native_tools = spec != "mistral-v1"
        self.bos_id, self.eos_id = self._tok.bos_id, self._tok.eos_id
        # No pad token in these vocabularies: pad with <unk> (id 0), which never occurs in encoded text,
        # so padding cannot be confused with a real end of sequence.
        self.pad_id = self._tok.pad_id if self._tok.pad_id >= 0 else self._tok.unk_id
        self.vocab_size = self._tok.n_words
        self._version = mistral_common.__version__
        self._check_walk()

    # -- conversation -> mistral-common request
    def request(self, conv: Conversation):
        from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
        from mistral_common.protocol.instruct.request import InstructRequest
        from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool
        from mistral_common.protocol.instruct.tool_calls import ToolCall as MToolCall

        if not self.native_tools:
            return InstructRequest(messages=self._v1_messages(conv), system_prompt=self._v1_system(conv))
        msgs: list[Any] = []
        for i, (t, cids) in enumerate(zip(conv.turns, _v3_turn_ids(conv), strict=True)):
            if t.role == "user":
                msgs.append(UserMessage(content=t.content))
            elif t.role == "assistant" and t.tool_calls:
                if t.content:
                    raise RenderError(TEMPLATE_UNSUPPORTED, f"{self.spec}: assistant turn {i} has both text and tool "
                                      "calls, which mistral-common v3 cannot encode in one turn")
                msgs.append(AssistantMessage(tool_calls=[
                    MToolCall(id=cid, function=FunctionCall(name=c.name, arguments=c.arguments))
                    for cid, c in zip(cids, t.tool_calls, strict=True)]))
            elif t.role == "assistant":
                msgs.append(AssistantMessage(content=t.content))
            else:
                msgs.append(ToolMessage(content=t.content, tool_call_id=cids[0], name=t.tool_name))
        tools = []
        for s in conv.tools:
            f = s["function"]
            tools.append(Tool(function=Function(name=f["name"], description=f.get("description", ""),
                                                parameters=f.get("parameters") or {})))
        return InstructRequest(messages=msgs, system_prompt=conv.system, available_tools=tools or None)

    @staticmethod
    def _v1_system(conv: Conversation) -> str | None:
        if not conv.tools:
            return conv.system
        tools = f"[AVAILABLE_TOOLS] {json.dumps(list(conv.tools), ensure_ascii=False)} [/AVAILABLE_TOOLS]"
        return f"{conv.system}\n\n{tools}" if conv.system else tools

    @staticmethod
    def _v1_messages(conv: Conversation) -> list[Any]:
        from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage

        out: list[Any] = []
        results: list[dict[str, Any]] = []

        def flush():
            if results:
                out.append(UserMessage(content=f"[TOOL_RESULTS] {json.dumps(results, ensure_ascii=False)} [/TOOL_RESULTS]"))
                results.clear()

        for t in conv.turns:
            if t.role == "tool":
                results.append({"name": t.tool_name, "content": _maybe_json(t.content)})
                continue
            flush()
            if t.role == "user":
                out.append(UserMessage(content=t.content))
            elif t.tool_calls:
                calls = json.dumps([{"name": c.name, "arguments": _maybe_json(c.arguments)} for c in t.tool_calls],
                                   ensure_ascii=False)
                text = f"{t.content}\n\n[TOOL_CALLS] {calls}" if t.content else f"[TOOL_CALLS] {calls}"
                out.append(AssistantMessage(content=text))
            else:
                out.append(AssistantMessage(content=t.content))
        flush()
        return out

    # -- the walk: encode_instruct's loop, recording which message made which tokens
    def _walk(self, req) -> tuple[list[int], list[tuple[int, int, bool]]]:
        from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage

        first_user, last_user = self._inst.find_first_last_user(req)
        tokens = list(self._inst.start())
        spans: list[tuple[int, int, bool]] = []
        for i, msg in enumerate(req.messages):
            if isinstance(msg, UserMessage):
                new = self._inst.encode_user_message(msg, req.available_tools, i == last_user, i == first_user,
                                                     system_prompt=req.system_prompt, force_img_first=True,
                                                     settings=req.settings)[0]
            elif isinstance(msg, ToolMessage):
                new = self._inst.encode_tool_message(msg, i < last_user)[0]
            elif isinstance(msg, AssistantMessage):
                new = self._inst.encode_assistant_message(message=msg, is_before_last_user_message=i < last_user)
            else:
                raise RenderError(RENDER_FAILED, f"unexpected message type {type(msg).__name__}")
            spans.append((len(tokens), len(tokens) + len(new), isinstance(msg, AssistantMessage)))
            tokens.extend(new)
        return tokens, spans

    def reference_ids(self, conv: Conversation) -> list[int]:
        """mistral-common's own `encode_instruct` of the conversation (tests and the load check)."""
        return list(self._inst.encode_instruct(self.request(conv)).tokens)

    def _check_walk(self) -> None:
        probes = [
            Conversation("Be brief.", (Turn("user", "Hi"), Turn("assistant", "Hello!"), Turn("user", "2+2?"),
                                       Turn("assistant", "4"))),
            Conversation(None, (Turn("user", "Weather?"), Turn("assistant", "", (ToolCall("abcdefghi", "w", "{}"),)),
                                Turn("tool", '{"t": 1}', (), "w", "abcdefghi"), Turn("assistant", "1 degree"))),
        ]
        for p in probes:
            if self._walk(self.request(p))[0] != self.reference_ids(p):
                raise RuntimeError(f"mistral-common {self._version}: the per-message walk no longer reproduces "
                                   f"encode_instruct for {self.spec}; the loss mask would be wrong")

    def render(self, conv: Conversation, train_on: TrainOn = "all_assistant_turns") -> Rendered:
        try:
            req = self.request(conv)
            if hasattr(self._inst, "_validate_tool_results"):
                self._inst._validate_tool_results(request=req)
            ids, spans = self._walk(req)
        except RenderError:
            raise
        except Exception as e:  # noqa: BLE001 - mistral-common refuses a shape: a reject, not a crash
            raise RenderError(TEMPLATE_UNSUPPORTED, f"{self.spec}: {type(e).__name__}: {e}"[:500]) from None
        return Rendered(ids, _spans_to_targets(_choose_targets(spans, train_on, conv.flags), len(ids)))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, bos=False, eos=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def chat_template(self) -> str:
        return MISTRAL_V1_TEMPLATE if self.spec == "mistral-v1" else MISTRAL_V3_TEMPLATE

    def template_messages(self, conv: Conversation) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        messages, tools = super().template_messages(conv)
        if not self.native_tools:
            return messages, tools
        # v3 encodes the call ids it assigned (`_v3_turn_ids`): the template must see the same ones
        turns = iter(zip(conv.turns, _v3_turn_ids(conv), strict=True))
        out = []
        for m in messages:
            if m["role"] != "system":
                t, cids = next(turns)
                if t.tool_calls:
                    m = {**m, "tool_calls": [{**c, "id": cid} for c, cid in zip(m["tool_calls"], cids, strict=True)]}
                elif t.role == "tool":
                    m = {**m, "tool_call_id": cids[0]}
            out.append(m)
        return out, tools

    def identity(self) -> dict[str, Any]:
        return {"kind": "mistral-common", "file": self.path.name, "sha256": _sha256(self.path),
                "mistral_common_version": self._version, "instruct": type(self._inst).__name__}


def _maybe_json(s: str) -> Any:
    try:
        return json.loads(s)
    except (ValueError, RecursionError):
        return s


def _runs(mask: Sequence[bool]) -> list[tuple[int, int, bool]]:
    """The generation mask's runs of trained tokens as spans: one per assistant turn."""
    out, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i, True))
            start = None
    return out


def _turn_end(ids: Sequence[int], start: int, end: int, eos_id: int) -> int:
    """An assistant turn ends with its end-of-turn token: separators a template writes after it
    (a newline before the next turn) are not the answer and are not trained."""
    for i in range(end - 1, start - 1, -1):
        if ids[i] == eos_id:
            return i + 1
    return end


class HFChatTokenizer(ChatTokenizer):
    def __init__(self, spec: str):
        import transformers

        self.spec = spec
        self._tok = transformers.AutoTokenizer.from_pretrained(spec)
        t = self._tok
        if t.eos_token_id is None:
            raise ValueError(f"filter.tokenizer: {spec!r} has no eos token; cannot mark the end of an answer")
        if not getattr(t, "chat_template", None):
            raise ValueError(f"filter.tokenizer: {spec!r} has no chat_template; give a tokenizer with one "
                             "(or use 'mistral-v1' / 'mistral-v3')")
        self.bos_id, self.eos_id = t.bos_token_id, t.eos_token_id
        self.pad_id = next(i for i in (t.pad_token_id, t.unk_token_id, t.eos_token_id) if i is not None)
        self.vocab_size = len(t)
        self._template = t.chat_template
        self._generation_marks = "{% generation %}" in self._template or "{%- generation %}" in self._template
        self._version = transformers.__version__
        if self._template:  # a template that cannot be split into prompt + answer fails at load, not in an executor
            from spark_jobs.conversations.conversation import ConversationOptions, build_conversation

            probe = build_conversation([{"role": "user", "content": "What is 2+2?"},
                                        {"role": "assistant", "content": "4."}], None, None, ConversationOptions())
            try:
                r = self.render(probe)
            except RenderError as e:
                raise ValueError(str(e)) from None
            trained = self.decode([i for i, t in zip(r.input_ids, r.targets, strict=True) if t]).strip()
            if "4." not in trained:
                raise ValueError(
                    f"filter.tokenizer: the chat template of {spec!r} does not mark the answer as the assistant's "
                    f"tokens (the trained tokens of a probe answer '4.' are {trained!r}); its {{% generation %}} "
                    "block must enclose the assistant's content and end-of-turn token")

    def _ids(self, messages: list[dict[str, Any]], tools, add_generation_prompt: bool, mask: bool = False):
        out = self._tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            add_generation_prompt=add_generation_prompt,
                                            return_assistant_tokens_mask=mask)
        ids = [int(i) for i in out["input_ids"]]
        return (ids, [bool(x) for x in out["assistant_masks"]]) if mask else (ids, None)

    def render(self, conv: Conversation, train_on: TrainOn = "all_assistant_turns") -> Rendered:
        messages = conv.to_messages()
        tools = list(conv.tools) or None
        try:
            if self._generation_marks:
                ids, mask = self._ids(messages, tools, False, mask=True)
                if train_on == "last_assistant_turn":
                    prefix, _ = self._ids(messages[:-1], tools, True)
                    mask = [m and i >= len(prefix) for i, m in enumerate(mask)]
                elif train_on == "dataset_flags" and conv.flags is not None:
                    mask = _spans_to_targets(_choose_targets(_runs(mask), train_on, conv.flags), len(mask))
                return Rendered(ids, mask)
            ids, _ = self._ids(messages, tools, False)
            spans: list[tuple[int, int, bool]] = []
            for k, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before, _ = self._ids(messages[:k], tools, True)
                through, _ = self._ids(messages[: k + 1], tools, False)
                if ids[: len(through)] != through or through[: len(before)] != before:
                    raise RenderError(TEMPLATE_UNSUPPORTED, (
                        f"filter.tokenizer: the chat template of {self.spec!r} does not render a conversation's "
                        "prefix as a prefix of the whole; cannot tell assistant tokens from prompt tokens"))
                spans.append((len(before), _turn_end(ids, len(before), len(through), self.eos_id), True))
        except RenderError:
            raise
        except Exception as e:  # noqa: BLE001 - the template refuses this conversation: a reject
            raise RenderError(TEMPLATE_UNSUPPORTED, f"{self.spec}: {type(e).__name__}: {e}"[:500]) from None
        return Rendered(ids, _spans_to_targets(_choose_targets(spans, train_on, conv.flags), len(ids)))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def chat_template(self) -> str:
        return self._template

    def identity(self) -> dict[str, Any]:
        return {"kind": "huggingface", "class": type(self._tok).__name__, "transformers_version": self._version,
                "template_sha256": hashlib.sha256(self._template.encode()).hexdigest(),
                "assistant_mask": "generation blocks" if self._generation_marks else "prefix renderings"}


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> ChatTokenizer:
    """One tokenizer per (executor) process and spec."""
    if spec in MISTRAL_COMMON_FILES:
        return MistralCommonTokenizer(spec)
    return HFChatTokenizer(spec)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
