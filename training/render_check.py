"""Before a model is published: does its tokenizer reproduce the training tokens?

For each document of the input artifact's render sample (`pipeline_core.render_sample`: kept
documents with the conversations they were rendered from), the exported tokenizer's
`apply_chat_template(messages, tools=tools)` must equal the packed document token for token (its
first `seq_len` tokens when the filter cut it), and `apply_chat_template(messages[:-1],
add_generation_prompt=True)` must equal the document up to its final answer's first trained token:
the prompt a client sends is the prompt the model was trained to answer. The first difference is a
`RenderMismatch` naming the document, the position and the tokens on both sides; the trainer then
publishes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline_core.handoffs import IGNORE_INDEX
from pipeline_core.hf_tokenizer import first_difference
from pipeline_core.render_sample import SampleDocument


class RenderMismatch(RuntimeError):
    """The exported tokenizer does not reproduce a training document."""


@dataclass(frozen=True)
class RenderCheck:
    documents: int  # whole documents compared
    generation_prompts: int  # final-answer prompts compared (not for documents cut at seq_len)

    def as_summary(self) -> dict[str, int]:
        return {"render_check_documents": self.documents, "render_check_generation_prompts": self.generation_prompts}


def final_answer_start(labels: Sequence[int]) -> int | None:
    """Index of the first token of the last run of trained tokens (the final answer), None without one."""
    end = next((i for i in range(len(labels) - 1, -1, -1) if labels[i] != IGNORE_INDEX), None)
    if end is None:
        return None
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start


@dataclass(frozen=True)
class Difference:
    what: str  # "whole conversation" or the generation prompt
    at: int  # first differing token
    want: list[int]  # trained ids
    got: list[int]  # apply_chat_template's


def render(tok, messages, tools, generation: bool) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                  add_generation_prompt=generation)
    return [int(i) for i in out["input_ids"]]


def compare(tok, doc: SampleDocument) -> tuple[Difference | None, bool]:
    """The first difference between a training document and `tok`'s rendering of its conversation
    (None: identical), and whether the final answer's generation prompt was compared too."""
    want = list(doc.input_ids)
    got = render(tok, doc.messages, doc.tools, False)
    if doc.truncated:
        got = got[:len(want)]
    at = first_difference(want, got)
    if at is not None:
        return Difference("whole conversation", at, want, got), False
    start = final_answer_start(doc.labels)
    if doc.truncated or start is None or doc.messages[-1].get("role") != "assistant":
        return None, False
    got = render(tok, doc.messages[:-1], doc.tools, True)
    at = first_difference(want[:start], got)
    if at is not None:
        return Difference("prompt of the final answer (add_generation_prompt=True)", at, want[:start], got), True
    return None, True


def check_rendering(tokenizer_dir: Path, docs: Iterable[SampleDocument]) -> RenderCheck:
    """Every document reproduced, or `RenderMismatch` at the first that is not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    n_docs = n_prompts = 0
    for doc in docs:
        diff, prompt_checked = compare(tok, doc)
        if diff is not None:
            show, a = tok.convert_ids_to_tokens, diff.at
            raise RenderMismatch(
                f"the exported tokenizer ({tokenizer_dir}) does not reproduce the training tokens: document "
                f"{doc.id!r} ({doc.split}), {diff.what}, first difference at token {a} of {len(diff.want)}: trained "
                f"{show(diff.want[max(0, a - 2):a + 4])} but apply_chat_template gives "
                f"{show(diff.got[max(0, a - 2):a + 4])}; the model is not published")
        n_docs += 1
        n_prompts += prompt_checked
    return RenderCheck(n_docs, n_prompts)
