"""Preference records -> one (prompt, chosen, rejected) pair, and a rendered pair -> one packed row.

Shapes accepted (docs/dpo.md), whatever the file format:
  - `{prompt | messages | context, chosen, rejected}`: the prompt as a string (one user turn) or a
    message list; each side as a string or a message list ending in the assistant's answer
    (UltraFeedback-binarized: `chosen`/`rejected` are the whole conversation, prompt included; the
    prompt is then those turns before the answer, which must agree between the sides);
  - HelpSteer3-preference: `context` (messages), `response1`, `response2`, `overall_preference`
    in -3..3 (negative: response1 is better). 0 is a tie (`preference_tie`); |preference| below
    `filter.min_preference_margin` is `low_preference_margin` (checked by the filter: enrich keeps
    |preference| as `preference_strength`).

`pair_messages` returns the chosen conversation's messages (prompt + chosen answer: what enrich
normalises, embeds and the filter deduplicates, as for SFT) and the rejected answer text.
`pair_row` packs a rendered pair into one train-ready row: chosen, then rejected, each its own
document (position ids restarting), then padding, so a pair never crosses a micro-batch.
Pure Python/numpy: runs inside Spark UDFs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd  # module level: pandas_udf resolves its type hints in this module

from spark_jobs.packing import TOO_LONG, pack_rows

PREFERENCE_TIE = "preference_tie"
LOW_PREFERENCE_MARGIN = "low_preference_margin"
EMPTY_RESPONSE = "empty_response"
IDENTICAL_RESPONSES = "identical_responses"
NOT_A_PREFERENCE = "not_a_preference_record"
PROMPT_MISMATCH = "prompt_mismatch"


class PreferenceReject(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class PreferencePair:
    id: str
    prompt: tuple[dict[str, Any], ...]  # messages before the answer (system/user/assistant/tool turns)
    chosen: str
    rejected: str
    strength: int | None = None  # HelpSteer3: |overall_preference| (the filter's min_preference_margin reads it)

    def chosen_messages(self) -> list[dict[str, Any]]:
        return [*self.prompt, {"role": "assistant", "content": self.chosen}]


def _messages(value: Any, field: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [dict(m) for m in value]
    raise PreferenceReject(NOT_A_PREFERENCE, f"{field} is a {type(value).__name__}, expected a string or messages")


def _side(value: Any, field: str) -> tuple[list[dict[str, Any]] | None, str]:
    """(the turns before the answer, or None for a plain string; the answer text)."""
    if isinstance(value, dict):  # a single assistant message
        value = [value]
    if isinstance(value, str):
        text = value
        prefix = None
    elif isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        last = value[-1]
        if str(last.get("role") or "").lower() != "assistant":
            raise PreferenceReject(NOT_A_PREFERENCE, f"{field}: the last message is not the assistant's answer")
        text, prefix = last.get("content"), [dict(m) for m in value[:-1]]
    elif value is None or value == []:
        raise PreferenceReject(EMPTY_RESPONSE, f"{field} is missing or empty")
    else:
        raise PreferenceReject(NOT_A_PREFERENCE, f"{field} is a {type(value).__name__}, expected text or messages")
    if not isinstance(text, str) or not text.strip():
        raise PreferenceReject(EMPTY_RESPONSE, f"{field}: the answer is empty")
    return prefix, text


def record_id(rec: dict[str, Any]) -> str:
    for k in ("uuid", "id", "prompt_id"):
        v = rec.get(k)
        if v is not None and str(v).strip():
            return str(v)
    return "sha256:" + hashlib.sha256(json.dumps(rec, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def parse_pair(rec: dict[str, Any], min_margin: int = 1) -> PreferencePair:
    """One preference record (any accepted shape) -> its pair, or `PreferenceReject`."""
    if not isinstance(rec, dict):
        raise PreferenceReject(NOT_A_PREFERENCE, f"a JSON {type(rec).__name__}, not an object")
    rid = record_id(rec)
    if "overall_preference" in rec or "response1" in rec:  # HelpSteer3-preference
        pref = rec.get("overall_preference")
        if isinstance(pref, bool) or not isinstance(pref, int | float) or not -3 <= pref <= 3:
            raise PreferenceReject(NOT_A_PREFERENCE, f"overall_preference {pref!r} is not a number in -3..3")
        if pref == 0:
            raise PreferenceReject(PREFERENCE_TIE, "overall_preference 0: neither response is preferred")
        if abs(pref) < min_margin:
            raise PreferenceReject(LOW_PREFERENCE_MARGIN,
                                   f"|overall_preference| {abs(pref)} < filter.min_preference_margin={min_margin}")
        better, worse = ("response1", "response2") if pref < 0 else ("response2", "response1")
        prompt = _messages(rec.get("context"), "context")
        _, chosen = _side(rec.get(better), better)
        _, rejected = _side(rec.get(worse), worse)
    elif "chosen" in rec or "rejected" in rec:
        c_prefix, chosen = _side(rec.get("chosen"), "chosen")
        r_prefix, rejected = _side(rec.get("rejected"), "rejected")
        given = next((rec[k] for k in ("prompt", "messages", "context") if rec.get(k) is not None), None)
        if given is not None:
            prompt = _messages(given, "prompt")
            # UltraFeedback: each side repeats the prompt; a side that carries other turns is not this prompt's
            for p, name in ((c_prefix, "chosen"), (r_prefix, "rejected")):
                if p and p != prompt:
                    raise PreferenceReject(PROMPT_MISMATCH, f"{name}'s turns before its answer are not the prompt")
        elif c_prefix and c_prefix == r_prefix:
            prompt = c_prefix
        else:
            raise PreferenceReject(PROMPT_MISMATCH if c_prefix and r_prefix else NOT_A_PREFERENCE,
                                   "no prompt: give prompt/messages, or chosen and rejected with the same turns "
                                   "before their answers")
    else:
        raise PreferenceReject(NOT_A_PREFERENCE, "neither chosen/rejected nor response1/response2/overall_preference")
    if not any(str(m.get("role") or "").lower() == "user" and (m.get("content") or "").strip() for m in prompt):
        raise PreferenceReject(NOT_A_PREFERENCE, "the prompt has no user turn with text")
    if chosen.strip() == rejected.strip():
        raise PreferenceReject(IDENTICAL_RESPONSES, "chosen and rejected answers are the same text")
    strength = int(abs(rec["overall_preference"])) if "overall_preference" in rec else None
    return PreferencePair(rid, tuple(prompt), chosen, rejected, strength)


PREFERENCE_SCHEMA = "uuid string, messages_json string, rejected string, preference_strength int, read_error string"


def preference_columns(raw: str | None, read_error: str | None) -> dict[str, Any]:
    """enrich, objective dpo: a raw record's JSON -> the columns the SFT path reads (`uuid`,
    `messages_json` = prompt + chosen answer) plus `rejected` and `preference_strength`; or
    `read_error` = "<reason>: <detail>" (a reject)."""
    out: dict[str, Any] = {"uuid": None, "messages_json": None, "rejected": None, "preference_strength": None,
                           "read_error": read_error}
    if read_error:
        return out
    try:
        pair = parse_pair(json.loads(raw) if raw else None)
    except PreferenceReject as e:
        return {**out, "read_error": f"{e.reason}: {e.detail}"}
    except (ValueError, RecursionError) as e:
        return {**out, "read_error": f"unparseable_json: {type(e).__name__}"}
    return {**out, "uuid": pair.id, "messages_json": json.dumps(pair.chosen_messages(), ensure_ascii=False),
            "rejected": pair.rejected, "preference_strength": pair.strength}


def rejected_messages(chosen_messages: Sequence[dict[str, Any]], rejected: str) -> list[dict[str, Any]]:
    """The rejected side's conversation: the chosen one with its final answer replaced."""
    return [*chosen_messages[:-1], {**chosen_messages[-1], "content": rejected}]


