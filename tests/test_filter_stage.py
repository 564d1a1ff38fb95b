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
from spark_jobs.chat_format import load_tokenizer, render
from spark_jobs.packing import IGNORE_INDEX, split_documents
from spark_jobs.split import split_column, split_of
from tests.filter_helpers import (
    EXACT,
    FILTER_SETTINGS,
    KEEP,
    NEAR,
    REJECT,
    crafted_table,
    publish_enriched,
)


@pytest.fixture(scope="module")
def spark():
    from spark_jobs.common import spark_session

    s = spark_session("test-filter", "local[2]", 2, {"spark.ui.enabled": "false"})
    yield s
    s.stop()  # else py4j's gateway is collected at interpreter exit and logs errors


def make_cfg(root: Path, **filter_overrides):
    return load_config(env={}, overrides={
        "filter": {**FILTER_SETTINGS, **filter_overrides},
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")},
    })


@pytest.fixture(scope="module")
def filtered(spark, tmp_path_factory):
    from spark_jobs.similarity_filter import run

    root = tmp_path_factory.mktemp("filter")
    cfg = make_cfg(root)
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
        assert raw["id"] == rid and raw["question"] is not None and raw["detail"]


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


def test_packed_rows_decode_to_rendered_texts_and_mask_only_answers(filtered):
    tok = load_tokenizer("mistral-v1")
    seq_len = filtered.cfg.filter.seq_len
    by_id = {r["id"]: r for r in filtered.table.to_pylist()}
    expected = {}
    for rid in kept_ids(filtered):
        r = by_id[rid]
        prompt, completion = render([s["text"] for s in r["relevant_sentences"]], r["question"], r["answer"])
        expected[rid] = (prompt, completion, *tok.encode(prompt, completion))
    by_tokens = {tuple(p + c): rid for rid, (_, _, p, c) in expected.items()}
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
                rid = by_tokens[tuple(seg)]
                prompt, completion, p_ids, c_ids = expected[rid]
                assert tok.decode(seg) == f"[INST] {prompt} [/INST] {completion}"
                assert seg_labels == [IGNORE_INDEX] * len(p_ids) + c_ids  # loss exactly on the answer (+ </s>)
                assert tok.decode([t for t, lab in zip(seg, seg_labels, strict=True) if lab != IGNORE_INDEX]) == completion
                assert seg[0] == tok.bos_id and seg[-1] == tok.eos_id
                assert rid not in seen
                seen[rid] = split
    assert set(seen) == set(expected)  # every kept record packed exactly once, none split across rows
    for rid, split in seen.items():
        assert split == split_of(rid, filtered.cfg.filter.seed, filtered.cfg.filter.val_fraction)
    assert set(seen.values()) == {"train", "val"}


def test_prompt_carries_relevant_context(filtered):
    tok = load_tokenizer("mistral-v1")
    text = tok.decode(sum((r["input_ids"] for s in ("train", "val") for r in read_rows(filtered.local, s)), []))
    assert "[INST] France is a country in Western Europe.\nIts government sits in Paris.\n\nWhat is the capital of France? [/INST]" in text


def test_manifest_names_tokenizer_template_tokens_and_efficiency(filtered):
    m = filtered.manifest
    extra = m.extra
    assert m.kind == "train-ready" and m.inputs[0]["uri"] == filtered.in_uri
    assert extra["tokenizer"]["spec"] == "mistral-v1" and extra["tokenizer"]["file"] == "tokenizer.model.v1"
    assert len(extra["tokenizer"]["sha256"]) == 64 and extra["tokenizer"]["vocab_size"] == 32000
    assert extra["template"]["format"] == "<s>[INST] {prompt} [/INST] {completion}</s>"
    assert extra["seq_len"] == 128 and extra["pad_token_id"] == 0
    non_pad = slots = 0
    for split in ("train", "val"):
        rows = read_rows(filtered.local, split)
        pad = sum(1 for r in rows for i, lab in zip(r["input_ids"], r["labels"], strict=True) if i == 0 and lab == IGNORE_INDEX)
        tokens = sum(len(r["input_ids"]) for r in rows) - pad
        assert extra["tokens"][split] == extra["splits"][split]["doc_tokens"] == tokens
        assert extra["splits"][split]["rows"] == len(rows)
        non_pad, slots = non_pad + tokens, slots + 128 * len(rows)
    assert extra["packing_efficiency"] == round(non_pad / slots, 4)
    assert extra["packing_efficiency"] > 0.7
    assert sum(s["documents"] for s in extra["splits"].values()) == m.counts["out"]


def test_rerun_is_a_noop_and_other_config_conflicts(filtered, spark):
    from spark_jobs.similarity_filter import run

    again = run(filtered.in_uri, filtered.out_uri, filtered.cfg, spark=spark)
    assert again.sha256 == filtered.manifest.sha256
    with pytest.raises(ArtifactConflict, match="already committed with config"):
        run(filtered.in_uri, filtered.out_uri, make_cfg(filtered.root, seq_len=256), spark=spark)


def test_split_is_stable_across_partitionings_and_matches_python(spark):
    from pyspark.sql import functions as F

    ids = [f"id-{i}" for i in range(3000)]
    df = spark.createDataFrame([(i,) for i in ids], "id string")
    results = []
    for n in (1, 3):
        rows = df.repartition(n).select("id", split_column("id", 42, 0.1).alias("s")).collect()
        results.append({r["id"]: r["s"] for r in rows})
    expected = {i: split_of(i, 42, 0.1) for i in ids}
    assert results[0] == results[1] == expected
    share = sum(v == "val" for v in expected.values()) / len(ids)
    assert 0.08 < share < 0.12
    assert df.select(split_column(F.col("id"), 43, 0.1).alias("s")).filter("s = 'val'").count() != sum(
        v == "val" for v in expected.values())  # the seed matters


def test_near_duplicate_detection_is_independent_of_partitioning(filtered, spark):
    from pyspark.sql import functions as F

    from spark_jobs.dedup import find_near_duplicates

    df = spark.read.parquet(str(filtered.root / "enriched" / "data")).filter(F.col("question_embedding").isNotNull())
    df = df.withColumn("_key", F.xxhash64("id")).withColumn("_vec", F.concat("question_embedding", "answer_embedding"))
    results = []
    for n in (1, 3):
        f = FilterSection()
        got = find_near_duplicates(df.repartition(n), key="_key", vec="_vec", threshold=0.9, bands=f.lsh_bands,
                                   rows_per_band=f.lsh_rows_per_band, max_leaders=f.lsh_max_leaders, seed=0,
                                   min_band_matches=f.lsh_min_band_matches).collect()
        results.append(sorted((r["_key"], r["_near_rep"]) for r in got))
    assert results[0] == results[1]
    assert len(results[0]) == len(NEAR) + 1  # 3 paraphrase pairs + the exact duplicate (not removed here)


def test_invalid_parameters_fail_before_compute(filtered, spark, tmp_path):
    from spark_jobs.similarity_filter import main, run

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
