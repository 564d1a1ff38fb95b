"""The Nemotron data family (issue 28): every published shape read into one conversation, withheld
prompts re-joined in Spark from generated seed tables, per-turn training flags, identity and
license filters, per-split length fit. Real Spark local[2], real mistral-common."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import fetch_artifact
from pipeline_core.config import load_config
from samples import family as sf
from spark_jobs.conversations import family
from spark_jobs.conversations.chat_format import load_tokenizer
from spark_jobs.conversations.conversation import (
    Conversation,
    ConversationOptions,
    RenderError,
    Turn,
    build_conversation,
    build_documents,
)
from spark_jobs.enrich.job import family_row, normalise_raw
from spark_jobs.filter.filter_rows import identity_match, identity_regex
from spark_jobs.packing import IGNORE_INDEX, split_documents

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data"
FLAGS = ConversationOptions(use_flags=True)


def records(name: str) -> list[dict]:
    out = []
    for line in (SAMPLE / "nemotron_sft" / "data" / f"{name}.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def conv_of(rec: dict, opts: ConversationOptions = FLAGS) -> Conversation:
    f = family.from_record(rec)
    return build_conversation(f.messages, f.metadata, None, opts)


# -- readers: every shape, one conversation --------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MCP = {"name": "get_weather", "description": "Current weather for a city",
       "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _tool_rec(args, result="{\"t\": 18}", **where) -> dict:
    return {"uuid": "t", "messages": [
        *where.pop("pre", []),
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "abcdefghi", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "content": result}, {"role": "assistant", "content": "18 degrees."}], **where}


@pytest.mark.parametrize("spec", ["mistral-v1", "mistral-v3"])
def test_each_tool_shape_and_argument_type_renders_the_same_conversation(spec):
    tok = load_tokenizer(spec)
    shapes = {
        "tools list, object arguments": _tool_rec({"city": "Paris"}, tools=[TOOL]),
        "tools JSON string, string arguments": _tool_rec('{"city": "Paris"}', tools=json.dumps([TOOL])),
        "v1 metadata string": _tool_rec('{"city": "Paris"}', metadata=json.dumps({"tools": [TOOL]})),
        "MCP in metadata object": _tool_rec({"city": "Paris"}, metadata={"tools": [MCP]}),
        "MCP top-level": _tool_rec({"city": "Paris"}, tools=[MCP]),
        "bare function": _tool_rec({"city": "Paris"}, tools=[TOOL["function"]]),
        "system prompt": _tool_rec({"city": "Paris"}, pre=[
            {"role": "system", "content": f"<tools>\n{json.dumps(TOOL)}\n</tools>"}]),
        "typed result parts": _tool_rec({"city": "Paris"}, result=[{"type": "text", "text": "{\"t\": 18}"}], tools=[TOOL]),
    }
    rendered = {k: tok.render(conv_of(r)).input_ids for k, r in shapes.items()}
    first = next(iter(rendered.values()))
    assert all(ids == first for ids in rendered.values()), {k: len(v) for k, v in rendered.items()}
    assert conv_of(shapes["MCP top-level"]).tools == (TOOL,)
    # and it is mistral-common's own encoding of that conversation, tools included
    assert first == tok.reference_ids(conv_of(shapes["tools list, object arguments"]))
    broken = _tool_rec({"city": "Paris"}, tools=[{"name": "get_weather", "inputSchema": {"type": "object"}}])
    assert tok.render(conv_of(broken)).input_ids != first  # another schema renders differently: the check can fail


def test_developer_role_reasoning_content_and_backspace():
    dev = next(r for r in records("chat") if r["uuid"] == "sft-chat-developer")
    f = family.from_record(dev)
    assert f.messages[0] == {"role": "system", "content": "Answer in one short sentence."}
    assert "reasoning_content" not in f.messages[2]  # white space is no reasoning
    assert conv_of(dev).system == "Answer in one short sentence."
    latex = family.from_record(next(r for r in records("chat") if r["uuid"] == "sft-chat-latex"))
    assert latex.messages[2]["content"] == "Subtract 3 from both sides: $\\boxed{4}$."
    assert "\x08" not in json.dumps(latex.messages) and family.repair_text("\x0crac{1}{2}") == "\\frac{1}{2}"
    n = normalise_raw("x", json.dumps(latex.messages[1:]).replace("null", '"Solve x + 3 = 7."', 1),
                      None, load_config(env={}).enrich)
    assert n["answer"].endswith("$\\boxed{4}$.") and n["reasoning_trace"] == "x = 7 - 3 = 4"


def test_null_content_is_withheld_never_rendered():
    e = load_config(env={}).enrich
    null_tool = next(r for r in records("tool") if r["uuid"] == "sft-tool-null-result")
    f = family_row("x", json.dumps(null_tool), None, None)
    assert normalise_raw("x", f["messages_json"], None, e, f["metadata"])["reason"] == "content_withheld"
    null_system = [{"role": "system", "content": None}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "a"}]
    assert normalise_raw("x", json.dumps(null_system), None, e)["reason"] == "prompt_withheld"
    # a null system turn never becomes "None" or an empty system prompt once restored without one
    restored = family.restore_messages([{"role": "system", "content": None}, {"role": "user", "content": None},
                                        {"role": "assistant", "content": "a"}], "q", None)
    conv = build_conversation(restored, None, None, ConversationOptions())
    assert conv.system is None and conv.turns[0] == Turn("user", "q")


def _trained_text(tok, conv: Conversation, train_on: str = "dataset_flags") -> str:
    r = tok.render(conv, train_on)
    return tok.decode([i for i, t in zip(r.input_ids, r.targets, strict=True) if t])


def test_train_turns_with_reasoning_make_one_document_per_trained_reasoning_turn():
    tok = load_tokenizer("mistral-v1")
    rec = next(r for r in records("chat") if r["uuid"] == "sft-chat-flags")
    f = family.from_record(rec)
    msgs = family.restore_messages(f.messages, sf.SEEDS[2][1], None)
    assert f.train_turns == [False, False, True, False, True]
    docs = build_documents(msgs, f.metadata, "on", ConversationOptions(train_on_reasoning=True, use_flags=True))
    assert len(docs) == 2
    first, whole = (_trained_text(tok, d) for d in docs)
    assert "A grey cat: a smoky name fits." in first and "How about Smokey?" in first  # its turn, with its reasoning
    assert "Nimbus" not in first
    assert "Unusual: a cloud name." in whole and "Nimbus" in whole
    assert "Smokey" not in whole  # trained once, in its own document
    # without train_on_reasoning: one document training both flagged turns, visible text only
    (plain,) = build_documents(msgs, f.metadata, "on", ConversationOptions(use_flags=True))
    text = _trained_text(tok, plain)
    assert "Smokey" in text and "Nimbus" in text and "smoky name" not in text
    # flags off: every assistant turn; last_assistant_turn: only the last
    assert "Smokey" not in _trained_text(tok, plain, "last_assistant_turn")
    # [F, F, T, F, F]: the document ends at the last trained turn
    meta = json.dumps({"train_turns": [False, False, True, False, False]})
    (cut,) = build_documents(msgs, meta, "on", ConversationOptions(use_flags=True))
    assert [t.role for t in cut.turns] == ["user", "assistant"]
    with pytest.raises(RenderError) as e:
        build_documents(msgs, json.dumps({"train_turns": [True, False]}), None, FLAGS)
    assert e.value.reason == "bad_train_turns"


def test_identity_patterns_default_list():
    from pipeline_core.config import DEFAULT_IDENTITY_PATTERNS

    rx = identity_regex(DEFAULT_IDENTITY_PATTERNS)
    hits = ["I am Qwen, a large language model.", "I'm Claude, made by Anthropic.", "I was developed by Google.",
            "As for me, I am ChatGPT.", "I am DeepSeek-V3.", "I was created by Zhipu AI.", "I AM LLAMA",
            "I am an AI assistant named Gemini.", "I was trained by OpenAI."]
    misses = ["Search it on Google.", "Meta released Llama 3 in 2024.", "I am happy to help.", "GPT-4 is a model by OpenAI.",
              "I'm a glmmer of hope", "Claudette is my name."]
    for h in hits:
        assert identity_match([{"role": "assistant", "content": h}], rx), h
    for m in misses:
        assert not identity_match([{"role": "assistant", "content": m}], rx), m
    assert identity_match([{"role": "assistant", "content": "ok", "reasoning_content": "I am Qwen, so..."}], rx)
    assert not identity_match([{"role": "user", "content": "I am Qwen"}], rx)  # only the model's own turns


# -- Spark: enrich (re-join) + filter on the family sample ------------------------------------------

def family_cfg(root: Path, **filter_overrides):
    return load_config(env={}, overrides={
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")},
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2, "input_format": "jsonl",
                   "splits": list(sf.FAMILY_FILES),
                   "prompt_sources": {k: uris.qualify(SAMPLE / v) for k, v in sf.PROMPT_SOURCES.items()}},
        "filter": {"spark_master": "local[2]", "shuffle_partitions": 2, "min_qa_similarity": -1.0,
                   "near_dup_threshold": None, "seq_len": 256, "max_tokens": 4096, "val_fraction": 0.5,
                   "train_on_reasoning": True, "licenses": ["odc-by", "apache-2.0"], **filter_overrides},
    })


@pytest.fixture(scope="module")
def family_run(spark, tmp_path_factory):
    from spark_jobs.enrich import job as enrich
    from spark_jobs.filter import job as similarity_filter

    root = tmp_path_factory.mktemp("family")
    cfg = family_cfg(root)
    en_uri = uris.join(cfg.pipeline.store_uri, "datasets", "f", "enriched", "e")
    en = enrich.run(uris.qualify(SAMPLE / "nemotron_sft"), en_uri, cfg, spark=spark)
    tr_uri = uris.join(cfg.pipeline.store_uri, "datasets", "f", "train", "t")
    tr = similarity_filter.run(en_uri, tr_uri, cfg, spark=spark)
    en_local, tr_local = root / "en", root / "tr"
    fetch_artifact(en_uri, en_local)
    fetch_artifact(tr_uri, tr_local)
    return SimpleNamespace(
        cfg=cfg, en=en, tr=tr, tr_local=tr_local,
        data={r["id"]: r for r in pq.read_table(en_local / "data").to_pylist()},
        en_rejects={r["id"]: r for r in pq.read_table(en_local / "rejects").to_pylist()},
        tr_rejects={r["id"]: r for r in pq.read_table(tr_local / "rejects").to_pylist()},
        provenance={r["id"]: r for r in pq.read_table(tr_local / "provenance").to_pylist()},
    )


def _expected() -> dict[str, dict]:
    out = {}
    for name in sf.FAMILY_FILES:
        for r in records(name):
            out[r.get("uuid") or r["id"]] = {"file": name, **r["metadata"]["sample"]["expected"]}
    return out


def test_enrich_rejects_each_unrestorable_row_naming_the_source_and_counts_add_up(family_run):
    m, exp = family_run.en, _expected()
    got = {rid: r["reason"] for rid, r in family_run.en_rejects.items()}
    broken = next(rid for rid in got if rid.endswith("chat.jsonl:4"))  # the broken line: its file and line
    assert got.pop(broken) == "unparseable_json"
    assert got == {rid: e["reject_reason"] for rid, e in exp.items() if e.get("reject_reason")}
    assert m.counts["in"] == len(exp) + 1 == m.counts["out"] + sum(m.counts["rejected"].values())
    missing = json.loads(family_run.en_rejects["sft-chat-lmsys"]["raw"])
    assert "enrich.prompt_sources['lmsys/lmsys-chat-1m']" in missing["detail"] and missing["record"]
    unmatched = json.loads(family_run.en_rejects["sft-chat-unmatched"]["raw"])
    assert sf.WILDCHAT in unmatched["detail"] and sf.sha256_text("a prompt that is in no seed table") in unmatched["detail"]
    assert "train/99" in json.loads(family_run.en_rejects["sft-code-taco-missing"]["raw"])["detail"]
    assert family_run.en_rejects["sft-code-v1-dash"]["reason"] == "prompt_withheld"  # no key: still withheld
    ps = m.extra["prompt_sources"]
    assert ps[sf.WILDCHAT]["restored"] == 7 and ps[sf.WILDCHAT]["unrestorable"] == 1
    assert ps[sf.TACO]["restored"] == 2 and ps[sf.TACO]["outcomes"] == {"prompt_not_found": 1, "restored": 2}
    assert ps[sf.LMSYS] == {"uri": None, "config_key": f"enrich.prompt_sources[{sf.LMSYS!r}]", "restored": 0,
                            "unrestorable": 1, "outcomes": {"prompt_source_missing": 1}}
    assert ps[sf.APPS]["unrestorable"] == 1
    seed_file = SAMPLE / "seeds" / "wildchat" / "data" / "train-00000-of-00001.parquet"
    (f,) = ps[sf.WILDCHAT]["files"]
    assert f["sha256"] == hashlib.sha256(seed_file.read_bytes()).hexdigest() and f["size"] == seed_file.stat().st_size
    assert ps[sf.WILDCHAT]["uri"] == uris.qualify(SAMPLE / "seeds" / "wildchat")
    assert m.extra["splits"]["code"]["rejected"] == {"prompt_not_found": 1, "prompt_source_missing": 1,
                                                     "prompt_withheld": 1}


def test_restored_rows_are_mistral_commons_encoding_of_the_seed_conversation(family_run):
    tok = load_tokenizer("mistral-v1")
    data = family_run.data
    for i, (system, prompt, answer, _) in enumerate(sf.SEEDS[:2]):
        row = data[f"sft-chat-{i}"]
        assert row["question"] == prompt and row["answer"] == answer and row["seed_dataset"] == sf.WILDCHAT
        expected = Conversation(system, (Turn("user", prompt), Turn("assistant", answer)))
        got = build_conversation(row["messages"], row["metadata"], row["reasoning"], ConversationOptions())
        assert tok.render(got).input_ids == tok.reference_ids(expected)
    for i in range(2):
        assert data[f"sft-code-taco-{i}"]["question"] == sf.TACO_ROWS[i]
    assert data["sft-chat-1"]["messages"][0] == {"role": "system", "content": sf.SEEDS[1][0],
                                                 "reasoning_content": None, "tool_calls": None}
    # the packed train-ready rows hold exactly that encoding (with its reasoning, as configured)
    docs = set()
    for split in ("train", "val"):
        for row in pq.read_table(family_run.tr_local / "data" / split).to_pylist():
            ids, pos = np.array(row["input_ids"]), np.array(row["position_ids"])
            docs.update(tuple(ids[a:b].tolist()) for a, b in split_documents(pos))
    conv = build_conversation(data["sft-chat-0"]["messages"], data["sft-chat-0"]["metadata"], "on",
                              ConversationOptions(train_on_reasoning=True, use_flags=True))
    assert tuple(tok.reference_ids(conv)) in docs


def test_filter_identity_license_flags_and_provenance(family_run):
    m, rej, prov = family_run.tr, family_run.tr_rejects, family_run.provenance
    assert rej["sft-chat-identity"]["reason"] == "identity_mismatch"
    assert "I am Qwen" in json.loads(rej["sft-chat-identity"]["raw"])["detail"]
    assert rej["sft-chat-license"]["reason"] == "license_excluded"
    assert m.counts["in"] == len(family_run.data) == m.counts["out"] + sum(m.counts["rejected"].values())
    assert prov["sft-chat-flags"]["documents"] == 2 and prov["sft-chat-prefix"]["documents"] == 1
    assert prov["sft-chat-flags"]["split"] == prov["sft-chat-prefix"]["split"]  # one seed conversation, one side
    assert prov["sft-chat-0"] | {"split": None} == {
        "id": "sft-chat-0", "split": None, "documents": 1, "license": "odc-by", "generator": "Qwen3-235B-A22B",
        "used_in": ["nano_v3"], "seed_dataset": sf.WILDCHAT, "source_split": "chat"}
    assert sum(m.extra["documents"].values()) == m.counts["out"] + 1  # the flagged row's prefix document
    assert m.extra["licenses"] == {"odc-by": sum(1 for p in prov.values() if p["license"] == "odc-by"),
                                   "apache-2.0": 2}
    ss = m.extra["source_splits"]
    assert set(ss) == {"chat", "tool", "code"}
    for s in ss.values():
        assert s["in"] == s["out"] + sum(s["rejected"].values())
        assert s["fit_seq_len_with_reasoning"] <= s["fit_seq_len_without_reasoning"] <= s["measured"]
    assert ss["chat"]["rejected"] == {"identity_mismatch": 1, "license_excluded": 1}
    assert ss["code"]["fit_seq_len_with_reasoning"] == ss["code"]["measured"] == 2


def test_identity_keep_counts_instead_of_rejecting(family_run, spark, tmp_path):
    from spark_jobs.filter import job as similarity_filter

    cfg = family_cfg(tmp_path, identity_action="keep", licenses=None)
    out = uris.join(cfg.pipeline.store_uri, "datasets", "f", "train", "k")
    m = similarity_filter.run(family_run.en.uri, out, cfg, spark=spark)
    assert "identity_mismatch" not in m.counts["rejected"] and "license_excluded" not in m.counts["rejected"]
    assert m.extra["identity_matches_kept"] == 1 and m.counts["out"] == family_run.tr.counts["out"] + 2
    assert m.extra["licenses"]["cc-by-nc-4.0"] == 1


def test_rows_without_flags_train_every_assistant_turn_under_dataset_flags():
    tok = load_tokenizer("mistral-v1")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "first"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "second"}]
    conv = build_conversation(msgs, None, None, FLAGS)
    assert conv.flags is None
    r = tok.render(conv, "dataset_flags")
    assert r.targets == tok.render(conv, "all_assistant_turns").targets
    assert IGNORE_INDEX == -100


def test_bundled_family_sample_is_what_its_generator_writes(tmp_path):
    sf.write(tmp_path)
    for name in sf.FAMILY_FILES:
        rel = Path("nemotron_sft") / "data" / f"{name}.jsonl"
        assert (tmp_path / rel).read_bytes() == (SAMPLE / rel).read_bytes(), name
    assert (tmp_path / "seeds/taco/train.jsonl").read_bytes() == (SAMPLE / "seeds/taco/train.jsonl").read_bytes()
    wild = "seeds/wildchat/data/train-00000-of-00001.parquet"
    assert pq.read_table(tmp_path / wild).equals(pq.read_table(SAMPLE / wild))


def test_jsonl_line_numbers_hold_across_file_splits(spark, tmp_path):
    from spark_jobs.enrich.readers import numbered_lines

    lines = [json.dumps({"n": i, "pad": "x" * (i * 37 % 300)}) for i in range(1, 301)]
    lines[41] = ""  # a blank line still counts as a line
    for name in ("a-00000.jsonl", "b-00000.jsonl"):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    files = [uris.qualify(tmp_path / n) for n in ("a-00000.jsonl", "b-00000.jsonl")]
    spark.conf.set("spark.sql.files.maxPartitionBytes", "4096")  # ~20 splits per file, interleaved in tasks
    spark.conf.set("spark.sql.files.openCostInBytes", "0")
    try:
        got = numbered_lines(spark, files).collect()
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
        spark.conf.unset("spark.sql.files.openCostInBytes")
    assert len(got) == 600
    for r in got:
        path, _, line = r["_where"].rpartition(":")
        assert r["value"] == lines[int(line) - 1], r["_where"]
        assert r["split"] == path.rpartition("/")[2][0]


def test_rows_of_one_seed_conversation_share_the_split_key_and_differ_for_dedup():
    from spark_jobs.filter.filter_rows import conversation_keys

    by_id = {r["uuid"]: r for r in records("chat")}
    keys = {}
    for rid in ("sft-chat-flags", "sft-chat-prefix", "sft-chat-0"):
        f = family.from_record(by_id[rid])
        msgs = family.restore_messages(f.messages, "restored prompt", None)
        keys[rid] = conversation_keys(json.dumps(msgs), f.metadata, "on", FLAGS)
    assert keys["sft-chat-flags"][0] == keys["sft-chat-prefix"][0] != keys["sft-chat-0"][0]
    assert keys["sft-chat-flags"][1] != keys["sft-chat-prefix"][1]
    # same messages, other flags: not an exact duplicate (each trains other turns)
    f = family.from_record(by_id["sft-chat-flags"])
    msgs = json.dumps(family.restore_messages(f.messages, "p", None))
    other = json.dumps({**json.loads(f.metadata), "train_turns": [False, False, False, False, True]})
    assert conversation_keys(msgs, f.metadata, "on", FLAGS)[1] != conversation_keys(msgs, other, "on", FLAGS)[1]
