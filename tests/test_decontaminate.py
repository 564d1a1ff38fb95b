"""Decontamination in the filter stage (issue 31.1): real Spark local[2], real MiniLM embeddings, the
real Mistral tokenizer, a local store. Eval documents are planted in training records verbatim, with
white space / case / punctuation changes, as a 13-gram inside a longer prompt and (a short document)
whole; a record sharing only 12 consecutive tokens, and one whose *answer* holds an eval document
(answers are not matched by default), are kept."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import fetch_artifact
from pipeline_core.config import ConfigError, load_config
from samples.enriched import Rec, enriched_table, publish_enriched
from spark_jobs.filter import decontaminate as dc
from tests.filter_helpers import FILTER_SETTINGS, KEEP

EVAL_DOCS = [
    {"id": "q-moon", "question": "How long does it take for light reflected from the Moon's surface to reach "
                                 "an observer standing on the Earth at night?", "answer": "About 1.3 seconds."},
    {"id": "q-bridge", "question": "A suspension bridge of length 1200 metres expands by 0.05 percent on a hot "
                                   "day; by how many centimetres does it grow?", "answer": "60 centimetres."},
    {"id": "q-poem", "problem": "Write a short poem about the quiet of an empty train station just before the "
                                "first morning train arrives from the coast.", "answer": "..."},
    {"id": "q-planet", "question": "Which planet in our solar system has the longest day measured in Earth hours "
                                   "and why does it rotate so slowly?", "answer": "Venus."},
    {"id": "q-short", "question": "Name the chemical element with atomic number seventy nine please.",
     "answer": "Gold."},
    {"id": "q-answer", "question": "What is the traditional gift for a fortieth wedding anniversary in Britain "
                                   "according to the usual modern lists?",
     "answer": "The traditional gift for the fortieth anniversary is ruby, a deep red gemstone said to stand "
               "for passion and lasting love between the couple."},
]

PLANTED = {
    "c-verbatim": Rec("c-verbatim", EVAL_DOCS[0]["question"],
                      "Light from the Moon takes about 1.3 seconds to reach an observer on Earth."),
    "c-case": Rec("c-case", "a SUSPENSION bridge of length 1200   metres expands by 0.05 percent on a hot day...\n"
                            "By how many centimetres does it grow",
                  "The bridge grows by 0.05 percent of 1200 metres, which is 0.6 metres or 60 centimetres."),
    "c-embedded": Rec("c-embedded", "I am collecting ideas for a creative writing class. The quiet of an empty train "
                                    "station just before the first morning train arrives is one theme; what "
                                    "other themes could work well?",
                      "Other themes for a creative writing class could be a harbour at dawn, a library at closing "
                      "time, or a market before the stalls open."),
    "c-short": Rec("c-short", "Quick quiz: name the chemical element with atomic number seventy-nine, please!",
                   "The chemical element with atomic number 79 is gold, symbol Au."),
}
KEPT = {
    # 12 consecutive tokens of q-planet ("which ... measured in"), then "minutes": no shared 13-gram
    "k-near-miss": Rec("k-near-miss", "Tell me which planet in our solar system has the longest day measured in "
                                      "minutes instead of hours.",
                       "Venus has the longest day of any planet in our solar system, about 5,832 hours."),
    # the answer holds q-answer's answer; decontaminate_answers is off here
    "k-answer": Rec("k-answer", "What gemstone is associated with a fortieth wedding anniversary?",
                    EVAL_DOCS[5]["answer"]),
}


def write_eval_set(path: Path) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in EVAL_DOCS))
    return uris.qualify(path)


def make_cfg(root: Path, eval_uri: str, **extra):
    return load_config(env={}, overrides={
        "filter": {**FILTER_SETTINGS, "decontaminate": [{"uri": eval_uri, "name": "tiny"}], **extra},
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")},
    })


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("decon")
    eval_uri = write_eval_set(root / "tiny_eval.jsonl")
    return SimpleNamespace(root=root, eval_uri=eval_uri, cfg=make_cfg(root, eval_uri),
                           table=enriched_table([*KEEP, *PLANTED.values(), *KEPT.values()]))


def contaminated_keys(spark, setup, cfg, explain: list | None = None) -> set[str]:
    """The eval side and the join alone (no stage run): keys the eval set contaminates."""
    from pyspark.sql import functions as F

    sets = dc.resolve_eval_sets(cfg.filter.decontaminate, None)
    prep = dc.prepare(spark, sets, cfg.filter, setup.root / "dl", None, lambda df: df)
    rows = spark.createDataFrame(setup.table.select(["id", "messages"]).to_pandas()).select(
        F.col("id").alias("_key"), F.to_json("messages").alias("_messages_json"))
    rows = rows.select("_key", dc.record_grams(F.col("_messages_json"), cfg.filter, prep.short_lengths).alias("_grams"))
    hit = dc.contaminated(rows, prep.docs, cfg.filter, ["tiny"])
    if explain is not None:
        explain.append(hit._jdf.queryExecution().executedPlan().toString())
    return {r["_key"] for r in hit.collect()}


@pytest.fixture(scope="module")
def decon(spark, setup):
    from spark_jobs.filter.job import run

    root, eval_uri, cfg, table = setup.root, setup.eval_uri, setup.cfg, setup.table
    in_uri = uris.join(cfg.pipeline.store_uri, "datasets", "t", "enriched", "e1")
    publish_enriched(table, root / "enriched", in_uri)
    out_uri = uris.join(cfg.pipeline.store_uri, "datasets", "t", "train", "f1")
    manifest = run(in_uri, out_uri, cfg, spark=spark)
    local = root / "fetched"
    fetch_artifact(out_uri, local)
    rejects = pq.read_table(local / "rejects").to_pylist()
    return SimpleNamespace(cfg=cfg, manifest=manifest, table=table, eval_uri=eval_uri, root=root,
                           rejects={r["id"]: r for r in rejects})


def test_normalised_tokens():
    assert dc.normalised_tokens("Ｈｅｌｌｏ,  WORLD!\n(it's)  x+y=2") == ["hello", "world", "it", "s", "x+y=2"]
    assert dc.normalised_tokens(None) == []


def test_planted_eval_documents_are_contaminated_rejects(decon):
    got = {i: r for i, r in decon.rejects.items() if r["reason"] == dc.CONTAMINATED}
    assert set(got) == set(PLANTED)
    detail = {i: json.loads(r["raw"])["detail"] for i, r in got.items()}
    assert "eval set tiny, document q-moon" in detail["c-verbatim"]
    assert "eval set tiny, document q-bridge" in detail["c-case"]
    assert "eval set tiny, document q-poem" in detail["c-embedded"]
    assert "eval set tiny, document q-short: 1 of its 1 grams" in detail["c-short"]


def test_near_miss_and_answers_are_kept(decon):
    assert not set(KEPT) & set(decon.rejects)


def test_counts_add_up_and_manifest_names_the_eval_set(decon):
    c = decon.manifest.counts
    assert c["in"] == decon.table.num_rows == c["out"] + sum(c["rejected"].values())
    assert c["rejected"][dc.CONTAMINATED] == len(PLANTED)
    d = decon.manifest.extra["decontamination"]
    assert d["ngram"] == 13 and d["threshold"] == 0.0 and d["answers"] is False
    (s,) = d["eval_sets"]
    from pipeline_core.store import sha256_file

    file_sha = sha256_file(uris.to_local_path(decon.eval_uri))
    assert s["name"] == "tiny" and s["uri"] == decon.eval_uri and s["documents"] == len(EVAL_DOCS)
    assert s["rows_removed"] == len(PLANTED) and s["files"] == 1 and len(s["sha256"]) == 64
    assert s["sha256"] == dc.resolve_eval_sets(decon.cfg.filter.decontaminate, None)[0].sha256 != file_sha
    assert decon.manifest.config["eval_sets"] == [{"name": "tiny", "uri": decon.eval_uri, "sha256": s["sha256"]}]


def test_join_finds_the_planted_records_only(spark, setup):
    assert contaminated_keys(spark, setup, setup.cfg) == set(PLANTED)


def test_answers_are_matched_when_asked(spark, setup):
    """With decontaminate_answers the record whose answer is q-answer's answer is contaminated too."""
    cfg = make_cfg(setup.root, setup.eval_uri, decontaminate_answers=True)
    assert contaminated_keys(spark, setup, cfg) == {*PLANTED, "k-answer"}


