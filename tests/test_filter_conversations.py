"""The filter on conversation-shaped data (real Spark local[2], real MiniLM, real mistral-common):
prompts never straddle the split, several part files per split with small pack buffers, the
validation cap, and the bundled sample's own expectations checked against enrich -> filter."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import fetch_artifact
from pipeline_core.config import load_config
from pipeline_core.handoffs import IGNORE_INDEX, TrainReadyInfo
from samples.enriched import Rec, enriched_table, publish_enriched
from spark_jobs.conversations.chat_format import load_tokenizer
from spark_jobs.conversations.conversation import ConversationOptions, build_conversation
from spark_jobs.packing import split_documents

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "nemotron_v1"
TOPICS = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Tokyo", "Quito", "Accra", "Hanoi"]


def twice_answered() -> list[Rec]:
    """Forty questions, each answered twice (different answers, different ids)."""
    recs = []
    for i in range(40):
        city, n = TOPICS[i % 10], i // 10
        q = f"Question {i}: tell me fact number {n} about {city}."
        for k, style in enumerate(("Briefly:", "In more detail, and with some context:")):
            recs.append(Rec(f"q{i:02d}-a{k}", q, f"{style} {city} fact {n} is that it is a city with a long history."))
    return recs


def _cfg(root: Path, **filter_overrides):
    return load_config(env={}, overrides={
        "filter": {"seq_len": 128, "max_tokens": 256, "min_answer_tokens": 1, "val_fraction": 0.3,
                   "exact_dedup": False, "near_dup_threshold": None, "min_qa_similarity": -1.0,
                   "pack_buffer_docs": 3, "shard_tokens": 1024, "shuffle_partitions": 3, **filter_overrides},
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")},
    })


def _run(spark, root: Path, files: int, **overrides):
    from spark_jobs.filter.job import run

    cfg = _cfg(root, **overrides)
    in_uri = uris.join(cfg.pipeline.store_uri, "enriched")
    publish_enriched(enriched_table(twice_answered()), root / "enriched", in_uri, files=files)
    out_uri = uris.join(cfg.pipeline.store_uri, "train")
    manifest = run(in_uri, out_uri, cfg, spark=spark)
    local = root / "fetched"
    fetch_artifact(out_uri, local)
    return SimpleNamespace(cfg=cfg, manifest=manifest, local=local, root=root)


@pytest.fixture(scope="module")
def runs(spark, tmp_path_factory):
    return [_run(spark, tmp_path_factory.mktemp(f"p{files}"), files) for files in (1, 3)]


def documents(local: Path) -> dict[str, list[list[int]]]:
    """Every packed document per split, read back from the part files."""
    out: dict[str, list[list[int]]] = {}
    for split in ("train", "val"):
        out[split] = []
        for f in sorted((local / "data" / split).glob("*.parquet")):
            for row in pq.read_table(f).to_pylist():
                pos, ids, labels = (np.array(row[k]) for k in ("position_ids", "input_ids", "labels"))
                for s, e in split_documents(pos):
                    if (labels[s:e] == IGNORE_INDEX).all() and (ids[s:e] == 0).all():
                        continue
                    out[split].append(ids[s:e].tolist())
    return out


def _question(tok, ids: list[int]) -> str:
    return tok.decode(ids).split("[/INST]")[0]


def test_no_prompt_on_both_sides_across_partitionings(runs):
    tok = load_tokenizer("mistral-v1")
    maps = []
    for r in runs:
        sides: dict[str, set[str]] = {}
        for split, docs in documents(r.local).items():
            for ids in docs:
                sides.setdefault(_question(tok, ids), set()).add(split)
        assert len(sides) == 40 and all(len(s) == 1 for s in sides.values()), sides  # every answer on one side
        maps.append({q: s.pop() for q, s in sides.items()})
    assert maps[0] == maps[1]  # same prompts -> same sides, whatever the input partitioning
    assert set(maps[0].values()) == {"train", "val"}


def test_small_shards_and_buffers_write_every_document_once(runs):
    tok = load_tokenizer("mistral-v1")
    for r in runs:
        info = TrainReadyInfo.from_manifest(r.manifest)
        docs = documents(r.local)
        assert r.manifest.counts == {"in": 80, "out": 80, "rejected": {}}
        assert sum(len(d) for d in docs.values()) == 80
        assert len({tuple(d) for ds in docs.values() for d in ds}) == 80  # none twice, none lost
        for split in ("train", "val"):
            files = sorted((r.local / "data" / split).glob("*.parquet"))
            assert len(files) == r.manifest.extra["splits"][split]["files"] == len(
                [f for f in r.manifest.files if f["path"].startswith(f"data/{split}/")])
            assert info.documents[split] == len(docs[split])
            assert info.sequences[split] == sum(pq.read_metadata(f).num_rows for f in files)
        assert len(list((r.local / "data" / "train").glob("*.parquet"))) >= 2  # several parts per split
        assert all(d[0] == tok.bos_id for ds in docs.values() for d in ds)


def test_validation_cap_moves_whole_prompts_to_train(spark, tmp_path):
    r = _run(spark, tmp_path, 2, val_max_documents=5)
    tok = load_tokenizer("mistral-v1")
    docs = documents(r.local)
    assert 0 < len(docs["val"]) <= 5 and len(docs["val"]) + len(docs["train"]) == 80
    val_q = Counter(_question(tok, d) for d in docs["val"])
    train_q = {_question(tok, d) for d in docs["train"]}
    assert all(n == 2 for n in val_q.values()) and not (set(val_q) & train_q)


# ------------------------------------------------------------------ the bundled sample, enrich -> filter
@pytest.fixture(scope="module")
def sample(spark, tmp_path_factory):
    from reports.sample_counts import run_sample

    root = tmp_path_factory.mktemp("sample")
    cfg, em, fm = run_sample(root, spark=spark)
    enriched, out = uris.join(cfg.pipeline.store_uri, "enriched"), uris.join(cfg.pipeline.store_uri, "train")
    fetch_artifact(out, root / "fetched")
    fetch_artifact(enriched, root / "enriched-local")
    records = [r for p in sorted((SAMPLE / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    rejects = pq.read_table(root / "fetched" / "rejects").to_pylist()
    return SimpleNamespace(cfg=cfg, enrich=em, filter=fm, root=root, records=records,
                           rejects={r["id"]: r for r in rejects})


def test_the_docs_sample_counts_are_this_runs(sample):
    """README.md, sample_data/README.md and docs/enrich.md quote the sample's counts in a generated
    block; a change of the sample or of a stage that moves a count fails here until
    `python -m reports.sample_counts` re-writes them."""
    from reports.sample_counts import DOCS, blocks, render

    block = render(sample.enrich.counts, sample.filter.counts)
    for doc in DOCS:
        assert blocks(doc) == [block], f"{doc.relative_to(REPO)}: stale sample counts; run python -m reports.sample_counts"


def test_sample_duplicate_expectations_hold_in_the_filter_output(sample):
    """Each original with its exact copies and paraphrases keeps exactly one member; an exact copy
    and its original are never both kept, and the exact-duplicate reject names the other one."""
    groups: dict[str, set[str]] = {}
    for r in sample.records:
        s = json.loads(r["metadata"])["sample"]
        if s["kind"] in ("exact_duplicate", "near_duplicate"):
            orig = s["expected"]["duplicate_of"]
            groups.setdefault(orig, {orig}).add(r["uuid"])
            if s["kind"] == "exact_duplicate":
                pair = {r["uuid"], orig}
                exact = [i for i in pair & set(sample.rejects) if sample.rejects[i]["reason"] == "exact_duplicate"]
                assert len(exact) == 1, pair
                assert json.loads(sample.rejects[exact[0]]["raw"])["detail"] == f"duplicate of {(pair - set(exact)).pop()}"
    assert len(groups) == 4
    for orig, members in groups.items():
        assert len(members - set(sample.rejects)) == 1, (orig, members)
        assert {sample.rejects[i]["reason"] for i in members & set(sample.rejects)} <= {"exact_duplicate", "near_duplicate"}
    counts = sample.filter.counts
    assert counts["in"] == sample.enrich.counts["out"] == counts["out"] + sum(counts["rejected"].values())


def test_sample_conversations_are_packed_as_mistral_common_encodes_them(sample):
    tok = load_tokenizer("mistral-v1")
    enriched = pq.read_table(sample.root / "enriched-local" / "data").to_pylist()
    kept = {r["id"]: r for r in enriched if r["id"] not in sample.rejects}
    expected = {}
    for rid, r in kept.items():
        ids = tok.reference_ids(build_conversation(r["messages"], r["metadata"], r["reasoning"], ConversationOptions()))
        expected[tuple(ids[: sample.cfg.filter.seq_len])] = rid
    found = [tuple(d) for ds in documents(sample.root / "fetched").values() for d in ds]
    assert sorted(expected[d] for d in found) == sorted(kept)  # every kept record once, token for token
    kinds = {json.loads(kept[expected[d]]["metadata"])["sample"]["kind"] for d in found}
    assert {"code_chat", "style_system", "tool", "reasoning", "chat_multi", "multi_answer"} <= kinds
    text = tok.decode([t for d in found for t in d])
    assert "[INST] You are a pirate captain." in text  # the style-setting system prompt reaches the prompt
    assert '[TOOL_CALLS] [{"name": "get_weather"' in text and "[AVAILABLE_TOOLS]" in text


def test_sample_every_kept_conversation_is_reproduced_by_the_exported_tokenizer(sample, tmp_path):
    """Issue 27: the render sample holds every kept document (fewer than render_sample_documents); the
    exported tokenizer's apply_chat_template gives each token for token, and its final answer's
    prompt; transformers' conversion (what the export copied before) does not (the code chat)."""
    import shutil

    from transformers import LlamaTokenizer

    from pipeline_core.handoffs import TrainReadyInfo
    from pipeline_core.hf_tokenizer import mistral_common_file
    from pipeline_core.render_sample import read_sample
    from training.export_tokenizer import export_tokenizer, set_chat_template
    from training.render_check import RenderMismatch, check_rendering

    docs = list(read_sample(sample.root / "fetched"))
    kept = {r["id"] for r in pq.read_table(sample.root / "enriched-local" / "data").to_pylist()} - set(sample.rejects)
    assert sorted(d.id for d in docs) == sorted(kept) and sample.filter.counts["out"] == len(docs)
    spec = TrainReadyInfo.from_manifest(sample.filter).tokenizer
    out = tmp_path / "export"
    out.mkdir()
    export_tokenizer(out, tmp_path, spec)
    check = check_rendering(out, docs)
    assert check.documents == len(docs) and check.generation_prompts == sum(not d.truncated for d in docs)
    (tmp_path / "src").mkdir()
    shutil.copy(mistral_common_file(spec.name), tmp_path / "src" / "tokenizer.model")
    LlamaTokenizer.from_pretrained(str(tmp_path / "src")).save_pretrained(str(tmp_path / "converted"))
    set_chat_template(tmp_path / "converted", spec.chat_template)
    code_chat = next(r["uuid"] for r in sample.records if json.loads(r["metadata"])["sample"]["kind"] == "code_chat")
    with pytest.raises(RenderMismatch, match=f"document '{code_chat}'"):
        check_rendering(tmp_path / "converted", [d for d in docs if d.id == code_chat])
    assert check_rendering(tmp_path / "converted", [d for d in docs if d.id != code_chat]).documents == len(docs) - 1


def test_sample_multi_answer_prompts_share_a_split(sample):
    tok = load_tokenizer("mistral-v1")
    sides = {s: {_question(tok, d) for d in ds} for s, ds in documents(sample.root / "fetched").items()}
    assert not (sides["train"] & sides["val"])
