"""Deterministic sample of the newer Nemotron shapes + the seed tables that restore them (issue 28).

    python -m samples.family --output sample_data

writes `nemotron_sft/data/{chat,tool,code}.jsonl` (the SFT collection's JSONL: `reasoning_content`,
null system / user turns with `metadata.seed_dataset` + `seed_prompt_sha256`, `train_turns`,
`tools` in every shape, `developer`, typed tool-result parts, OpenCodeReasoning-style `"-"` +
`dataset/split/index`) and two seed copies: `seeds/wildchat/data/train-00000-of-00001.parquet`
(WildChat-1M's `conversation` shape) and `seeds/taco/train.jsonl` (TACO's `question`). Each record's
expected outcome is in `metadata.sample` (`kind`, `expected`), as in the v1 sample, so tests read the
truth from the data. `PROMPT_SOURCES` is the configuration that restores them (relative to the
output directory); `lmsys/lmsys-chat-1m` and `codeparrot/apps` are named by rows but deliberately
not configured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from samples import nemotron_v1 as v1

WILDCHAT, LMSYS, TACO, APPS = "allenai/WildChat-1M", "lmsys/lmsys-chat-1m", "BAAI/TACO", "codeparrot/apps"
PROMPT_SOURCES = {WILDCHAT: "seeds/wildchat", TACO: "seeds/taco"}
FAMILY_FILES = ("chat", "tool", "code")
BROKEN_LINE = '{"uuid": "broken-line", "messages": [ {"role": "user"'

# seed conversations (WildChat shape): (system or None, first user prompt, first answer, later turns)
SEEDS = (
    (None, "What is the boiling point of water at sea level?", "Water boils at 100 °C at sea level.", ()),
    ("You are a concise geography tutor.", "Which river is the longest in Africa?",
     "The Nile is the longest river in Africa.", ()),
    (None, "Can you suggest a name for a grey cat?", "How about Smokey?",
     ("Something more unusual, please.", "Try Nimbus, after the rain cloud.")),
    (None, "How many legs does a spider have?", "A spider has eight legs.", ()),
    (None, "Solve x + 3 = 7.", "x = 4.", ()),
    (None, "Who are you?", "I am an assistant.", ()),
)
TACO_ROWS = (
    "Given two integers a and b, print their sum.\n\nInput\nTwo integers a and b.\n\nOutput\nPrint a + b.",
    "Given a string s, print it reversed.\n\nInput\nA string s.\n\nOutput\nThe reversed string.",
    "Given n, print the n-th Fibonacci number (F(0) = 0, F(1) = 1).",
)
TACO_ANSWERS = (
    "Read both numbers and print their sum:\n\n```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "Slice with a step of -1:\n\n```python\nprint(input()[::-1])\n```",
    "Iterate, keeping the last two values:\n\n```python\nn = int(input())\na, b = 0, 1\nfor _ in range(n):\n"
    "    a, b = b, a + b\nprint(a)\n```",
)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _meta(kind: str, expected: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"sample": {"kind": kind, "expected": expected or {}}, **fields}


def _sft(uid: str, messages: list[dict], meta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"uuid": uid, "license": "odc-by", "used_in": ["nano_v3"], "messages": messages, "metadata": meta, **fields}


def _a(content: str | None, reasoning: str | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


def chat_records() -> list[dict[str, Any]]:
    """Chat-v3-shaped rows: withheld system + first user turn, restored from WildChat by hash."""
    out = []
    seed_meta = {"seed_dataset": WILDCHAT, "model": "Qwen3-235B-A22B", "reward_model": "Qwen3-Nemotron-32B-RM"}
    withheld = [{"role": "system", "content": None}, {"role": "user", "content": None}]
    for i, (system, prompt, answer, _) in enumerate(SEEDS[:2]):
        out.append(_sft(f"sft-chat-{i}", [*withheld, _a(answer, f"The user asks: {prompt} Recall the fact.")],
                        _meta("restored", {"question": prompt, "answer": answer, "system": system},
                              seed_prompt_sha256=sha256_text(prompt), train_turns=[False, False, True], **seed_meta)))
    system, prompt, answer, (u2, a2) = SEEDS[2]
    flags = [False, False, True, False, True]
    out.append(_sft("sft-chat-flags", [*withheld, _a(answer, "A grey cat: a smoky name fits."), {"role": "user", "content": u2},
                                       _a(a2, "Unusual: a cloud name.")],
                    _meta("train_turns", {"question": u2, "answer": a2, "documents": 2, "same_prompt_as": "sft-chat-prefix"},
                          seed_prompt_sha256=sha256_text(prompt), train_turns=flags, **seed_meta)))
    out.append(_sft("sft-chat-prefix", [*withheld, _a(answer, "A grey cat: a smoky name fits.")],
                    _meta("train_turns", {"question": prompt, "answer": answer},
                          seed_prompt_sha256=sha256_text(prompt), train_turns=[False, False, True], **seed_meta)))
    out.append(_sft("sft-chat-unmatched", [*withheld, _a("An answer to a prompt no copy holds.")],
                    _meta("malformed", {"reject_reason": "prompt_not_found"},
                          seed_prompt_sha256=sha256_text("a prompt that is in no seed table"), **seed_meta)))
    out.append(_sft("sft-chat-lmsys", [{"role": "user", "content": None}, _a("An answer to an lmsys prompt.")],
                    _meta("malformed", {"reject_reason": "prompt_source_missing"}, seed_dataset=LMSYS,
                          seed_prompt_sha256=sha256_text("hello"))))
    _, prompt, answer, _ = SEEDS[3]
    out.append(_sft("sft-chat-bad-flags", [*withheld, _a(answer)],
                    _meta("malformed", {"reject_reason": "bad_train_turns"}, seed_prompt_sha256=sha256_text(prompt),
                          train_turns=[False, True], **seed_meta)))
    out.append(_sft("sft-chat-developer", [{"role": "developer", "content": "Answer in one short sentence."},
                                           {"role": "user", "content": "What colour is a ripe banana?"},
                                           _a("A ripe banana is yellow.", "   ")],
                    _meta("developer", {"question": "What colour is a ripe banana?", "answer": "A ripe banana is yellow.",
                                        "system": "Answer in one short sentence.", "reasoning_trace": None})))
    _, prompt, _, _ = SEEDS[4]
    out.append(_sft("sft-chat-latex", [*withheld, _a("Subtract 3 from both sides: $\x08oxed{4}$.", "x = 7 - 3 = 4")],
                    _meta("backspace", {"question": prompt, "answer": "Subtract 3 from both sides: $\\boxed{4}$."},
                          seed_prompt_sha256=sha256_text(prompt), **seed_meta)))
    _, prompt, _, _ = SEEDS[5]
    out.append(_sft("sft-chat-identity", [*withheld, _a("I am Qwen, a large language model created by Alibaba Cloud.")],
                    _meta("identity", {"question": prompt, "filter_reject_reason": "identity_mismatch"},
                          seed_prompt_sha256=sha256_text(prompt), **seed_meta)))
    out.append(_sft("sft-chat-license", [{"role": "user", "content": "Name a primary colour."},
                                         _a("Red is a primary colour.")],
                    _meta("license", {"question": "Name a primary colour.", "license": "cc-by-nc-4.0"}),
                    license="cc-by-nc-4.0"))
    return out


def _tool_messages(t: dict[str, Any], call_args: Any, result: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": t["question"]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": t["name"], "arguments": call_args}}]},
            {"role": "tool", "content": result},
            _a(t["answer"])]


def tool_records() -> list[dict[str, Any]]:
    """The tool shapes: `tools` list / JSON string / MCP in metadata / in the system prompt;
    arguments as an object or a string; a result as typed parts; a null result."""
    out = []
    schemas = [v1.tool_schema(t) for t in v1.TOOLS]
    mcp = [{"name": s["function"]["name"], "description": s["function"]["description"],
            "inputSchema": s["function"]["parameters"]} for s in schemas]
    t0, t1, t2, t3 = v1.TOOLS
    res = [json.dumps(t["result"]) for t in v1.TOOLS]
    exp = {"tool": {"question": t0["question"], "answer": t0["answer"]}}
    out.append(_sft("sft-tool-list", _tool_messages(t0, t0["arguments"], res[0]),
                    _meta("tool_shape", {**exp["tool"], "shape": "tools list, arguments object"}), tools=[schemas[0]]))
    out.append(_sft("sft-tool-string", _tool_messages(t1, json.dumps(t1["arguments"]), res[1]),
                    _meta("tool_shape", {"question": t1["question"], "answer": t1["answer"],
                                         "shape": "tools JSON string, arguments string"}), tools=json.dumps([schemas[1]])))
    out.append(_sft("sft-tool-mcp", _tool_messages(t2, t2["arguments"], [{"type": "text", "text": res[2]}]),
                    _meta("tool_shape", {"question": t2["question"], "answer": t2["answer"],
                                         "shape": "MCP in metadata.tools, result as typed parts"}, tools=[mcp[2]])))
    system = {"role": "system", "content": f"You can call tools.\n\n<tools>\n{json.dumps(schemas[3])}\n</tools>"}
    out.append(_sft("sft-tool-system", [system, *_tool_messages(t3, t3["arguments"], res[3])],
                    _meta("tool_shape", {"question": t3["question"], "answer": t3["answer"],
                                         "shape": "tools in the system prompt", "system": "You can call tools."})))
    out.append(_sft("sft-tool-null-result", _tool_messages(t0, t0["arguments"], None),
                    _meta("malformed", {"reject_reason": "content_withheld"}), tools=[schemas[0]]))
    return out


def code_records() -> list[dict[str, Any]]:
    """OpenCodeReasoning-style rows: `input` "-", the question addressed by dataset/split/index."""
    out = []
    for i, answer in enumerate(TACO_ANSWERS[:2]):
        out.append({"id": f"sft-code-taco-{i}", "input": "-", "output": answer, "dataset": "taco", "split": "train",
                    "index": str(i), "license": "apache-2.0", "source": "codeforces",
                    "metadata": _meta("restored", {"question": TACO_ROWS[i], "answer": answer})})
    out.append({"id": "sft-code-taco-missing", "input": "-", "output": TACO_ANSWERS[2], "dataset": "taco",
                "split": "train", "index": "99", "license": "apache-2.0",
                "metadata": _meta("malformed", {"reject_reason": "prompt_not_found"})})
    out.append({"id": "sft-code-apps", "input": "-", "output": TACO_ANSWERS[2], "dataset": "apps", "split": "test",
                "index": "3", "license": "apache-2.0",
                "metadata": _meta("malformed", {"reject_reason": "prompt_source_missing"})})
    out.append(_sft("sft-code-v1-dash", [{"role": "user", "content": "-"}, _a(TACO_ANSWERS[0])],
                    _meta("malformed", {"reject_reason": "prompt_withheld"})))
    return out


def seed_conversations() -> list[dict[str, Any]]:
    """WildChat-1M-shaped rows: `conversation` list of turns (+ a few of its other columns)."""
    rows = []
    for i, (system, prompt, answer, later) in enumerate(SEEDS):
        conv = [{"role": "system", "content": system, "language": "English"}] if system else []
        conv += [{"role": "user", "content": prompt, "language": "English"},
                 {"role": "assistant", "content": answer, "language": "English"}]
        for j in range(0, len(later), 2):
            conv += [{"role": "user", "content": later[j], "language": "English"},
                     {"role": "assistant", "content": later[j + 1], "language": "English"}]
        rows.append({"conversation_hash": sha256_text(f"seed-{i}")[:32], "model": "gpt-4-0314", "turn": len(conv) // 2,
                     "conversation": conv, "language": "English"})
    # a second conversation opening with the same prompt: the join keeps one (deterministically)
    rows.append({**rows[0], "conversation_hash": sha256_text("seed-dup")[:32]})
    return rows


def write(output: str | Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(output)
    paths = []
    for name, recs in (("chat", chat_records()), ("tool", tool_records()), ("code", code_records())):
        p = root / "nemotron_sft" / "data" / f"{name}.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in recs]
        if name == "chat":
            lines.insert(3, BROKEN_LINE)  # line 4: a line that does not parse is a reject naming file and line
        p.write_text("\n".join(lines) + "\n")
        paths.append(p)
    seeds = root / "seeds" / "wildchat" / "data" / "train-00000-of-00001.parquet"
    seeds.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(seed_conversations()), seeds)
    taco = root / "seeds" / "taco" / "train.jsonl"
    taco.parent.mkdir(parents=True, exist_ok=True)
    taco.write_text("".join(json.dumps({"question": q, "solutions": json.dumps([a]), "difficulty": "EASY"}) + "\n"
                            for q, a in zip(TACO_ROWS, TACO_ANSWERS, strict=True)))
    return [*paths, seeds, taco]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--output", required=True, help="directory (sample_data/): nemotron_sft/ and seeds/ go under it")
    for f in write(p.parse_args(argv).output):
        print(f)


if __name__ == "__main__":
    main()
