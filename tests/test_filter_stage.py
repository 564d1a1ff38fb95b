"""Filter stage end to end on crafted records: real Spark local[2], real MiniLM embeddings, the real
Mistral v1 tokenizer, a local-directory store. One module-scoped run; each test checks one promise."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import ArtifactConflict, fetch_artifact
from pipeline_core.config import ConfigError, FilterSection, load_config
from pipeline_core.handoffs import IGNORE_INDEX
from samples.enriched import publish_enriched
from spark_jobs.conversations.chat_format import load_tokenizer
from spark_jobs.conversations.conversation import (
    ConversationOptions,
    build_conversation,
    prompt_text,
    sha256_hex,
)
from spark_jobs.filter.split import split_column, split_of
from spark_jobs.packing import split_documents
from tests.filter_helpers import EXACT, FILTER_SETTINGS, KEEP, NEAR, REJECT, crafted_table


def make_cfg(root: Path, **filter_overrides):
    return load_config(env={}, overrides={
        "filter": {**FILTER_SETTINGS, **filter_overrides},
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")},
    })


@pytest.fixture(scope="module")
def filtered(spark, tmp_path_factory):
    from spark_jobs.filter.job import run

    root = tmp_path_factory.mktemp("filter")
    cfg = make_cfg(root, render_sample_documents=5)  # fewer than the kept documents: the cap is exercised
    table = crafted_table()
    in_uri = uris.join(cfg.pipeline.store_uri, "datasets", "t", "enriched", "e1")
    publish_enriched(table, root / "enriched", in_uri)
    out_uri = uris.join(cfg.pipeline.store_uri, "datasets", "t", "train", "f1")
    manifest = run(in_uri, out_uri, cfg, spark=spark)
    local = root / "fetched"
    fetch_artifact(out_uri, local)
    rejects = pq.read_table(local / "rejects").to_pylist() if (local / "rejects").exists() else []
    return SimpleNamespace(cfg=cfg, manifest=manifest, local=local, table=table, in_uri=in_uri, out_uri=out_uri,
                           root=root, rejects={r["id"]: r for r in rejects})


def kept_ids(f) -> set[str]:
    return {r["id"] for r in f.table.to_pylist()} - set(f.rejects)


def test_rows_in_equal_kept_plus_rejected_by_reason(filtered):
    counts = filtered.manifest.counts
    expected = {"near_duplicate": len(NEAR), "exact_duplicate": 1}
    for reason, _ in REJECT.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert counts["rejected"] == expected
    assert counts["in"] == filtered.table.num_rows == counts["out"] + sum(expected.values())
    assert counts["out"] == len(KEEP) == len(kept_ids(filtered))
    assert len(filtered.rejects) == sum(expected.values())
    for rid, row in filtered.rejects.items():
        assert row["stage"] == "filter"
        raw = json.loads(row["raw"])
        assert raw["id"] == rid and raw["messages"] and raw["detail"]


def test_row_and_length_filters_drop_what_they_must(filtered):
    for rid, (reason, _) in REJECT.items():
        assert filtered.rejects[rid]["reason"] == reason, (rid, filtered.rejects[rid])
    assert "min_qa_similarity=0.2" in json.loads(filtered.rejects["x-mismatch"]["raw"])["detail"]
    assert "seq_len=128" in json.loads(filtered.rejects["x-seq"]["raw"])["detail"]


def test_exact_duplicate_keeps_one(filtered):
    pair = {"k-austen", EXACT.id}
    dropped = pair & set(filtered.rejects)
    assert len(dropped) == 1
    (d,) = dropped
    assert filtered.rejects[d]["reason"] == "exact_duplicate"
    assert json.loads(filtered.rejects[d]["raw"])["detail"] == f"duplicate of {(pair - dropped).pop()}"


def test_near_duplicates_are_paraphrases_not_topics(filtered):
    for nid, (kid, _) in NEAR.items():
        dropped = {nid, kid} & set(filtered.rejects)
        assert len(dropped) == 1, (nid, kid)
        (d,) = dropped
        other = ({nid, kid} - dropped).pop()
        assert filtered.rejects[d]["reason"] == "near_duplicate"
        assert f"near duplicate of {other} " in json.loads(filtered.rejects[d]["raw"])["detail"]
    # Same topic, different question (cosine ~0.5-0.7): kept.
    assert {"k-germany", "k-sort", "k-solve2"} <= kept_ids(filtered)


def read_rows(local: Path, split: str) -> list[dict]:
    table = pq.read_table(local / "data" / split)
    for name in ("input_ids", "labels", "position_ids"):
        assert str(table.schema.field(name).type) == "list<element: int32>", table.schema
    assert table.schema.names == ["input_ids", "labels", "position_ids"]
    return table.to_pylist()


def _conversation(r):
    return build_conversation(r["messages"], r.get("metadata"), r["reasoning"], ConversationOptions())


def test_packed_rows_are_mistral_common_encodings_with_assistant_masks(filtered):
    tok = load_tokenizer("mistral-v1")
    seq_len = filtered.cfg.filter.seq_len
    by_id = {r["id"]: r for r in filtered.table.to_pylist()}
    expected = {rid: tok.reference_ids(_conversation(by_id[rid])) for rid in kept_ids(filtered)}
    by_tokens = {tuple(ids): rid for rid, ids in expected.items()}
    seen: dict[str, str] = {}
    for split in ("train", "val"):
        for row in read_rows(filtered.local, split):
            ids, labels, pos = (np.array(row[k]) for k in ("input_ids", "labels", "position_ids"))
            assert len(ids) == len(labels) == len(pos) == seq_len
            for start, end in split_documents(pos):
                seg, seg_labels = ids[start:end].tolist(), labels[start:end].tolist()
                if all(label == IGNORE_INDEX for label in seg_labels) and set(seg) == {tok.pad_id}:
                    assert end == seq_len  # padding only at the end of a row
                    continue
                rid = by_tokens[tuple(seg)]  # exactly mistral-common's encode_instruct of the conversation
                answer = by_id[rid]["answer"]
                # loss exactly on the (single) assistant turn + </s>: the tail after the last [/INST]
                inst_end = max(i for i in range(len(seg)) if tok.decode(seg[: i + 1]).endswith("[/INST]"))
                assert seg_labels == [IGNORE_INDEX] * (inst_end + 1) + seg[inst_end + 1:]
                assert tok.decode([t for t, lab in zip(seg, seg_labels, strict=True) if lab != IGNORE_INDEX]) == answer
                assert seg[0] == tok.bos_id and seg[-1] == tok.eos_id
                assert rid not in seen
                seen[rid] = split
    assert set(seen) == set(expected)  # every kept record packed exactly once, none split across rows
    f = filtered.cfg.filter
    for rid, split in seen.items():
        assert split == split_of(sha256_hex(prompt_text(_conversation(by_id[rid]))), f.seed, f.val_fraction)
    assert set(seen.values()) == {"train", "val"}


def test_system_prompt_is_placed_as_mistral_v1_places_it(filtered):
    tok = load_tokenizer("mistral-v1")
    text = tok.decode(sum((r["input_ids"] for s in ("train", "val") for r in read_rows(filtered.local, s)), []))
    # the tool record's context is its system prompt: merged into the first user turn, blank line between
    assert "[INST] get_weather(city='Paris') returned: 18C, sunny.\n\nWhat is the weather in Paris right now? [/INST]" in text


def test_manifest_is_a_train_ready_info_with_tokens_and_efficiency(filtered):
    from pipeline_core.handoffs import TrainReadyInfo

    m = filtered.manifest
    extra = m.extra
    info = TrainReadyInfo.from_manifest(m)
    assert m.kind == "train-ready" and m.inputs[0]["uri"] == filtered.in_uri
    assert info.tokenizer.name == "mistral-v1" and info.tokenizer.vocab_size == 32000
    assert (info.tokenizer.bos_id, info.tokenizer.eos_id, info.tokenizer.pad_id) == (1, 2, 0)
    assert "[INST]" in info.tokenizer.chat_template
    assert extra["tokenizer_details"]["file"] == "tokenizer.model.v1" and len(extra["tokenizer_details"]["sha256"]) == 64
    assert info.seq_len == 128 and extra["pad_token_id"] == 0
    assert info.train_on == "dataset_flags" and info.prompt_context == "conversation"  # issue 28 default
    non_pad = slots = 0
    for split in ("train", "val"):
        rows = read_rows(filtered.local, split)
        pad = sum(1 for r in rows for i, lab in zip(r["input_ids"], r["labels"], strict=True) if i == 0 and lab == IGNORE_INDEX)
        tokens = sum(len(r["input_ids"]) for r in rows) - pad
        assert info.tokens[split] == extra["splits"][split]["doc_tokens"] == tokens
        assert info.target_tokens[split] == sum(1 for r in rows for lab in r["labels"] if lab != IGNORE_INDEX)
        assert info.sequences[split] == extra["splits"][split]["rows"] == len(rows)
        non_pad, slots = non_pad + tokens, slots + 128 * len(rows)
    assert info.packing_efficiency == round(non_pad / slots, 4)
    assert info.packing_efficiency > 0.7
    assert sum(info.documents.values()) == m.counts["out"]
    # issue 29: per source split, the rendered conversations that fit seq_len (with / without reasoning)
    fit = extra["length_fit"]
    assert fit["seq_len"] == 128 and fit["overflow"] == "reject"
    splits = fit["splits"]
    assert splits and all(0 <= v["fit"] <= v["fit_without_reasoning"] <= v["rendered"] for v in splits.values())
    assert sum(v["kept"] for v in splits.values()) == m.counts["out"]
    too_long = m.counts["rejected"].get("exceeds_seq_len", 0) + m.counts["rejected"].get("too_long", 0)
    assert sum(v["rendered"] - v["fit"] for v in splits.values()) <= too_long


def test_render_sample_is_packed_documents_with_their_conversations(filtered, tmp_path):
    """data/render_sample: `render_sample_documents` kept documents, each exactly a packed document, with
    the messages whose apply_chat_template (exported tokenizer) gives it: what the trainer checks at export."""
    from pipeline_core.handoffs import TrainReadyInfo
    from pipeline_core.render_sample import read_sample
    from training.export_tokenizer import export_tokenizer
    from training.render_check import check_rendering

    info = TrainReadyInfo.from_manifest(filtered.manifest)
    docs = list(read_sample(filtered.local))
    assert info.render_sample_documents == len(docs) == 5 < len(kept_ids(filtered))
    assert len({d.id for d in docs}) == 5 and {d.id for d in docs} <= kept_ids(filtered)
    packed = {}
    for split in ("train", "val"):
        for row in read_rows(filtered.local, split):
            for a, b in split_documents(np.array(row["position_ids"])):
                packed[(tuple(row["input_ids"][a:b]), tuple(row["labels"][a:b]))] = split
    assert all(packed[(tuple(d.input_ids), tuple(d.labels))] == d.split for d in docs)
    assert all(d.messages[-1]["role"] == "assistant" for d in docs)  # up to the final answer
    out = tmp_path / "tok"
    out.mkdir()
    export_tokenizer(out, tmp_path, info.tokenizer)
    check = check_rendering(out, docs)
    assert check.documents == 5 and check.generation_prompts == sum(not d.truncated for d in docs)


def test_rerun_is_a_noop_and_other_config_conflicts(filtered, spark):
    from spark_jobs.filter.job import run

    again = run(filtered.in_uri, filtered.out_uri, filtered.cfg, spark=spark)
    assert again.sha256 == filtered.manifest.sha256
    with pytest.raises(ArtifactConflict, match="already committed with config"):
        run(filtered.in_uri, filtered.out_uri, make_cfg(filtered.root, seq_len=256), spark=spark)


# Golden vectors of the published rule (split.SPLIT_RULE): prompt key -> split, computed once by hand
# from the formula, so a formula change cannot be mirrored on both sides of an assertion.
GOLDEN_KEYS = [sha256_hex(t) for t in ("", "a", "What is 2+2?", "system\u0001\u0003user\u0001what is the capital of france?")]
GOLDEN = [(1234, 0.3, ["val", "train", "train", "train"]), (7, 0.5, ["val", "val", "train", "train"])]
GOLDEN_FRACTIONS = {1234: [0.09885728637029256, 0.3831277152748094, 0.7566032774513096, 0.5770742676013287],
                    7: [0.2809037369788716, 0.2737250290644011, 0.5212814426125336, 0.7243710546227924]}


def test_split_rule_golden_vectors():
    from spark_jobs.filter.split import split_fraction

    for seed, frac, want in GOLDEN:
        assert [split_of(k, seed, frac) for k in GOLDEN_KEYS] == want
        assert [split_fraction(k, seed) for k in GOLDEN_KEYS] == GOLDEN_FRACTIONS[seed]
    conv = build_conversation([{"role": "user", "content": "What is  the capital of \uff26\uff32\uff21\uff2e\uff23\uff25?"},
                               {"role": "assistant", "content": "Paris"}], None, None, ConversationOptions())
    assert sha256_hex(prompt_text(conv)) == GOLDEN_KEYS[3]  # NFKC + white space + case folding


def test_split_is_stable_across_partitionings_and_matches_python(spark):
    from pyspark.sql import functions as F

    ids = [sha256_hex(f"prompt-{i}") for i in range(3000)]
    df = spark.createDataFrame([(i,) for i in ids], "id string")
    results = []
    for n in (1, 3):
        rows = df.repartition(n).select("id", split_column("id", 42, 0.1).alias("s")).collect()
        results.append({r["id"]: r["s"] for r in rows})
    expected = {i: split_of(i, 42, 0.1) for i in ids}
    assert results[0] == results[1] == expected
    share = sum(v == "val" for v in expected.values()) / len(ids)
    assert 0.08 < share < 0.12
    spark_golden = spark.createDataFrame([(k,) for k in GOLDEN_KEYS], "id string").select(
        split_column("id", 1234, 0.3).alias("s")).collect()
    assert [r["s"] for r in spark_golden] == GOLDEN[0][2]
    other = {r["id"]: r["s"] for r in df.select("id", split_column(F.col("id"), 43, 0.1).alias("s")).collect()}
    assert other != expected  # the seed matters: another seed assigns different prompts to val
    assert sum(other[i] != expected[i] for i in ids) > 100


def test_near_duplicate_detection_is_independent_of_partitioning(filtered, spark):
    from pyspark.sql import functions as F

    from spark_jobs.near_dups.dedup import near_duplicates, settings_for

    df = spark.read.parquet(str(filtered.root / "enriched" / "data")).filter(F.col("question_embedding").isNotNull())
    df = df.withColumn("_key", F.xxhash64("id")).withColumn("_vec", F.concat("question_embedding", "answer_embedding"))
    results = []
    for n in (1, 3):
        parts = df.repartition(n).persist()
        got = near_duplicates(parts, key="_key", vec="_vec", settings=settings_for(FilterSection()))
        results.append(sorted((r["_key"], r["_near_rep"]) for r in got.frame.collect()))
        got.frame.unpersist()
        parts.unpersist()
    assert results[0] == results[1]
    assert len(results[0]) == len(NEAR) + 1  # 3 paraphrase pairs + the exact duplicate (not removed here)


def test_invalid_parameters_fail_before_compute(filtered, spark, tmp_path):
    from spark_jobs.filter.job import main, run

    with pytest.raises(ValueError, match="--input: .* is a bare path"):
        run("/tmp/enriched", filtered.out_uri + "-x", filtered.cfg, spark=spark)
    with pytest.raises(ValueError, match="filter.tokenizer"):
        run(filtered.in_uri, filtered.out_uri + "-y", make_cfg(tmp_path, tokenizer=str(tmp_path / "nope")), spark=spark)
    with pytest.raises(ConfigError, match="filter.seq_len"):
        make_cfg(tmp_path, seq_len=4)
    bad = tmp_path / "bad.yaml"
    bad.write_text("filter:\n  overflow: split\n")
    with pytest.raises(ConfigError, match="filter.overflow"):
        main(["--input", filtered.in_uri, "--output", filtered.out_uri + "-z", "--config", str(bad)])
