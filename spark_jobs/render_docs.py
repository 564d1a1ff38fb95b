"""The filter's rendering step: each kept record's conversation -> one tokenized document.

Runs as a `mapInPandas` body (the tokenizer is loaded once per executor process). A kept row is
rendered with `chat_format` (the whole conversation, `filter.train_on` turns as targets), then the
length limits apply (`packing.make_document`); a row that fails either becomes a reject with the
reason and a detail, and a row rejected earlier passes through. One row in, one row out.

`prompt_context: relevant`: before rendering, a system prompt or tool result longer than
`relevant_context_tokens` is replaced, inside the same turn, by its `relevant_top_k` units with the
highest similarity to the *question* (enrich's `context_question_scores`; never the answer, which
serving does not have), in their original order and verbatim (code blocks, JSON, tables whole).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

from pipeline_core.config import FilterSection
from pipeline_core.render_sample import chat_json
from spark_jobs.chat_format import ChatTokenizer, load_tokenizer
from spark_jobs.conversation import ConversationOptions, RenderError, build_conversation
from spark_jobs.filter_rows import conversation_options
from spark_jobs.packing import Document, LengthLimits, make_document

DOC_SCHEMA = (
    "id string, key long, split string, input_ids array<int>, labels array<int>, n_prompt int, n_answer int, "
    "truncated boolean, reason string, raw string, chat string, category string, n_tokens int, n_tokens_visible int, "
    "reasoning_dropped boolean, split_at int"
)
RENDER_COLUMNS = ("id", "category", "key", "split", "reason", "raw", "messages_json", "metadata", "reasoning",
                  "context_sentences", "context_turns", "context_question_scores", "rejected")
REDUCED_ROLES = ("system", "tool")
PAIR_TRAIN_ON = "last_assistant_turn"  # DPO: each side's loss is its final answer only


def reduce_context(messages: list[dict[str, Any]], units: Sequence[str] | None, turns: Sequence[int] | None,
                   scores: Sequence[float] | None, tok: ChatTokenizer, budget: int, top_k: int) -> list[dict[str, Any]]:
    """`prompt_context: relevant`: long system prompts / tool results -> their question-relevant units."""
    if units is None or turns is None or scores is None or len(units) == 0:
        return messages
    out = []
    for i, m in enumerate(messages):
        role = str(m.get("role") or "").strip().lower()
        content = m.get("content") or ""
        if role in REDUCED_ROLES and content and tok.count(content) > budget:
            mine = [(j, units[j], scores[j]) for j in range(len(units)) if turns[j] == i]
            if mine:
                best = sorted(sorted(mine, key=lambda u: -u[2])[:top_k], key=lambda u: u[0])
                m = {**m, "content": "\n".join(u[1] for u in best)}
        out.append(m)
    return out


def _raw(rec, detail: str) -> str:
    return json.dumps({"id": rec.id, "category": rec.category, "messages": rec.messages_json, "detail": detail},
                      ensure_ascii=False)


def render_lengths(messages, rec, opts: ConversationOptions, tok: ChatTokenizer, fcfg: FilterSection):
    """The record rendered under ``filter.overflow`` -> (the conversation rendered, rendered, tokens as first rendered, tokens of
    the visible conversation alone, whether earlier turns' reasoning was dropped to fit seq_len).
    drop_earlier_reasoning first keeps every assistant turn's trace and, only when that is longer
    than seq_len, renders again with the final answer's alone: the visible conversation and the
    trained answer are never cut (make_document still rejects what does not fit)."""
    keep_earlier = fcfg.overflow == "drop_earlier_reasoning" and opts.train_on_reasoning
    first = dataclasses.replace(opts, earlier_reasoning=True) if keep_earlier else opts
    conv = build_conversation(messages, rec.metadata, rec.reasoning, first)
    rendered = tok.render(conv, fcfg.train_on)
    n_tokens = len(rendered.input_ids)
    dropped = False
    if keep_earlier and n_tokens > fcfg.seq_len:
        conv = build_conversation(messages, rec.metadata, rec.reasoning, opts)
        shorter = tok.render(conv, fcfg.train_on)
        dropped = len(shorter.input_ids) < n_tokens
        rendered = shorter
    visible = n_tokens
    if opts.train_on_reasoning:  # the fit without any reasoning (the data report's second count)
        bare = dataclasses.replace(opts, train_on_reasoning=False, earlier_reasoning=False)
        visible = len(tok.render(build_conversation(messages, rec.metadata, rec.reasoning, bare), fcfg.train_on).input_ids)
    return conv, rendered, n_tokens, visible, dropped


def render_pair(messages: list[dict[str, Any]], rejected: str, rec, tok: ChatTokenizer, fcfg: FilterSection,
                opts) -> tuple[Document, int] | tuple[str, str]:
    """objective dpo: the chosen and the rejected conversation rendered with the chat template (loss on
    each final answer), as one document whose first `split_at` tokens are the chosen side."""
    from spark_jobs.preference import pair_too_long, rejected_messages

    limits = LengthLimits(fcfg.seq_len, fcfg.max_tokens, max(1, fcfg.min_answer_tokens), "reject")
    sides = [tok.render(build_conversation(m, rec.metadata, rec.reasoning, opts), PAIR_TRAIN_ON)
             for m in (messages, rejected_messages(messages, rejected))]
    too_long = pair_too_long(len(sides[0].input_ids), len(sides[1].input_ids), fcfg.seq_len)
    if too_long:  # checked before the per-side limits: one reason for a pair over seq_len
        return too_long
    docs = [make_document(r.input_ids, r.targets, limits, tok.eos_id) for r in sides]
    for name, d in zip(("chosen", "rejected"), docs, strict=True):
        if isinstance(d, tuple):
            return d[0], f"{name}: {d[1]}"
    c, r = docs
    return Document(np.concatenate([c.input_ids, r.input_ids]), np.concatenate([c.labels, r.labels]),
                    c.n_prompt + r.n_prompt, c.n_answer + r.n_answer, False), len(c.input_ids)


def render_partitions(batches: Iterator[pd.DataFrame], fcfg: FilterSection,
                      sample_below: int | None = None) -> Iterator[pd.DataFrame]:
    """`chat` (`render_sample.chat_json` of the template messages) is kept for the documents whose key
    is below `sample_below` (`render_sample.key_threshold`; None: none), the render sample's candidates."""
    tok = load_tokenizer(fcfg.tokenizer)
    opts = conversation_options(fcfg)
    # drop_earlier_reasoning has already made the row as short as it may get: the rest is a reject
    overflow = "reject" if fcfg.overflow == "drop_earlier_reasoning" else fcfg.overflow
    limits = LengthLimits(fcfg.seq_len, fcfg.max_tokens, fcfg.min_answer_tokens, overflow)
    pairs = fcfg.objective == "dpo"
    relevant = fcfg.prompt_context == "relevant"
    cols = [c for c in DOC_SCHEMA.split(", ")]
    names = [c.split(" ")[0] for c in cols]
    for pdf in batches:
        out: dict[str, list[Any]] = {k: [] for k in names}
        for rec in pdf.itertuples(index=False):
            reason, raw, doc, chat, lengths, split_at = rec.reason, rec.raw, None, None, (None, None, None), None
            if reason is None:
                try:
                    messages = json.loads(rec.messages_json)
                    if relevant:
                        messages = reduce_context(messages, rec.context_sentences, rec.context_turns,
                                                  rec.context_question_scores, tok, fcfg.relevant_context_tokens,
                                                  fcfg.relevant_top_k)
                    if pairs:
                        got = render_pair(messages, rec.rejected, rec, tok, fcfg, opts)
                    else:
                        conv, rendered, *lengths = render_lengths(messages, rec, opts, tok, fcfg)
                        got = make_document(rendered.input_ids, rendered.targets, limits, tok.eos_id)
                        if sample_below is not None and int(rec.key) < sample_below:
                            chat = chat_json(*tok.template_messages(conv))
                except RenderError as e:
                    got = (e.reason, e.detail)
                if pairs and isinstance(got, tuple) and isinstance(got[0], Document):
                    got, split_at = got
                if isinstance(got, tuple):
                    reason, raw = got[0], _raw(rec, got[1])
                else:
                    doc = got
            out["id"].append(rec.id)
            out["key"].append(rec.key)
            out["split"].append(rec.split)
            out["input_ids"].append(doc.input_ids if doc else None)
            out["labels"].append(doc.labels if doc else None)
            out["n_prompt"].append(doc.n_prompt if doc else None)
            out["n_answer"].append(doc.n_answer if doc else None)
            out["truncated"].append(doc.truncated if doc else None)
            out["reason"].append(reason)
            out["raw"].append(raw)
            out["chat"].append(chat if doc else None)
            out["category"].append(rec.category)
            out["n_tokens"].append(lengths[0])
            out["n_tokens_visible"].append(lengths[1])
            out["reasoning_dropped"].append(lengths[2])
            out["split_at"].append(split_at)
        yield pd.DataFrame(out)
