"""The filter's rendering step: each kept record's conversation -> one tokenized document.

Runs as a `mapInPandas` body (the tokenizer is loaded once per executor process). A kept row is
rendered with `chat_format` (the whole conversation, `filter.train_on` turns as targets), then the
length limits apply (`packing.make_document`); a row that fails either becomes a reject with the
reason and a detail, and a row rejected earlier passes through. One row in, one or more rows out:
a record with per-turn flags and `train_on_reasoning` can train several documents
(`conversation.build_documents`); its first output row (`doc` 0) is the whole conversation and
carries the record's accounting (`n_tokens` as rendered, `len_with_reasoning` / `len_without_reasoning`:
the tokens of the whole conversation rendered with and without reasoning, for the per-split length
fit, `spark_jobs.filter.job.split_fit`),
its prefix documents follow as `doc` 1, 2, ... under the same key (packing orders by key, doc). A
record any of whose documents fails is rejected whole.

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
from spark_jobs.conversations.chat_format import ChatTokenizer, load_tokenizer
from spark_jobs.conversations.conversation import (
    ConversationOptions,
    RenderError,
    build_conversation,
    build_documents,
)
from spark_jobs.filter.filter_rows import conversation_options
from spark_jobs.packing import Document, LengthLimits, make_document

DOC_SCHEMA = (
    "id string, key long, split string, input_ids array<int>, labels array<int>, n_prompt int, n_answer int, "
    "truncated boolean, reason string, raw string, chat string, category string, n_tokens int, "
    "reasoning_dropped boolean, split_at int, doc int, source_split string, len_with_reasoning int, "
    "len_without_reasoning int"
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
    """The record rendered under ``filter.overflow`` -> (the conversation rendered, rendered, tokens as
    first rendered, tokens with reasoning, tokens without any reasoning, whether earlier turns'
    reasoning was dropped to fit seq_len). drop_earlier_reasoning first keeps every assistant turn's
    trace and, only when that is longer than seq_len, renders again with the final answer's alone:
    the visible conversation and the trained answer are never cut (make_document still rejects what
    does not fit). "With reasoning" is the conversation as `train_on_reasoning` renders it (traces
    and the /think or /no_think marker), whatever this run trains: the other variant is always
    rendered, since a row without any trace still differs by its marker."""
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
    other = (dataclasses.replace(opts, train_on_reasoning=False, earlier_reasoning=False) if opts.train_on_reasoning
             else dataclasses.replace(opts, train_on_reasoning=True))
    n_other = len(tok.render(build_conversation(messages, rec.metadata, rec.reasoning, other), fcfg.train_on).input_ids)
    with_r, without_r = (n_tokens, n_other) if opts.train_on_reasoning else (n_other, n_tokens)
    return conv, rendered, n_tokens, with_r, without_r, dropped


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
            reason, raw, docs, chat, split_at = rec.reason, rec.raw, [], None, None
            # tokens as rendered, with reasoning, without it, whether earlier reasoning was dropped
            lengths: tuple = (None, None, None, None)
            if reason is None:
                try:
                    messages = json.loads(rec.messages_json)
                    if relevant:
                        messages = reduce_context(messages, rec.context_sentences, rec.context_turns,
                                                  rec.context_question_scores, tok, fcfg.relevant_context_tokens,
                                                  fcfg.relevant_top_k)
                    got: Any = None
                    if pairs:
                        got = render_pair(messages, rec.rejected, rec, tok, fcfg, opts)
                        if isinstance(got[0], Document):
                            (pair, split_at), got = got, None
                            docs.append(pair)
                    else:
                        convs = build_documents(messages, rec.metadata, rec.reasoning, opts)
                        whole, rendered_whole, *lengths = render_lengths(messages, rec, opts, tok, fcfg)
                        rendered = [tok.render(c, fcfg.train_on) for c in convs[:-1]] + [rendered_whole]
                        for r in [rendered[-1], *rendered[:-1]]:  # the whole conversation first: doc 0
                            d = make_document(r.input_ids, r.targets, limits, tok.eos_id)
                            if isinstance(d, tuple):
                                got = d
                                break
                            docs.append(d)
                        if got is None and sample_below is not None and int(rec.key) < sample_below:
                            chat = chat_json(*tok.template_messages(whole))
                except RenderError as e:
                    got = (e.reason, e.detail)
                if isinstance(got, tuple):
                    reason, raw, docs = got[0], _raw(rec, got[1]), []
            for j, doc in enumerate(docs or [None]):
                first = j == 0  # the whole conversation (or the pair); later docs: earlier trained turns
                out["id"].append(rec.id)
                out["key"].append(rec.key)  # the record's; (key, doc) orders its documents
                out["split"].append(rec.split)
                out["input_ids"].append(doc.input_ids if doc else None)
                out["labels"].append(doc.labels if doc else None)
                out["n_prompt"].append(doc.n_prompt if doc else None)
                out["n_answer"].append(doc.n_answer if doc else None)
                out["truncated"].append(doc.truncated if doc else None)
                out["reason"].append(reason)
                out["raw"].append(raw)
                out["chat"].append(chat if doc and first else None)
                out["category"].append(rec.category)
                out["n_tokens"].append(lengths[0] if first else None)
                out["reasoning_dropped"].append(lengths[3] if first else None)
                out["split_at"].append(split_at)
                out["doc"].append(j)
                out["source_split"].append(getattr(rec, "source_split", None))
                out["len_with_reasoning"].append(lengths[1] if first else None)
                out["len_without_reasoning"].append(lengths[2] if first else None)
        yield pd.DataFrame(out)

