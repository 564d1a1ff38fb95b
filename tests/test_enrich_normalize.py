"""enrich's pure pieces: message normalisation, sentence splitting, JSON Lines parsing (no Spark)."""

from __future__ import annotations

import json

import pytest

from pipeline_core.config import EnrichSection
from samples import nemotron_v1
from spark_jobs.conversations.normalize import Rejected, normalise, split_reasoning
from spark_jobs.conversations.sentences import split_sentences
from spark_jobs.enrich.job import normalise_raw
from spark_jobs.enrich.readers import parse_json_line
from spark_jobs.enrich.scoring import ScoringParams, score_record


def m(role, content, tool_calls=None):
    return {"role": role, "content": content, "tool_calls": tool_calls}


def call(name, args):
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}


def _crafted():
    for rs in nemotron_v1.generate(300, 0).values():
        for r in rs:
            s = json.loads(r["metadata"])["sample"]
            if s["kind"] != "filler":
                yield r, s


def test_every_crafted_record_normalises_as_its_metadata_says():
    seen = set()
    for r, s in _crafted():
        exp = s["expected"]
        got = normalise_raw(r["uuid"], None if r["messages"] is None else json.dumps(r["messages"]), None, EnrichSection())
        assert got["reason"] == exp.get("reject_reason"), (s, r["messages"])
        seen.add(s["kind"])
        for key in ("question", "answer", "reasoning_trace", "context_sentences"):
            if key in exp:
                assert got[key] == exp[key], (key, s)
        for sentence in exp.get("relevant", []):
            assert sentence in got["context_sentences"]
        if "tool_call" in exp:
            assert exp["tool_call"] in got["context_sentences"]
    assert {"context_selection", "chat_single", "chat_multi", "tool", "reasoning", "malformed"} <= seen


def test_question_is_last_answered_user_turn_and_tools_are_context():
    msgs = [
        m("system", "Use tools. Be exact."),
        m("user", "Hi there."), m("assistant", "<think>greeting</think>Hello! How can I help?"),
        m("user", "Weather in Oslo?"),
        m("assistant", None, [call("get_weather", '{"city": "Oslo"}')]),
        m("tool", '{"temp": 3}'),
        m("assistant", "Let me also check tomorrow.", [call("forecast", "")]),
        m("tool", "Tomorrow: snow. Wind from the north."),
        m("assistant", "<think>3 degrees, snow</think>\n\nIt is 3 °C; snow tomorrow."),
        m("user", "ok"),  # unanswered: not the question
    ]
    n = normalise(msgs)
    assert n.question == "Weather in Oslo?"
    assert n.answer == "It is 3 °C; snow tomorrow."
    assert n.reasoning_trace == "3 degrees, snow"
    assert n.context_sentences == [
        "Use tools.", "Be exact.", "Hi there.", "Hello!", "How can I help?",  # earlier trace removed
        'get_weather({"city": "Oslo"})', '{"temp": 3}',
        "Let me also check tomorrow.", "forecast({})", "Tomorrow: snow.", "Wind from the north.",
    ]


@pytest.mark.parametrize(
    ("mode", "answer", "trace"),
    [("separate", "42", "think hard"), ("drop", "42", None), ("inline", "<think>think hard</think> 42", None)],
)
def test_reasoning_modes(mode, answer, trace):
    n = normalise([m("user", "Q?"), m("assistant", "<think>think hard</think> 42")], reasoning=mode)
    assert (n.answer, n.reasoning_trace) == (answer, trace)