def test_plan_is_an_equi_join_without_cartesian_product(spark, setup):
    plans: list[str] = []
    contaminated_keys(spark, setup, setup.cfg, plans)
    assert "CartesianProduct" not in plans[0] and "BroadcastNestedLoopJoin" not in plans[0]
    assert "SortMergeJoin" in plans[0] or "BroadcastHashJoin" in plans[0] or "ShuffledHashJoin" in plans[0]


def test_bad_eval_sets_are_refused_before_compute(tmp_path):
    with pytest.raises(ConfigError, match="file:// or s3://"):
        make_cfg(tmp_path, "hdfs://nn/evals/x.jsonl")
    with pytest.raises(ConfigError, match="must be unique"):
        load_config(env={}, overrides={"filter.decontaminate": [{"uri": "file:///a/x.jsonl"}, {"uri": "file:///b/x.jsonl"}]})
    cfg = make_cfg(tmp_path, uris.qualify(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="has no .jsonl/.json/.parquet files"):
        dc.resolve_eval_sets(cfg.filter.decontaminate, None)


def test_an_eval_set_on_s3_is_hashed_then_fetched_and_checked(s3_server, s3_bucket_uri, tmp_path):
    """A directory of JSONL files in the object store: listed and hashed before compute, copied for
    Spark with each file checked against that hash; a file replaced in between is refused."""
    from pipeline_core.store import open_store

    src = tmp_path / "a.jsonl"
    write_eval_set(src)
    prefix = uris.join(s3_bucket_uri, "evals", "tiny")
    store, key = open_store(prefix, s3_server.storage)
    store.put_file(f"{key}/a.jsonl", src)
    store.put_bytes(f"{key}/b.jsonl", b'{"id": "x", "question": "one more question"}\n')
    store.put_bytes(f"{key}/README.md", b"not an eval file")
    cfg = make_cfg(tmp_path, prefix)
    cfg.storage = s3_server.storage
    (es,) = dc.resolve_eval_sets(cfg.filter.decontaminate, cfg.storage)
    assert [uris.name(f.uri) for f in es.files] == ["a.jsonl", "b.jsonl"] and es.format == "jsonl"
    paths = dc.local_eval_files(es, tmp_path / "dl", cfg.storage)
    assert [uris.to_local_path(p).read_bytes() for p in paths][0] == src.read_bytes()
    store.put_bytes(f"{key}/b.jsonl", b'{"id": "x", "question": "changed"}\n')
    from pipeline_core.store import ChecksumMismatch

    with pytest.raises((ChecksumMismatch, ValueError)):
        dc.local_eval_files(es, tmp_path / "dl2", cfg.storage)
