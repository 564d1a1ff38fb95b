"""What makes two near-identical examples different examples (issue 27): the near-duplicate guard.

Embedding similarity cannot tell "Tom has 3 apples and eats 1" from "Tom has 7 apples and eats 2"
(MiniLM cosine ~0.92): a problem with other numbers has another answer and is new training
signal. Two rows may only be near duplicates when, besides their similarity, they agree on:
- the multiset of numeric literals of the question, normalised ("1,000" = "1000", "3.50" = "3.5",
  NFKC so full-width digits are digits);
- the identifiers and literals of the code in the question and answer (fenced or inline code;
  comments and white space do not count), so a function on other names or constants is kept;
- the final answer where one can be extracted: the last `\\boxed{}`, else the last code block, else
  the last number of the answer.
A rewording keeps all three; a variant with other numbers, names or result changes at least one.

The pairwise predicate is the equality of one 64-bit key per row (`guard_key`): evaluated inside
each near-duplicate cluster as a vectorised comparison, at no extra pass over the data. Guard
`none` gives every row the same key (similarity alone decides, as before issue 27).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal

import pandas as pd  # module level: pandas_udf resolves its type hints in this module

Guard = Literal["numbers", "none"]
GUARDS: tuple[Guard, ...] = ("numbers", "none")
NO_GUARD_KEY = 0

# 1,234,567.89 (thousands groups) or 1234.5 or .5; a sign is an operator in "5-3", so never read
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+")
_FENCED = re.compile(r"```[^\n`]*\n?(.*?)(?:```|$)", re.DOTALL)
_INLINE = re.compile(r"`([^`\n]+)`")
_COMMENT = re.compile(r"/\*.*?\*/|(?<![:\"'\w])//[^\n]*|(?:^|(?<=\s))#(?![!\w])[^\n]*", re.DOTALL)
_CODE_TOKEN = re.compile(r"\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'|[A-Za-z_]\w*|" + _NUMBER.pattern)
_BOXED = "\\boxed{"


@dataclass(frozen=True)
class GuardFeatures:
    """What the guard compares; two rows agree when all three are equal."""

    numbers: tuple[str, ...]  # the question's numeric literals, normalised, sorted (a multiset)
    code: tuple[str, ...]  # identifiers and literals of the code in question and answer, sorted
    final_answer: str  # boxed / last code block / last number; "" when none is extractable


def normalise_number(text: str) -> str:
    """'1,000' -> '1000', '3.50' -> '3.5', '007' -> '7', '.5' -> '0.5' (digits of any script)."""
    try:
        d = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return text
    s = format(d.normalize(), "f")
    return s.rstrip("0").rstrip(".") if "." in s else s


def _nfkc(text: str | None) -> str:
    return unicodedata.normalize("NFKC", text or "")


def numbers(text: str) -> list[str]:
    return [normalise_number(m) for m in _NUMBER.findall(text)]


def code_spans(text: str) -> list[str]:
    fenced = _FENCED.findall(text)
    rest = _FENCED.sub(" ", text)
    return [*fenced, *_INLINE.findall(rest)]


def code_tokens(code: str) -> list[str]:
    """Identifiers and literals (numbers normalised), comments and layout ignored."""
    out = []
    for t in _CODE_TOKEN.findall(_COMMENT.sub(" ", code)):
        out.append(normalise_number(t) if t[0].isdigit() or t[0] == "." else t)
    return out


def boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]


def final_answer(answer: str) -> str:
    box = boxed(answer)
    if box is not None:  # numbers normalised, layout ignored: "\\boxed{ 1,000 }" = "\\boxed{1000}"
        return "boxed:" + _NUMBER.sub(lambda m: normalise_number(m.group()), re.sub(r"\s+", "", box))
    fenced = _FENCED.findall(answer)
    if fenced:
        return "code:" + " ".join(code_tokens(fenced[-1]))
    nums = numbers(answer)
    return "number:" + nums[-1] if nums else ""


def guard_features(question: str | None, answer: str | None) -> GuardFeatures:
    q, a = _nfkc(question), _nfkc(answer)
    code = [t for span in (*code_spans(q), *code_spans(a)) for t in code_tokens(span)]
    return GuardFeatures(numbers=tuple(sorted(numbers(q))), code=tuple(sorted(code)), final_answer=final_answer(a))


def guard_key(question: str | None, answer: str | None, guard: Guard = "numbers") -> int:
    """A signed 64-bit key: two rows may be near duplicates only when their keys are equal."""
    if guard == "none":
        return NO_GUARD_KEY
    f = guard_features(question, answer)
    blob = "\u0001".join([" ".join(f.numbers), " ".join(f.code), f.final_answer])
    return int.from_bytes(hashlib.blake2b(blob.encode(), digest_size=8).digest(), "big", signed=True)


def guard_column(question, answer, guard: Guard):
    """Spark column of `guard_key` (a constant for guard `none`: no Python pass)."""
    from pyspark.sql import functions as F

    if guard == "none":
        return F.lit(NO_GUARD_KEY).cast("long")

    @F.pandas_udf("long")
    def keys(q: pd.Series, a: pd.Series) -> pd.Series:
        return pd.Series([guard_key(x, y, guard) for x, y in zip(q, a, strict=True)], dtype="int64")

    return keys(question, answer)
