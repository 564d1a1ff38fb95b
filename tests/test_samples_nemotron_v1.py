"""The bundled sample: exact Nemotron v1 schema, deterministic, covers every shape the stages must handle."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from samples import nemotron_v1

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "sample_data" / "nemotron_v1" / "data"


def _bundled() -> dict[str, list[dict]]:
    return {s: pq.read_table(BUNDLED / f"{s}-00000-of-00001.parquet").to_pylist() for s in nemotron_v1.SPLITS}


def test_bundled_files_have_the_exact_v1_schema_and_stay_small():
    total = 0
    for split in nemotron_v1.SPLITS:
        p = BUNDLED / f"{split}-00000-of-00001.parquet"
        assert pq.read_schema(p).equals(nemotron_v1.arrow_schema(), check_metadata=False), split
        total += p.stat().st_size
    assert total < 1_000_000


def test_bundled_sample_is_what_the_generator_produces(tmp_path):
    # Same seed -> same records; the committed files are reproducible from the code.
    assert nemotron_v1.generate(300, 0) == nemotron_v1.generate(300, 0)
    assert nemotron_v1.generate(300, 0) != nemotron_v1.generate(300, 1)
    nemotron_v1.main(["--output", str(tmp_path), "--rows", "300", "--seed", "0"])
    for split in nemotron_v1.SPLITS:
        name = f"{split}-00000-of-00001.parquet"
        assert pq.read_table(tmp_path / "data" / name).equals(pq.read_table(BUNDLED / name)), split


def test_sample_covers_every_shape():
    records = [r for rs in _bundled().values() for r in rs]
    assert 200 <= len(records) <= 1000
    kinds, reasons, langs = set(), set(), set()
    for r in records:
        s = json.loads(r["metadata"])["sample"]
        kinds.add(s["kind"])
        reasons.add(s["expected"].get("reject_reason"))
        langs.add(s["expected"].get("lang"))
    assert {"chat_single", "chat_multi", "context_selection", "tool", "reasoning", "exact_duplicate",
            "near_duplicate", "mismatch", "malformed", "code_chat", "style_system", "multi_answer"} <= kinds
    assert any(r["messages"] and r["messages"][0]["content"] == "-" for r in records if r["messages"])  # v1 code's "-"
    assert any("</think>" in (m["content"] or "") and "<think>" not in (m["content"] or "")
               for r in records if r["messages"] for m in r["messages"])  # a lone closing tag
    assert all("parameters" in t["function"] for r in records for t in json.loads(r["metadata"]).get("tools", []))
    assert any(json.loads(r["metadata"]).get("tools") for r in records)
    assert {"empty_messages", "no_answered_question", "prompt_withheld", "empty_answer", "roles_out_of_order",
            "unknown_role", "bad_tool_arguments", "missing_id"} <= reasons
    assert {"en", "de", "fr", "es", "zh", "ja"} <= langs
    assert any(r["messages"] is None for r in records) and any(r["messages"] == [] for r in records)
    assert any(r["reasoning"] == "on" and "<think>" in (r["messages"][-1]["content"] or "") for r in records if r["messages"])
    tool_turns = [m for r in records if r["messages"] for m in r["messages"] if m["role"] == "tool"]
    calls = [m for r in records if r["messages"] for m in r["messages"] if m["tool_calls"]]
    assert tool_turns and calls
    # Exact duplicates repeat another record's messages under a new uuid.
    by_uuid = {r["uuid"]: r for r in records}
    for r in records:
        s = json.loads(r["metadata"])["sample"]
        if s["kind"] == "exact_duplicate":
            orig = by_uuid[s["expected"]["duplicate_of"]]
            assert orig["messages"] == r["messages"] and orig["uuid"] != r["uuid"]


def test_jsonl_variant_has_broken_lines(tmp_path):
    recs = nemotron_v1.generate(60, 3)["chat"][:5]
    p = nemotron_v1.write_jsonl(recs, tmp_path / "x.jsonl")
    lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    ok = 0
    for ln in lines:
        try:
            ok += isinstance(json.loads(ln), dict)
        except ValueError:
            pass
    assert ok == len(recs) and len(lines) - ok == nemotron_v1.BROKEN_JSONL_LINES
