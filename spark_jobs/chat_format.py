"""Render a filtered record with the base model's chat template and tokenize it.

The prompt is the record's relevant context (the enriched `relevant_sentences`, in context
order) followed by the question; the completion is the answer, optionally preceded by the
reasoning trace. Tokenization returns prompt and completion ids separately, so the loss mask is
exact: everything the template adds around the user turn belongs to the prompt.

Tokenizers, by `filter.tokenizer`:
  - `mistral-v1` (default; Mistral-7B-v0.1 / Instruct-v0.1), `mistral-v3`: the tokenizer files
    shipped in `mistral-common`, encoded with mistral-common's own instruct tokenizer
    (v1: `<s>[INST] {prompt} [/INST] {answer}</s>`), so the template is the model's, not a copy;
  - any other value: a Hugging Face tokenizer directory or hub id, rendered with its
    `chat_template` (or the Mistral v1 format when it has none).
Pure Python: loaded once per Spark executor process through `load_tokenizer`'s cache.
"""

from __future__ import annotations

import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MISTRAL_COMMON_FILES = {
    "mistral-v1": "tokenizer.model.v1",
    "mistral-v3": "mistral_instruct_tokenizer_240323.model.v3",
}
V1_FORMAT = "<s>[INST] {prompt} [/INST] {completion}</s>"
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


def render(
    relevant: Sequence[str] | None,
    question: str,
    answer: str,
    reasoning_trace: str | None = None,
    train_on_reasoning: bool = False,
) -> tuple[str, str]:
    """(prompt text, completion text) of one record, before the chat template."""
    context = "\n".join(s.strip() for s in (relevant or ()) if s and s.strip())
    prompt = f"{context}\n\n{question.strip()}" if context else question.strip()
    completion = answer.strip()
    if train_on_reasoning and reasoning_trace and reasoning_trace.strip():
        completion = f"{THINK_OPEN}{reasoning_trace.strip()}{THINK_CLOSE}{completion}"
    return prompt, completion


class ChatTokenizer(ABC):
    """Template + tokenizer: `encode` gives (prompt ids, completion ids); their concatenation is
    exactly what the model sees for a two-turn (user, assistant) conversation."""

    spec: str
    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int

    @abstractmethod
    def encode(self, prompt: str, completion: str) -> tuple[list[int], list[int]]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """Tokenizer and template identity for the manifest."""