def test_unclosed_think_is_all_reasoning():
    assert split_reasoning("<think>still thinking") == ("", "still thinking")
    with pytest.raises(Rejected) as e:
        normalise([m("user", "Q?"), m("assistant", "<think>still thinking")])
    assert e.value.reason == "empty_answer"


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        (None, "empty_messages"),
        ([], "empty_messages"),
        (["not a dict"], "bad_message"),
        ([m("user", "Q"), {"role": None, "content": "x"}, m("assistant", "A")], "unknown_role"),
        ([m("user", ["parts"]), m("assistant", "A")], "bad_content"),
        ([m("user", "Q"), m("assistant", "", [call("f", "{oops")]), m("tool", "r"), m("assistant", "A")],
         "bad_tool_arguments"),
        ([m("user", "Q"), m("assistant", "", [{"id": "x"}]), m("tool", "r"), m("assistant", "A")], "bad_tool_call"),
        ([m("assistant", "A"), m("user", "Q")], "no_answered_question"),
        ([m("user", "Q"), m("system", "S"), m("assistant", "A")], "roles_out_of_order"),
        ([m("user", None), m("assistant", "A")], "prompt_withheld"),
        ([m("user", "-"), m("assistant", "A")], "prompt_withheld"),
    ],
)
def test_rejects_with_reason(messages, reason):
    with pytest.raises(Rejected) as e:
        normalise(messages)
    assert e.value.reason == reason


def test_long_context_is_bounded_nearest_the_question():
    system = " ".join(f"Sentence number {i} is here." for i in range(50))
    n = normalise([m("system", system + " " + "Z" * 100), m("user", "Q?"), m("assistant", "A.")],
                  max_context_sentences=10, max_sentence_chars=20)
    assert len(n.context_sentences) == 10
    assert n.context_sentences[-1] == "Z" * 20
    assert n.context_sentences[0] == "Sentence number 41 i"
    assert all(len(s) <= 20 for s in n.context_sentences)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The museum opens at 10 a.m. on Sundays. Dr. Smith works there! Is it 3.5 km away? Yes.",
         ["The museum opens at 10 a.m. on Sundays.", "Dr. Smith works there!", "Is it 3.5 km away?", "Yes."]),
        ("Das ist z. B. ein Haus. Die Bibliothek schließt um 14 Uhr.", ["Das ist z. B. ein Haus.", "Die Bibliothek schließt um 14 Uhr."]),
        ("Quelle est la capitale ? Ottawa, bien sûr.", ["Quelle est la capitale ?", "Ottawa, bien sûr."]),
        ("¿Has visto la película? ¡Qué calor hace hoy!", ["¿Has visto la película?", "¡Qué calor hace hoy!"]),
        ("我喝了咖啡。你喜欢苹果吗？明天下雨！", ["我喝了咖啡。", "你喜欢苹果吗？", "明天下雨！"]),
        ("富士山は高いです。猫が寝ています！", ["富士山は高いです。", "猫が寝ています！"]),
        ('He said "Stop." Then he left.\n- item one\n- item two', ['He said "Stop."', "Then he left.", "- item one", "- item two"]),
        ("", []),
        (None, []),
    ],
)
def test_sentence_splitting(text, expected):
    assert split_sentences(text) == expected


def test_json_lines_parsing_never_raises():
    ok = parse_json_line(json.dumps({"uuid": 7, "messages": [m("user", "Q"), m("assistant", "A")], "metadata": {"a": 1}}))
    assert ok["read_error"] is None and ok["uuid"] == "7" and ok["metadata"] == '{"a": 1}'
    assert json.loads(ok["messages_json"])[1]["content"] == "A"
    assert parse_json_line("{broken")["read_error"].startswith("unparseable_json")
    assert parse_json_line("[1, 2]")["read_error"].startswith("not_an_object")
    e = EnrichSection()
    assert normalise_raw("u", None, "unparseable_json: x", e)["reason"] == "unparseable_json"
    assert normalise_raw("u", '"a string"', None, e)["reason"] == "bad_message"
    assert normalise_raw(" ", "[]", None, e)["reason"] == "missing_id"


def test_scoring_keeps_top_k_over_threshold_in_context_order():
    import numpy as np

    q, a = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    s = np.array([[0.0, -1.0], [0.6, 0.8], [1.0, 0.0], [0.8, 0.6]])
    r = score_record(q, a, s, ScoringParams(top_k=2, threshold=0.5))
    assert [i for i, _ in r["relevant_sentences"]] == [1, 3]  # the two best (0.7, 0.7), in order
    assert r["sim_question_answer"] == 0.0 and r["sim_context_question"] is not None
    empty = score_record(q, a, np.zeros((0, 2)), ScoringParams())
    assert empty["sim_context_question"] is None and empty["relevant_sentences"] == []