PAIR_SIDES = 2  # documents per pair row: chosen, rejected


def pair_too_long(n_chosen: int, n_rejected: int, seq_len: int) -> tuple[str, str] | None:
    """(too_long, detail) when the two sides do not fit one row together."""
    n = n_chosen + n_rejected
    if n > seq_len:
        return TOO_LONG, f"chosen {n_chosen} + rejected {n_rejected} = {n} tokens > seq_len={seq_len} (a pair is one row)"
    return None


def pair_row(chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray], seq_len: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, position_ids) of one row holding the pair: chosen, rejected, padding."""
    return next(pack_rows([[chosen, rejected]], seq_len, pad_id))


# ----------------------------------------------------------------------------- Spark (enrich, objective dpo)
PAIR_COLUMNS = ("rejected", "preference_strength")


def with_preference_columns(raw_df):
    """Raw records (readers.RAW_SCHEMA) with `uuid`, `messages_json` and `read_error` taken from each
    preference record's JSON (`raw`), plus `rejected` and `preference_strength`."""
    from pyspark.sql import functions as F
    from pyspark.sql.functions import pandas_udf

    cols = [c.split(" ")[0] for c in PREFERENCE_SCHEMA.split(", ")]

    @pandas_udf(PREFERENCE_SCHEMA)
    def parse(raw: pd.Series, read_error: pd.Series) -> pd.DataFrame:
        return pd.DataFrame([preference_columns(r, e) for r, e in zip(raw, read_error, strict=True)], columns=cols)

    p = parse("raw", "read_error")
    return raw_df.withColumn("_p", p).select(
        *[F.col(f"_p.{c}").alias(c) if c in cols else F.col(c) for c in raw_df.columns],
        *[F.col(f"_p.{c}").alias(c) for c in PAIR_COLUMNS])


def with_rejected_similarity(df, e, threads: int):
    """+ `sim_question_rejected`: cosine of the question (prompt) and the rejected answer's embedding."""
    from pyspark.sql.functions import pandas_udf

    from spark_jobs.enrich.embeddings import get_encoder, spec_for

    @pandas_udf("double")
    def sim(batches: Iterator[tuple[pd.Series, pd.Series]]) -> Iterator[pd.Series]:
        pending: list[pd.Series] = []

        def texts():
            for q, r in batches:
                pending.append(q)
                yield [str(x) for x in r]

        for vecs in get_encoder(spec_for(e, threads)).encode_batches(texts()):
            q = np.stack([np.asarray(v, dtype=np.float32) for v in pending.pop(0)])
            yield pd.Series((q * vecs).sum(axis=1).astype(np.float64))

    return df.withColumn("sim_question_rejected", sim("question_embedding", "rejected"))