class MistralCommonTokenizer(ChatTokenizer):
    def __init__(self, spec: str):
        import mistral_common
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.spec = spec
        self.path = Path(mistral_common.__file__).parent / "data" / MISTRAL_COMMON_FILES[spec]
        self._mt = MistralTokenizer.from_file(str(self.path))
        self._inst = self._mt.instruct_tokenizer
        self._tok = self._inst.tokenizer
        self.bos_id, self.eos_id = self._tok.bos_id, self._tok.eos_id
        # No pad token in these vocabularies: pad with <unk> (id 0), which never occurs in encoded text,
        # so padding cannot be confused with a real end of sequence.
        self.pad_id = self._tok.pad_id if self._tok.pad_id >= 0 else self._tok.unk_id
        self.vocab_size = self._tok.n_words
        self._version = mistral_common.__version__
        self._encode_prompt = self._choose_prompt_encoder()

    def _request(self, messages):
        from mistral_common.protocol.instruct.request import InstructRequest

        return InstructRequest(messages=messages)

    def encode_full(self, prompt: str, completion: str) -> list[int]:
        """The whole conversation as mistral-common encodes it (reference for tests and self-checks)."""
        from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage

        req = self._request([UserMessage(content=prompt), AssistantMessage(content=completion)])
        return list(self._inst.encode_instruct(req).tokens)

    def _prompt_slow(self, prompt: str) -> list[int]:
        from mistral_common.protocol.instruct.messages import UserMessage

        return list(self._inst.encode_instruct(self._request([UserMessage(content=prompt)])).tokens)

    def _prompt_fast(self, prompt: str) -> list[int]:
        """encode_instruct's own steps for one user turn, without the decode it does for `.text`
        (a third of the time). Used only when it agrees with encode_instruct (checked at load)."""
        from mistral_common.protocol.instruct.messages import UserMessage

        ids = self._inst.encode_user_message(UserMessage(content=prompt), None, True, True)[0]
        return list(self._inst.start()) + list(ids)

    def _choose_prompt_encoder(self):
        probes = ["What is 2+2?", "Context.\n\nQuestion with ü and 漢字?", "  spaced  "]
        try:
            if all(self._prompt_fast(p) == self._prompt_slow(p) for p in probes):
                return self._prompt_fast
        except Exception:  # noqa: BLE001 - a changed private signature: use the public path
            pass
        return self._prompt_slow

    def encode(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        # The prompt is mistral-common's encoding of the user turn; an assistant turn is its text + </s>
        # in every SentencePiece instruct version (checked against encode_full in the tests).
        prompt_ids = self._encode_prompt(prompt)
        completion_ids = list(self._tok.encode(completion, bos=False, eos=False)) + [self.eos_id]
        return prompt_ids, completion_ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def identity(self) -> dict[str, Any]:
        return {
            "tokenizer": {
                "spec": self.spec, "kind": "mistral-common", "file": self.path.name, "sha256": _sha256(self.path),
                "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id,
                "mistral_common_version": self._version,
            },
            "template": {
                "name": f"mistral-instruct-{type(self._inst).__name__}",
                "format": V1_FORMAT if self.spec == "mistral-v1" else "<s>[INST]{prompt}[/INST]{completion}</s>",
                "prompt": "relevant context sentences joined by newlines, a blank line, then the question",
            },
        }


class HFChatTokenizer(ChatTokenizer):
    def __init__(self, spec: str):
        import transformers

        self.spec = spec
        self._tok = transformers.AutoTokenizer.from_pretrained(spec)
        t = self._tok
        if t.eos_token_id is None:
            raise ValueError(f"filter.tokenizer: {spec!r} has no eos token; cannot mark the end of an answer")
        self.bos_id, self.eos_id = t.bos_token_id, t.eos_token_id
        self.pad_id = next(i for i in (t.pad_token_id, t.unk_token_id, t.eos_token_id) if i is not None)
        self.vocab_size = len(t)
        self._template = getattr(t, "chat_template", None)
        self._version = transformers.__version__
        if self._template:  # a template that cannot be split into prompt + answer fails at load, not in an executor
            self.encode("What is 2+2?", "4.")

    def _chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        out = self._tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(i) for i in out]

    def encode(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        if self._template:
            user = [{"role": "user", "content": prompt}]
            prompt_ids = self._chat_ids(user, add_generation_prompt=True)
            full = self._chat_ids(user + [{"role": "assistant", "content": completion}], add_generation_prompt=False)
            if full[: len(prompt_ids)] != prompt_ids:
                raise ValueError(
                    f"filter.tokenizer: the chat template of {self.spec!r} does not render the prompt as a prefix "
                    "of the conversation; cannot separate prompt and answer tokens"
                )
            return prompt_ids, full[len(prompt_ids):]
        enc = self._tok.encode
        prompt_ids = ([self.bos_id] if self.bos_id is not None else []) + enc(f"[INST] {prompt} [/INST]", add_special_tokens=False)
        return prompt_ids, enc(completion, add_special_tokens=False) + [self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def identity(self) -> dict[str, Any]:
        tmpl = self._template or V1_FORMAT
        return {
            "tokenizer": {
                "spec": self.spec, "kind": "huggingface", "class": type(self._tok).__name__,
                "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id,
                "transformers_version": self._version,
            },
            "template": {
                "name": "hf-chat-template" if self._template else "mistral-instruct-v1-text",
                "sha256": hashlib.sha256(tmpl.encode()).hexdigest(),
                "prompt": "relevant context sentences joined by newlines, a blank line, then the question",
            },
        }


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> ChatTokenizer:
    """One tokenizer per (executor) process and spec."""
    if spec in MISTRAL_COMMON_FILES:
        return MistralCommonTokenizer(spec)
    return HFChatTokenizer(spec)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
