"""Deterministic sample in the Nemotron-Post-Training-Dataset-v1 schema (DESIGN.md "The input schema").

    python -m samples.nemotron_v1 --output DIR [--rows N] [--seed S] [--jsonl]

writes `DIR/data/{chat,code,math,stem,tool}-00000-of-00001.parquet`. The bundled copy lives in
`sample_data/nemotron_v1/`. Besides ordinary records the sample carries crafted ones whose
expected outcome is stored in `metadata` (JSON) under `"sample"`:

    {"sample": {"kind": "...", "expected": {"question": ..., "answer": ..., "reasoning_trace": ...,
                                              "relevant": [sentence, ...], "reject_reason": ...,
                                              "duplicate_of": uuid, "mismatched": true}}}

so tests (enrich: normalisation, relevant-sentence selection, rejects; filter: duplicates,
mismatched pairs) read the truth from the data rather than from a second copy of it.
Kinds: chat_single, chat_multi, context_selection (system prompt mixing one relevant sentence
with irrelevant ones; English, German, French, Spanish, Chinese, Japanese), code_chat (multi-turn,
fenced and indented code), style_system (a system prompt that sets a style), tool (calls and
results, tool schemas in metadata `tools` as in v1's tool_calling), reasoning (<think> blocks, a
lone `</think>`, reasoning off), multi_answer (several answers to one prompt), exact_duplicate,
near_duplicate, mismatch, and malformed records (null/empty messages, no assistant answer, null
content, withheld prompts `""`/`"-"`/white space, roles out of order, unparseable tool arguments,
unknown role, answer that is only a reasoning trace, missing uuid).
"""

from __future__ import annotations

import argparse
import json
import random
import uuid as uuidlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from samples import tables

SPLITS = ("chat", "code", "math", "stem", "tool")
CATEGORY = {"chat": "chat", "code": "code", "math": "math", "stem": "stem", "tool": "tool_calling"}
GENERATORS = ("Qwen3-235B-A22B", "DeepSeek-R1-0528")


def arrow_schema():
    """The exact v1 schema: messages is list<struct<role, content, tool_calls: list<struct<id, type,
    function: struct<name, arguments>>>>>; every other field is a string."""
    import pyarrow as pa

    function = pa.struct([("name", pa.string()), ("arguments", pa.string())])
    tool_call = pa.struct([("id", pa.string()), ("type", pa.string()), ("function", function)])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(tool_call))])
    return pa.schema([
        ("uuid", pa.string()), ("license", pa.string()), ("generator", pa.string()), ("version", pa.string()),
        ("category", pa.string()), ("reasoning", pa.string()), ("messages", pa.list_(message)),
        ("metadata", pa.string()),
    ])


@dataclass(frozen=True)
class Fact:
    split: str
    question: str
    answer: str
    evidence: str  # the one context sentence that supports the answer
    paraphrase: str  # the question said differently (near duplicates)


