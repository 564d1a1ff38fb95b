"""Issue 27's kind of data for near-duplicate removal: math (and code) templates instantiated with
different numbers, light rewordings of some instances, Unicode-only copies and hard negatives.

Each template has two phrasings (A and B) of the same problem. An *instance* is phrasing A with its
own numbers: instances of one template differ only in their numbers and must all be kept. A
*rewording* is phrasing B with an instance's numbers: the same example, which must go. A *Unicode
copy* is an instance with NFKC-equivalent characters (full-width digits, no-break spaces,
ligatures): an exact duplicate. A *hard negative* asks a different question on the same story and
numbers: another example, kept. Used by tests/test_near_dup_guard.py and bench/neardup_guard_bench.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    name: str
    qa: str  # phrasing A of the question, str.format fields
    aa: str  # phrasing A of the answer; {r} is the result
    qb: str  # phrasing B (the rewording)
    ab: str
    fields: tuple[tuple[str, int, int], ...]  # (name, low, high)
    result: Callable[[dict], int | float]
    qn: str  # hard negative: another question on the same story
    an: str
    negative: Callable[[dict], int | float]


def _t(name, qa, aa, qb, ab, fields, result, qn, an, negative) -> Template:
    return Template(name, qa, aa, qb, ab, tuple(fields), result, qn, an, negative)


TEMPLATES: tuple[Template, ...] = (
    _t("apples", "Tom has {a} apples. He eats {b} of them. How many apples does Tom have left?",
       "Tom starts with {a} apples and eats {b}, so he has {a} - {b} = {r} apples left. The answer is \\boxed{{{r}}}.",
       "Tom owns {a} apples and eats {b} of them. How many apples remain with Tom?",
       "Tom had {a} apples and ate {b}, so {a} - {b} = {r} apples remain. The answer is \\boxed{{{r}}}.",
       [("a", 20, 90), ("b", 2, 19)], lambda v: v["a"] - v["b"],
       "Tom has {a} apples. He eats {b} of them. How many apples did Tom eat in total, counting twice that amount?",
       "Twice the {b} apples he ate is 2 x {b} = {r}. The answer is \\boxed{{{r}}}.", lambda v: 2 * v["b"]),
    _t("test_average", "Maria scored {a}, {b} and {c} on three tests. What is her average score?",
       "Her total is {a} + {b} + {c} = {s}, and {s} / 3 = {r}. The average is \\boxed{{{r}}}.",
       "On three tests Maria got scores of {a}, {b} and {c}. What is the average of her scores?",
       "The scores add up to {a} + {b} + {c} = {s}; dividing by 3 gives {r}. The average is \\boxed{{{r}}}.",
       [("a", 60, 99), ("b", 60, 99), ("c", 60, 99)], lambda v: round((v["a"] + v["b"] + v["c"]) / 3, 2),
       "Maria scored {a}, {b} and {c} on three tests. What is the difference between her best and worst score?",
       "The best minus the worst score is {r}. The answer is \\boxed{{{r}}}.",
       lambda v: max(v["a"], v["b"], v["c"]) - min(v["a"], v["b"], v["c"])),
    _t("cyclist", "A cyclist rides at {a} km per hour for {b} hours. How far does the cyclist travel?",
       "Distance is speed times time: {a} x {b} = {r} km. The answer is \\boxed{{{r}}}.",
       "A cyclist travels at a speed of {a} km per hour for {b} hours. What distance does the cyclist cover?",
       "Multiplying speed by time gives {a} x {b} = {r} km. The answer is \\boxed{{{r}}}.",
       [("a", 10, 35), ("b", 2, 9)], lambda v: v["a"] * v["b"],
       "A cyclist rides at {a} km per hour for {b} hours. How many minutes does the ride last?",
       "{b} hours is {b} x 60 = {r} minutes. The answer is \\boxed{{{r}}}.", lambda v: v["b"] * 60),
    _t("walking_speed", "Anna walks {a} km in {b} hours. What is her walking speed in km per hour?",
       "Speed is distance over time: {a} / {b} = {r} km per hour. The answer is \\boxed{{{r}}}.",
       "Anna covers {a} km on foot in {b} hours. At what speed, in km per hour, does she walk?",
       "Dividing the distance by the time, {a} / {b} = {r} km per hour. The answer is \\boxed{{{r}}}.",
       [("a", 6, 40), ("b", 2, 8)], lambda v: round(v["a"] / v["b"], 2),
       "Anna walks {a} km in {b} hours. How many metres does she walk?",
       "{a} km is {a} x 1000 = {r} metres. The answer is \\boxed{{{r}}}.", lambda v: v["a"] * 1000),
    _t("books", "A shelf holds {a} books. A library has {b} such shelves, all full. How many books are there?",
       "Each shelf has {a} books and there are {b} shelves, so {a} x {b} = {r} books. The answer is {r}.",
       "A library has {b} full shelves, each holding {a} books. How many books does the library have?",
       "With {b} shelves of {a} books each, the library has {a} x {b} = {r} books. The answer is {r}.",
       [("a", 12, 60), ("b", 3, 30)], lambda v: v["a"] * v["b"],
       "A shelf holds {a} books. A library has {b} such shelves, all full. How many books are on half the shelves?",
       "Half the shelves hold half the books: {r}. The answer is {r}.", lambda v: v["a"] * v["b"] / 2),
    _t("discount", "A jacket costs ${a}. It is on sale for {b}% off. What is the sale price?",
       "The discount is {b}% of ${a}, so the sale price is {a} x (1 - {b}/100) = ${r}. The answer is {r}.",
       "A jacket priced at ${a} is discounted by {b}%. How much does it cost on sale?",
       "Taking {b}% off ${a} leaves {a} x (1 - {b}/100) = ${r}. The answer is {r}.",
       [("a", 40, 250), ("b", 10, 60)], lambda v: round(v["a"] * (1 - v["b"] / 100), 2),
       "A jacket costs ${a}. It is on sale for {b}% off. How much money is saved?",
       "The saving is {b}% of ${a} = ${r}. The answer is {r}.", lambda v: round(v["a"] * v["b"] / 100, 2)),
    _t("rectangle", "A rectangle is {a} cm long and {b} cm wide. What is its area?",
       "Area = length x width = {a} x {b} = {r} square cm. The answer is \\boxed{{{r}}}.",
       "What is the area of a rectangle whose length is {a} cm and whose width is {b} cm?",
       "Multiplying length by width: {a} x {b} = {r} square cm. The answer is \\boxed{{{r}}}.",
       [("a", 5, 50), ("b", 3, 30)], lambda v: v["a"] * v["b"],
       "A rectangle is {a} cm long and {b} cm wide. What is its perimeter?",
       "Perimeter = 2 x ({a} + {b}) = {r} cm. The answer is \\boxed{{{r}}}.", lambda v: 2 * (v["a"] + v["b"])),
    _t("savings", "Sam saves ${a} every week. How much has he saved after {b} weeks?",
       "He saves ${a} per week for {b} weeks: {a} x {b} = ${r}. The answer is {r}.",
       "Every week Sam puts aside ${a}. After {b} weeks, how much money has he saved?",
       "Putting aside ${a} a week for {b} weeks gives {a} x {b} = ${r}. The answer is {r}.",
       [("a", 5, 75), ("b", 4, 52)], lambda v: v["a"] * v["b"],
       "Sam saves ${a} every week. How many weeks does he need to save ${c}?",
       "He needs {c} / {a} weeks, rounded up: {r}. The answer is {r}.", lambda v: -(-v["c"] // v["a"])),
    _t("train", "A train leaves at {a}:00 and arrives {b} hours later. At what hour does it arrive?",
       "It arrives at {a} + {b} = {r}:00. The answer is \\boxed{{{r}}}.",
       "A train departs at {a}:00 and its journey takes {b} hours. At what hour does the train arrive?",
       "Adding the {b} hour journey to {a}:00 gives {r}:00. The answer is \\boxed{{{r}}}.",
       [("a", 5, 12), ("b", 1, 9)], lambda v: v["a"] + v["b"],
       "A train leaves at {a}:00 and arrives {b} hours later. How many minutes is the journey?",
       "{b} hours is {r} minutes. The answer is \\boxed{{{r}}}.", lambda v: 60 * v["b"]),
    _t("pizza", "A pizza is cut into {a} slices. {b} friends share it equally. How many slices does each friend get?",
       "Each friend gets {a} / {b} = {r} slices. The answer is {r}.",
       "{b} friends share a pizza cut into {a} slices equally. How many slices does each of them get?",
       "Splitting {a} slices among {b} friends gives {a} / {b} = {r} slices each. The answer is {r}.",
       [("a", 8, 48), ("b", 2, 8)], lambda v: round(v["a"] / v["b"], 2),
       "A pizza is cut into {a} slices. {b} friends share it equally. How many slices are left if each eats one?",
       "{a} - {b} = {r} slices are left. The answer is {r}.", lambda v: v["a"] - v["b"]),
)

CODE_TEMPLATES = (
    ("Write a Python function `{f}` that returns the sum of the numbers from 1 to {n}.",
     "```python\ndef {f}():\n    return sum(range(1, {n} + 1))\n```\nThis returns {r}.",
     "In Python, write a function named `{f}` returning the sum of all numbers from 1 to {n}.",
     "```python\ndef {f}():\n    return sum(range(1, {n} + 1))\n```\nCalling it gives {r}.",
     lambda n: n * (n + 1) // 2),
)
CODE_NAMES = ("total", "sum_to", "add_up", "series", "triangle", "accumulate", "running", "summed")

UNICODE_SWAPS = {"0": "０", "1": "１", "2": "２", "3": "３", "5": "５", " ": "\u00a0", "fi": "ﬁ"}


@dataclass(frozen=True)
class Item:
    id: str
    question: str
    answer: str
    kind: str  # instance | rewording | unicode_copy | negative
    of: str | None = None  # the instance a rewording / copy / negative was made from
    template: str = ""
    category: str = "math"


def _values(t: Template, rng: random.Random) -> dict:
    v = {name: rng.randint(lo, hi) for name, lo, hi in t.fields}
    v["c"] = v.get("c", rng.randint(100, 900))
    v["s"] = sum(v[n] for n, _, _ in t.fields)
    return v


def _fmt(r) -> str:
    return f"{r:g}" if isinstance(r, float) else str(r)


def unicode_copy(text: str) -> str:
    for a, b in UNICODE_SWAPS.items():
        text = text.replace(a, b)
    return text


def corpus(variants: int = 24, reworded: int = 6, copies: int = 3, negatives: int = 2, seed: int = 0) -> list[Item]:
    """`variants` instances per math template (distinct numbers), of which the first `reworded` get
    a rewording, the first `copies` a Unicode copy and the first `negatives` a hard negative; and
    the code template instantiated with every name and a number each."""
    rng = random.Random(seed)
    out: list[Item] = []
    for t in TEMPLATES:
        seen: set[tuple] = set()
        i = 0
        while i < variants:
            v = _values(t, rng)
            sig = tuple(v[n] for n, _, _ in t.fields)
            if sig in seen:
                continue
            seen.add(sig)
            iid = f"{t.name}-{i:02d}"
            r = _fmt(t.result(v))
            out.append(Item(iid, t.qa.format(**v), t.aa.format(r=r, **v), "instance", None, t.name))
            if i < reworded:
                out.append(Item(f"{iid}-rw", t.qb.format(**v), t.ab.format(r=r, **v), "rewording", iid, t.name))
            if i < copies:
                out.append(Item(f"{iid}-uc", unicode_copy(t.qa.format(**v)), unicode_copy(t.aa.format(r=r, **v)),
                                "unicode_copy", iid, t.name))
            if i < negatives:
                rn = _fmt(t.negative(v))
                out.append(Item(f"{iid}-neg", t.qn.format(**v), t.an.format(r=rn, **v), "negative", iid, t.name))
            i += 1
    for q, a, qb, ab, res in CODE_TEMPLATES:
        for j, f in enumerate(CODE_NAMES):
            n = 10 + 7 * j
            iid = f"code-{j:02d}"
            out.append(Item(iid, q.format(f=f, n=n), a.format(f=f, n=n, r=res(n)), "instance", None, "code", "code"))
            if j < 2:
                out.append(Item(f"{iid}-rw", qb.format(f=f, n=n), ab.format(f=f, n=n, r=res(n)), "rewording", iid,
                                "code", "code"))
    return out