# English facts; the evidence sentence shares the question's subject so a sentence encoder can find it.
FACTS: tuple[Fact, ...] = (
    Fact("chat", "What is the capital of Australia?", "The capital of Australia is Canberra.",
         "Canberra was chosen as the capital of Australia in 1908 as a compromise between Sydney and Melbourne.",
         "Which city is Australia's capital?"),
    Fact("chat", "How tall is Mount Everest?", "Mount Everest is about 8,849 metres tall.",
         "Mount Everest rises 8,849 metres above sea level, the highest peak on Earth.",
         "What is the height of Mount Everest?"),
    Fact("chat", "Who wrote the novel Pride and Prejudice?", "Jane Austen wrote Pride and Prejudice, published in 1813.",
         "Jane Austen published her novel Pride and Prejudice in 1813.",
         "Which author wrote Pride and Prejudice?"),
    Fact("chat", "When does the museum open on Sundays?", "On Sundays the museum opens at 10 a.m.",
         "The museum opens at 10 a.m. on Sundays and closes at 6 p.m.",
         "What time does the museum open on a Sunday?"),
    Fact("chat", "How long should I boil an egg for a soft yolk?", "Boil it for about six minutes for a soft yolk.",
         "For a soft yolk, boil the egg for six minutes and then cool it in cold water.",
         "For how many minutes do I boil an egg to keep the yolk soft?"),
    Fact("chat", "What is the refund policy for damaged items?", "Damaged items can be refunded within 30 days of delivery.",
         "Customers may return damaged items for a full refund within 30 days of delivery.",
         "Can I get a refund if my item arrived damaged?"),
    Fact("stem", "What is the chemical symbol for gold?", "The chemical symbol for gold is Au.",
         "Gold has the chemical symbol Au, from the Latin word aurum.",
         "Which symbol does gold have in the periodic table?"),
    Fact("stem", "What is the speed of light in a vacuum?", "Light travels at about 299,792 kilometres per second in a vacuum.",
         "In a vacuum, light travels at 299,792 kilometres per second.",
         "How fast does light travel in vacuum?"),
    Fact("stem", "What organelle produces energy in a cell?", "The mitochondria produce most of a cell's energy as ATP.",
         "Mitochondria are the organelles that produce energy for the cell in the form of ATP.",
         "Which part of a cell generates its energy?"),
    Fact("stem", "At what temperature does water boil at sea level?", "At sea level water boils at 100 degrees Celsius.",
         "Water boils at 100 degrees Celsius at sea level, and at lower temperatures at altitude.",
         "What is the boiling point of water at sea level?"),
    Fact("stem", "What gas do plants absorb during photosynthesis?", "Plants absorb carbon dioxide during photosynthesis.",
         "During photosynthesis, plants absorb carbon dioxide and release oxygen.",
         "Which gas is taken in by plants for photosynthesis?"),
    Fact("code", "How do I reverse a list in Python?", "Use `my_list[::-1]` for a reversed copy, or `my_list.reverse()` to reverse it in place.",
         "In Python, a list can be reversed with slicing like my_list[::-1] or in place with my_list.reverse().",
         "What is the way to reverse a Python list?"),
    Fact("code", "How do I read a file line by line in Python?", "Open it with `with open(path) as f:` and iterate `for line in f:`.",
         "To read a file line by line in Python, open it in a with block and iterate over the file object.",
         "In Python, how can I iterate over the lines of a file?"),
    Fact("code", "How do I count rows in a Spark DataFrame?", "Call `df.count()`; it runs a job and returns the number of rows.",
         "The count method of a Spark DataFrame returns the number of rows by running a job.",
         "What is the method to get the number of rows of a Spark DataFrame?"),
    Fact("code", "How do I create a new git branch?", "Run `git switch -c my-branch` (or `git checkout -b my-branch`).",
         "A new git branch is created with git switch -c followed by the branch name.",
         "What command creates a git branch?"),
    Fact("math", "What is 12 multiplied by 13?", "12 multiplied by 13 is 156.",
         "Multiplying 12 by 13 gives 156.",
         "What do you get when you multiply 12 and 13?"),
    Fact("math", "What is the derivative of x squared?", "The derivative of x^2 is 2x.",
         "The derivative of x squared with respect to x is 2x.",
         "Differentiate x^2 with respect to x."),
    Fact("math", "What is the sum of the angles of a triangle?", "The angles of a triangle add up to 180 degrees.",
         "In Euclidean geometry the three angles of a triangle always sum to 180 degrees.",
         "How many degrees do a triangle's angles add up to?"),
    Fact("math", "What is the square root of 144?", "The square root of 144 is 12.",
         "Since 12 times 12 equals 144, the square root of 144 is 12.",
         "Compute the square root of 144."),
)

# Sentences about nothing any question asks: the noise a relevant-sentence selector must skip.
IRRELEVANT = (
    "The office cafeteria serves lunch between noon and two.",
    "Please keep your answers polite and concise.",
    "Our team picnic has been moved to the last Friday of the month.",
    "The parking garage on level three is closed for painting.",
    "Remember to water the plants in the lobby every Tuesday.",
    "The printer on the second floor is out of toner again.",
    "Annual performance reviews start in November.",
    "A new coffee machine was installed in the kitchen.",
)

# Non-English context selection: question, answer, evidence and irrelevant sentences in one language.
# Written without spaces after CJK punctuation, so splitting cannot rely on ". ".
FOREIGN: tuple[dict[str, Any], ...] = (
    {"lang": "de", "question": "Wann schließt die Bibliothek am Samstag?",
     "answer": "Am Samstag schließt die Bibliothek um 14 Uhr.",
     "evidence": "Die Bibliothek schließt am Samstag um 14 Uhr.",
     "noise": ["Der Hund unseres Nachbarn bellt jeden Morgen.", "Im Sommer fahren wir gern ans Meer!",
               "Hast du schon das neue Kochbuch gelesen?"]},
    {"lang": "fr", "question": "Quelle est la capitale du Canada ?",
     "answer": "La capitale du Canada est Ottawa.",
     "evidence": "Ottawa est la capitale du Canada depuis 1857.",
     "noise": ["Mon chat dort toute la journée sur le canapé.", "Il pleut beaucoup en novembre à Brest !",
               "Aimez-vous le fromage de chèvre ?"]},
    {"lang": "es", "question": "¿Cuántos jugadores tiene un equipo de fútbol en el campo?",
     "answer": "Un equipo de fútbol tiene once jugadores en el campo.",
     "evidence": "Cada equipo de fútbol juega con once jugadores en el campo.",
     "noise": ["Mi abuela prepara una paella deliciosa los domingos.", "¡Qué calor hace hoy en Sevilla!",
               "¿Has visto la nueva película de terror?"]},
    {"lang": "zh", "question": "长城有多长？",
     "answer": "长城全长约两万一千公里。",
     "evidence": "长城全长约两万一千公里，是世界上最长的建筑。",
     "noise": ["我今天早上喝了一杯咖啡。", "你喜欢吃苹果吗？", "明天可能会下雨！"]},
    {"lang": "ja", "question": "富士山の高さは何メートルですか？",
     "answer": "富士山の高さは3776メートルです。",
     "evidence": "富士山の高さは3776メートルで、日本で一番高い山です。",
     "noise": ["昨日は友達と映画を見ました。", "猫が窓のそばで寝ています！", "この店のラーメンはおいしいですか？"]},
)

TOOLS = (
    {"name": "get_weather", "description": "Current weather for a city",
     "question": "What's the weather like in Paris right now?", "arguments": {"city": "Paris", "unit": "celsius"},
     "result": {"city": "Paris", "temperature_c": 18, "conditions": "light rain"},
     "answer": "It is 18 °C in Paris with light rain right now."},
    {"name": "convert_currency", "description": "Convert an amount between currencies",
     "question": "How much is 100 US dollars in euros?", "arguments": {"amount": 100, "from": "USD", "to": "EUR"},
     "result": {"amount": 92.4, "currency": "EUR", "rate": 0.924},
     "answer": "100 US dollars is about 92.40 euros at the current rate of 0.924."},
    {"name": "search_flights", "description": "Find flights between two airports on a date",
     "question": "Find me a flight from Berlin to Rome on 3 May.", "arguments": {"from": "BER", "to": "FCO", "date": "2025-05-03"},
     "result": {"flights": [{"number": "AZ 431", "departs": "09:10", "price_eur": 129}]},
     "answer": "Flight AZ 431 leaves Berlin for Rome on 3 May at 09:10 and costs 129 euros."},
    {"name": "get_stock_price", "description": "Latest stock price for a ticker",
     "question": "What is Apple's stock price?", "arguments": {"ticker": "AAPL"},
     "result": {"ticker": "AAPL", "price_usd": 227.5},
     "answer": "Apple (AAPL) is trading at 227.50 US dollars."},
)


class _Gen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.tables: dict[str, list] = {}  # filler topic tables per split (built on first use)
        self.pools: dict[str, list] = {}  # their entries not drawn yet

    def uuid(self) -> str:
        return str(uuidlib.UUID(int=self.rng.getrandbits(128), version=4))

    def record(self, split: str, messages: list[dict] | None, *, kind: str, expected: dict | None = None,
               reasoning: str = "off", extra_meta: dict | None = None, uuid: str | None = "") -> dict:
        meta = {"sample": {"kind": kind, "expected": expected or {}}, **(extra_meta or {})}
        return {
            "uuid": self.uuid() if uuid == "" else uuid,
            "license": "cc-by-4.0",
            "generator": self.rng.choice(GENERATORS),
            "version": "v1",
            "category": CATEGORY[split],
            "reasoning": reasoning,
            "messages": messages,
            "metadata": json.dumps(meta, ensure_ascii=False, sort_keys=True),
        }


def msg(role: str, content: str | None, tool_calls: list[dict] | None = None) -> dict:
    return {"role": role, "content": content, "tool_calls": tool_calls}


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_schema(t: dict) -> dict:
    """The OpenAI-style definition v1's tool_calling records carry in `metadata` ("tools")."""
    kinds = {str: "string", int: "number", float: "number"}
    props = {k: {"type": kinds.get(type(v), "string")} for k, v in t["arguments"].items()}
    return {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": sorted(props)}}}


CODE_CHAT = (
    "How do I read a CSV file in Python and sum one column?",
    "Use the standard library's `csv` module:\n\n```python\nimport csv\n\ndef column_sum(path, column):\n"
    "    total = 0.0\n    with open(path, newline=\"\") as f:\n        for row in csv.DictReader(f):\n"
    "            total += float(row[column])\n    return total\n```\n\n`DictReader` maps each row to the header names.",
    "How would I skip rows where the value is empty?",
    "Check the value before converting it:\n\n```python\n        value = row[column].strip()\n        if not value:\n"
    "            continue\n        total += float(value)\n```\n\nEmpty strings are falsy, so `continue` skips them.",
)
STYLE_CHAT = (
    "You are a pirate captain. Answer every question in the voice of a pirate, and keep it short.",
    "What is the capital of Portugal?",
    "Arr, the capital o' Portugal be Lisbon, matey, a fine port on the Tagus!",
)
# One prompt, several answers (v1 has ~7.5 per question in math/stem): they must share a split.
MULTI_ANSWER = (
    "What is 12 multiplied by 12?",
    ("144.",
     "12 x 12 = 144: twelve tens make 120 and twelve twos make 24, and 120 + 24 = 144.",
     "A dozen dozens, called a gross, is 144 items, so 12 times 12 equals 144."),
)


def _system(g: _Gen, fact: Fact, n_noise: int = 3) -> tuple[str, list[str]]:
    sentences = [fact.evidence, *g.rng.sample(IRRELEVANT, n_noise)]
    g.rng.shuffle(sentences)
    return " ".join(sentences), sentences


def _think(fact: Fact) -> str:
    return f"The user asks: {fact.question} I recall that {fact.evidence[0].lower()}{fact.evidence[1:]} So the answer is clear."


def crafted(g: _Gen) -> list[tuple[str, dict]]:
    """The fixed set of records whose expected outcome is known: (split, record)."""
    out: list[tuple[str, dict]] = []
    add = out.append
    facts = list(FACTS)

    # Context selection, English: one relevant sentence among irrelevant ones, in the system prompt.
    for f in facts:
        system, _ = _system(g, f)
        add((f.split, g.record(f.split, [msg("system", system), msg("user", f.question), msg("assistant", f.answer)],
                               kind="context_selection",
                               expected={"question": f.question, "answer": f.answer, "relevant": [f.evidence],
                                         "lang": "en"})))
    # Context selection, other languages, with the noise around the evidence.
    for x in FOREIGN:
        sentences = [*x["noise"][:2], x["evidence"], x["noise"][2]]
        sep = "" if x["lang"] in ("zh", "ja") else " "
        add(("chat", g.record("chat", [msg("system", sep.join(sentences)), msg("user", x["question"]),
                                        msg("assistant", x["answer"])],
                              kind="context_selection",
                              expected={"question": x["question"], "answer": x["answer"], "relevant": [x["evidence"]],
                                        "lang": x["lang"], "context_sentences": sentences})))
    # Single turn, no system prompt; multi-turn where the question is the last answered user turn.
    for f in facts[:6]:
        add((f.split, g.record(f.split, [msg("user", f.question), msg("assistant", f.answer)], kind="chat_single",
                               expected={"question": f.question, "answer": f.answer, "context_sentences": []})))
    for a, b in zip(facts[:5], facts[6:11], strict=True):
        add(("chat", g.record("chat", [msg("system", "You are a helpful assistant."), msg("user", a.question),
                                       msg("assistant", a.answer), msg("user", b.question), msg("assistant", b.answer)],
                              kind="chat_multi",
                              expected={"question": b.question, "answer": b.answer,
                                        "context_sentences": ["You are a helpful assistant.", a.question, a.answer]})))
    # A trailing user turn that nobody answered: the question is the last *answered* one.
    f = facts[2]
    add(("chat", g.record("chat", [msg("user", f.question), msg("assistant", f.answer), msg("user", "Thanks!")],
                          kind="chat_multi", expected={"question": f.question, "answer": f.answer})))
    # Reasoning on: the trace is kept apart from the answer.
    for f in facts[15:19] + facts[6:8]:
        think = _think(f)
        add((f.split, g.record(f.split, [msg("system", ""), msg("user", f.question),
                                         msg("assistant", f"<think>\n{think}\n</think>\n\n{f.answer}")],
                               kind="reasoning", reasoning="on",
                               expected={"question": f.question, "answer": f.answer, "reasoning_trace": think})))
    # Tool calls: an assistant turn that only calls a tool, the tool's result, then the answer.
    for i, t in enumerate(TOOLS):
        call_id = f"call_{i:04d}"
        args = json.dumps(t["arguments"])
        tools_meta = {"tools": [tool_schema(t)]}
        add(("tool", g.record("tool", [
            msg("system", f"You can call the {t['name']} tool. Answer from the tool's result."),
            msg("user", t["question"]),
            msg("assistant", "", [tool_call(call_id, t["name"], args)]),
            msg("tool", json.dumps(t["result"])),
            msg("assistant", t["answer"]),
        ], kind="tool", extra_meta=tools_meta,
            expected={"question": t["question"], "answer": t["answer"], "tool_call": f"{t['name']}({args})"})))
    # Same with null content on the calling turn (as many dumps have it).
    t = TOOLS[0]
    add(("tool", g.record("tool", [msg("user", t["question"]),
                                   msg("assistant", None, [tool_call("call_null", t["name"], json.dumps(t["arguments"]))]),
                                   msg("tool", json.dumps(t["result"])), msg("assistant", t["answer"])],
                          kind="tool", expected={"question": t["question"], "answer": t["answer"]})))

    # Real shapes: a multi-turn code chat with fenced, indented code; a system prompt that sets a style.
    q1, a1, q2, a2 = CODE_CHAT
    add(("code", g.record("code", [msg("system", "You are a careful senior Python engineer."), msg("user", q1),
                                   msg("assistant", a1), msg("user", q2), msg("assistant", a2)],
                          kind="code_chat", expected={"question": q2, "answer": a2})))
    system, q, a = STYLE_CHAT
    add(("chat", g.record("chat", [msg("system", system), msg("user", q), msg("assistant", a)], kind="style_system",
                          expected={"question": q, "answer": a, "system": system})))
    # Reasoning: a trace that only closes (`</think>` without `<think>`), and reasoning off.
    f = facts[12]
    think = _think(f)
    add((f.split, g.record(f.split, [msg("user", f.question), msg("assistant", f"{think}\n</think>\n\n{f.answer}")],
                           kind="reasoning", reasoning="on",
                           expected={"question": f.question, "answer": f.answer, "reasoning_trace": think})))
    f = facts[13]
    add((f.split, g.record(f.split, [msg("system", ""), msg("user", f.question), msg("assistant", f.answer)],
                           kind="reasoning", reasoning="off",
                           expected={"question": f.question, "answer": f.answer, "reasoning_trace": None})))
    # Several answers to one prompt.
    q, answers = MULTI_ANSWER
    first = None
    for ans in answers:
        r = g.record("math", [msg("user", q), msg("assistant", ans)], kind="multi_answer",
                     expected={"question": q, "answer": ans, **({"same_prompt_as": first} if first else {})})
        first = first or r["uuid"]
        add(("math", r))
    # Withheld prompts as the real data has them: "-" in the code split, empty user content in chat.
    add(("code", g.record("code", [msg("user", "-"), msg("assistant", a1)], kind="malformed",
                          expected={"reject_reason": "prompt_withheld"})))
    add(("chat", g.record("chat", [msg("system", "You are a helpful assistant."), msg("user", ""),
                                   msg("assistant", "Hello! How can I help you today?")], kind="malformed",
                          expected={"reject_reason": "prompt_withheld"})))

    # Duplicates: an exact copy (new uuid, same everything else) and paraphrased questions.
    base = [r for s, r in out if json.loads(r["metadata"])["sample"]["kind"] == "chat_single"]
    for r in base[:4]:
        dup = dict(r, uuid=g.uuid(),
                   metadata=json.dumps({"sample": {"kind": "exact_duplicate", "expected": {"duplicate_of": r["uuid"]}}}))
        add((_split_of(r), dup))
    for f, r in zip(facts[:4], base[:4], strict=True):
        add((f.split, g.record(f.split, [msg("user", f.paraphrase), msg("assistant", f.answer)], kind="near_duplicate",
                               expected={"question": f.paraphrase, "answer": f.answer, "duplicate_of": r["uuid"]})))
    # Question/answer pairs that do not match.
    for a, b in [(0, 11), (3, 16), (6, 13), (8, 1), (14, 9), (17, 4)]:
        fa, fb = facts[a], facts[b]
        add((fa.split, g.record(fa.split, [msg("user", fa.question), msg("assistant", fb.answer)], kind="mismatch",
                                expected={"question": fa.question, "answer": fb.answer, "mismatched": True})))

    # Malformed records: each must be rejected with this reason, never dropped.
    f = facts[0]
    bad: list[tuple[list[dict] | None, str, dict]] = [
        (None, "empty_messages", {}),
        ([], "empty_messages", {}),
        ([msg("system", "Be brief."), msg("user", f.question)], "no_answered_question", {}),
        ([msg("assistant", f.answer), msg("user", f.question)], "no_answered_question", {}),
        ([msg("user", None), msg("assistant", f.answer)], "prompt_withheld", {}),
        ([msg("user", "   "), msg("assistant", f.answer)], "prompt_withheld", {}),
        ([msg("user", f.question), msg("assistant", None)], "no_answered_question", {}),
        ([msg("user", f.question), msg("assistant", "<think>Only thinking, no answer.</think>")], "empty_answer", {}),
        ([msg("user", f.question), msg("system", "Late system prompt."), msg("assistant", f.answer)],
         "roles_out_of_order", {}),
        ([msg("user", f.question), msg("tool", '{"x": 1}'), msg("assistant", f.answer)], "roles_out_of_order", {}),
        ([msg("user", f.question), msg("narrator", "Meanwhile..."), msg("assistant", f.answer)], "unknown_role", {}),
        ([msg("user", TOOLS[0]["question"]),
          msg("assistant", "", [tool_call("call_bad", "get_weather", '{"city": "Paris", unit: celsius')]),
          msg("tool", json.dumps(TOOLS[0]["result"])), msg("assistant", TOOLS[0]["answer"])],
         "bad_tool_arguments", {}),
        ([msg("user", TOOLS[1]["question"]),
          msg("assistant", "", [{"id": "call_x", "type": "function", "function": None}]),
          msg("tool", json.dumps(TOOLS[1]["result"])), msg("assistant", TOOLS[1]["answer"])],
         "bad_tool_call", {}),
    ]
    for messages, reason, _ in bad:
        split = "tool" if reason in ("bad_tool_arguments", "bad_tool_call") else "chat"
        add((split, g.record(split, messages, kind="malformed", expected={"reject_reason": reason})))
    add(("chat", g.record("chat", [msg("user", f.question), msg("assistant", f.answer)], kind="malformed",
                          expected={"reject_reason": "missing_id"}, uuid=None)))
    return out


def _split_of(record: dict) -> str:
    return next(s for s, c in CATEGORY.items() if c == record["category"])


def _next_item(g: _Gen, split: str):
    """The split's next unused topic-table entry: each table is shuffled (seeded) and drawn without
    replacement, so records are distinct until the table runs out; then it is reshuffled."""
    if split not in g.tables:
        g.tables[split] = {"chat": tables.chat_items, "stem": tables.stem_items, "math": tables.math_items,
                           "code": lambda: tables.code_items(g.rng.choice), "tool": tables.tool_cases}[split]()
    pool = g.pools.get(split)
    if not pool:
        pool = g.pools[split] = list(g.tables[split])
        g.rng.shuffle(pool)
    return pool.pop()


def _filler_tool(g: _Gen, t: dict) -> dict:
    cid = f"call_{g.rng.getrandbits(32):08x}"
    call = tool_call(cid, t["name"], json.dumps(t["arguments"], ensure_ascii=False))
    tools_meta = {"tools": [tool_schema(t)]}
    shape = g.rng.randrange(4)
    system = [msg("system", f"You can call the {t['name']} tool. Answer from the tool's result.")] if shape == 0 else []
    content = {0: "", 1: None, 2: "Let me check that for you.", 3: ""}[shape]
    return g.record("tool", [*system, msg("user", t["question"]), msg("assistant", content, [call]),
                             msg("tool", tables.tool_result(t)), msg("assistant", t["answer"])],
                    kind="filler", extra_meta=tools_meta if shape in (0, 3) else None)


def filler(g: _Gen, split: str) -> dict:
    """An ordinary, well-formed record of `split` (no expectations): a question/answer pair from the
    split's topic table (samples/tables.py) that no other record of the sample uses,
    as a plain turn, with a system prompt mixing its evidence with noise, with a <think> trace, or
    after an earlier exchange (multi-turn). Non-English pairs stay plain."""
    item = _next_item(g, split)
    if split == "tool":
        return _filler_tool(g, item)
    shape = g.rng.randrange(4) if item.lang == "en" else 0
    turn = [msg("user", item.question), msg("assistant", item.answer)]
    if shape == 0:
        return g.record(split, turn, kind="filler")
    if shape == 1:
        sentences = [item.evidence, *g.rng.sample(IRRELEVANT + tables.NOISE, 2)]
        g.rng.shuffle(sentences)
        return g.record(split, [msg("system", " ".join(sentences)), *turn], kind="filler")
    if shape == 2:
        think = f"The user asks: {item.question} I recall: {item.evidence} That answers it."
        return g.record(split, [msg("system", ""), msg("user", item.question),
                                msg("assistant", f"<think>\n{think}\n</think>\n\n{item.answer}")],
                        kind="filler", reasoning="on")
    prior = g.rng.choice([x for x in g.tables[split] if x != item and x.lang == "en"])
    return g.record(split, [msg("system", "You are a helpful assistant."), msg("user", prior.question),
                            msg("assistant", prior.answer), *turn], kind="filler")


def generate(rows: int = 300, seed: int = 0) -> dict[str, list[dict]]:
    """Records per split: the crafted set, then ordinary ones until there are `rows` in total."""
    g = _Gen(seed)
    by_split: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for split, rec in crafted(g):
        by_split[split].append(rec)
    n = sum(len(v) for v in by_split.values())
    i = 0
    while n < rows:
        split = SPLITS[i % len(SPLITS)]
        by_split[split].append(filler(g, split))
        i += 1
        n += 1
    return by_split


def write_parquet(by_split: dict[str, list[dict]], output: str | Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = Path(output) / "data"
    data.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, records in by_split.items():
        if not records:
            continue
        p = data / f"{split}-00000-of-00001.parquet"
        pq.write_table(pa.Table.from_pylist(records, schema=arrow_schema()), p, compression="zstd")
        paths.append(p)
    return paths


def write_jsonl(records: Iterable[dict], path: str | Path, broken_lines: bool = True) -> Path:
    """The records as JSON Lines; with `broken_lines`, interleave lines no JSON reader accepts
    (truncated object, plain text, a JSON array, an empty line) for reader tests."""
    broken = ['{"uuid": "broken-1", "messages": [', "this is not json", '["a", "json", "array"]']
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for i, r in enumerate(records):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            if broken_lines and i < len(broken):
                f.write(broken[i] + "\n")
        if broken_lines:
            f.write("\n")  # blank lines are skipped, not rejected
    return p


BROKEN_JSONL_LINES = 3  # lines write_jsonl(broken_lines=True) adds that must become rejects


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True, help="directory; files go to OUTPUT/data/")
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jsonl", action="store_true", help="also write OUTPUT/jsonl/records.jsonl with broken lines")
    a = ap.parse_args(argv)
    by_split = generate(a.rows, a.seed)
    for p in write_parquet(by_split, a.output):
        print(p)
    if a.jsonl:
        print(write_jsonl([r for s in SPLITS for r in by_split[s]], Path(a.output) / "jsonl" / "records.jsonl"))


if __name__ == "__main__":
    main()
