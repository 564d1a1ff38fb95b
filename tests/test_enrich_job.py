"""The enrich Spark job end to end: real Spark (local[2]), the real MiniLM, the real S3 server,
and the real spark-submit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import ArtifactConflict, read_manifest, verify_artifact
from pipeline_core.config import load_config
from samples import nemotron_v1
from spark_jobs.common import parse_stage_args
from spark_jobs.enrich import job as enrich

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "nemotron_v1"
CONTRACT = {
    "id": pa.string(), "category": pa.string(), "reasoning": pa.string(), "question": pa.string(),
    "answer": pa.string(), "reasoning_trace": pa.string(), "context_sentences": pa.list_(pa.string()),
    "relevant_sentences": pa.list_(pa.struct([("text", pa.string()), ("index", pa.int32()), ("score", pa.float64())])),
    "sim_context_question": pa.float64(), "sim_context_answer": pa.float64(), "sim_question_answer": pa.float64(),
    "question_embedding": pa.list_(pa.float32()), "answer_embedding": pa.list_(pa.float32()),
    "context_turns": pa.list_(pa.int32()), "context_question_scores": pa.list_(pa.float64()),
}


def _cfg(tmp: Path, **enrich_overrides):
    return load_config(env={}, overrides={
        "pipeline.staging_uri": uris.qualify(tmp / "staging"),
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2, **enrich_overrides},
    })


@pytest.fixture(scope="module")
def sample_run(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("enrich")
    cfg = _cfg(tmp)
    out = uris.join(uris.qualify(tmp / "store"), "datasets", "sample", "enriched", "x")
    manifest = enrich.run(uris.qualify(SAMPLE), out, cfg, spark=spark)
    root = uris.to_local_path(out)
    return {
        "cfg": cfg, "tmp": tmp, "out": out, "manifest": manifest,
        # payload under the prefix the manifest names (one writer per artifact)
        "data": ds.dataset(root / manifest.object_path("data"), format="parquet").to_table(),
        "rejects": ds.dataset(root / manifest.object_path("rejects"), format="parquet").to_table(),
        "records": [r for rs in nemotron_v1.generate(300, 0).values() for r in rs],
    }


def test_artifact_follows_the_contract(sample_run):
    data, m = sample_run["data"], sample_run["manifest"]
    for name, typ in CONTRACT.items():
        assert data.schema.field(name).type == typ, name
    # v1's message type + the SFT collection's reasoning_content (issue 28)
    msg = data.schema.field("messages").type.value_type
    v1 = nemotron_v1.arrow_schema().field("messages").type.value_type
    assert [msg.field(i).name for i in range(msg.num_fields)] == ["role", "content", "reasoning_content", "tool_calls"]
    assert all(msg.field(v1.field(i).name).type == v1.field(i).type for i in range(v1.num_fields))
    assert m.kind == "enriched" and m.extra["embedding_dim"] == 384
    assert set(m.extra["extra_columns"]) == {"question_embedding", "answer_embedding", "metadata", "context_turns",
                                             "context_question_scores", "license", "generator", "used_in",
                                             "seed_dataset", "source_split"}
    assert m.extra["licenses"] == {"cc-by-4.0": m.counts["out"]} and m.extra["prompt_sources"] == {}
    assert sample_run["rejects"].column_names == ["id", "stage", "reason", "raw"]
    verify_artifact(sample_run["out"])  # every file present with its manifest's sha256
    assert {f["path"].split("/")[0] for f in m.files} == {"data", "rejects"}
    assert all(re.fullmatch(r"(data|rejects)/part-\d{5}-c\d{3}\.parquet", f["path"]) for f in m.files), m.files
    ids = data.column("id").to_pylist()
    assert len(ids) == len(set(ids))
    assert not any(uris.to_local_path(sample_run["cfg"].pipeline.staging_uri).rglob("*.parquet"))  # staging cleaned


def test_every_record_is_accounted_for_with_its_reason(sample_run):
    m, data, rejects, records = (sample_run[k] for k in ("manifest", "data", "rejects", "records"))
    c = m.counts
    assert c["in"] == len(records) == c["out"] + sum(c["rejected"].values())
    assert c["out"] == data.num_rows and sum(c["rejected"].values()) == rejects.num_rows
    expected = {}
    for r in records:
        reason = json.loads(r["metadata"])["sample"]["expected"].get("reject_reason")
        if reason:
            expected[r["uuid"]] = reason
    got = dict(zip(rejects.column("id").to_pylist(), rejects.column("reason").to_pylist(), strict=True))
    assert got == expected
    # per split (the file's `<split>-*` name), as the manifest publishes them
    per_split: dict = {}
    for split, recs in nemotron_v1.generate(300, 0).items():
        c = per_split.setdefault(split, {"in": 0, "out": 0, "rejected": {}})
        for r in recs:
            c["in"] += 1
            if r["uuid"] in expected:
                c["rejected"][expected[r["uuid"]]] = c["rejected"].get(expected[r["uuid"]], 0) + 1
            else:
                c["out"] += 1
    assert m.extra["splits"] == per_split and per_split["code"]["rejected"].get("prompt_withheld")
    assert set(rejects.column("stage").to_pylist()) == {"enrich"}
    raw = json.loads(rejects.filter(pa.compute.equal(rejects.column("reason"), "unknown_role")).column("raw")[0].as_py())
    assert raw["messages"][1]["role"] == "narrator"  # the original record is kept


def test_crafted_records_question_answer_and_relevant_context(sample_run):
    rows = {r["id"]: r for r in sample_run["data"].to_pylist()}
    langs, mismatched, matched = set(), [], []
    for r in sample_run["records"]:
        s = json.loads(r["metadata"])["sample"]
        exp, o = s["expected"], rows.get(r["uuid"])
        if o is None:
            continue
        for key in ("question", "answer", "reasoning_trace"):
            if key in exp:
                assert o[key] == exp[key], (key, s)
        if s["kind"] == "context_selection":
            best = max(o["relevant_sentences"], key=lambda x: x["score"])
            assert best["text"] == exp["relevant"][0], (exp["lang"], o["relevant_sentences"])
            assert o["context_sentences"][best["index"]] == best["text"]
            idx = [x["index"] for x in o["relevant_sentences"]]
            assert idx == sorted(idx) and len(idx) <= 5
            langs.add(exp["lang"])
            assert o["sim_context_question"] is not None
        if s["kind"] == "chat_single":
            assert o["sim_context_question"] is None and o["relevant_sentences"] == []
        if s["kind"] == "mismatch":
            mismatched.append(o["sim_question_answer"])
        if s["kind"] in ("chat_single", "context_selection"):
            matched.append(o["sim_question_answer"])
        # the enriched message type carries reasoning_content (issue 28); null where the record had none
        assert all(m["reasoning_content"] is None for m in o["messages"])
        assert [{k: v for k, v in m.items() if k != "reasoning_content"} for m in o["messages"]] == r["messages"]
    assert langs == {"en", "de", "fr", "es", "zh", "ja"}
    assert max(mismatched) < 0.2 < min(matched)


def test_rerun_does_no_work_and_another_config_is_refused(sample_run, monkeypatch):
    out, cfg = sample_run["out"], sample_run["cfg"]
    root = uris.to_local_path(out)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}

    def no_spark(*a, **k):
        raise AssertionError("a committed artifact must not start Spark")

    from spark_jobs import common

    monkeypatch.setattr(common, "spark_session", no_spark)
    monkeypatch.setattr(common, "attempt_staging", no_spark)
    again = enrich.run(uris.qualify(SAMPLE), out, cfg)
    assert again.sha256 == sample_run["manifest"].sha256
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before
    with pytest.raises(ArtifactConflict, match="already committed with config"):
        enrich.run(uris.qualify(SAMPLE), out, _cfg(sample_run["tmp"], top_k=2))


def test_bare_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="bare path"):
        enrich.run(uris.qualify(SAMPLE), "relative/out", _cfg(tmp_path))
    with pytest.raises(SystemExit):
        parse_stage_args("x", ["--input", str(SAMPLE), "--output", "file:///tmp/x"])
    a = parse_stage_args("x", ["--input", uris.qualify(SAMPLE), "--output", "s3://b/k"])
    assert a.input.startswith("file:///") and a.output == "s3://b/k"


def _v2_dir(root: Path) -> Path:
    """Nemotron v2-style Parquet (no tool_calls, no metadata) under names the job has never seen."""
    recs = nemotron_v1.generate(60, 7)
    rows = []
    for r in recs["chat"] + recs["math"]:
        msgs = None if r["messages"] is None else [{"role": x["role"], "content": x["content"]} for x in r["messages"]]
        rows.append({k: r[k] for k in ("uuid", "license", "generator", "version", "category", "reasoning")} | {"messages": msgs})
    root.mkdir(parents=True)
    half = len(rows) // 2
    pq.write_table(pa.Table.from_pylist(rows[:half]), root / "part-a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[half:]), root / "part-b.parquet")
    return root


def test_unseen_v2_parquet_from_s3_published_to_s3(spark, s3_server, s3_bucket_uri, tmp_path):
    src = _v2_dir(tmp_path / "unseen")
    n = sum(pq.read_metadata(p).num_rows for p in src.glob("*.parquet"))
    bucket = uris.split_bucket_key(s3_bucket_uri)[0]
    for p in src.glob("*.parquet"):
        s3_server.client().upload_file(str(p), bucket, f"raw/v2/{p.name}")
    cfg = load_config(env={}, overrides={
        "pipeline.staging_uri": uris.qualify(tmp_path / "staging"),
        "storage": {"endpoint_url": s3_server.endpoint, "max_attempts": 3},
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2},
    })
    out = uris.join(s3_bucket_uri, "datasets", "v2", "enriched", "abc")
    m = enrich.run(f"{s3_bucket_uri}/raw/v2", out, cfg, spark=spark)
    assert m.counts["in"] == n == m.counts["out"] + sum(m.counts["rejected"].values())
    # No s3a connector here: the input came through the shared store into staging, then was cleaned up.
    assert m.extra["source"]["uri"] == f"{s3_bucket_uri}/raw/v2" and m.extra["source"]["format"] == "parquet"
    assert not any((tmp_path / "staging").rglob("*.parquet"))
    assert not any(f["path"].endswith("part-a.parquet") for f in m.files)
    assert m.counts["rejected"] and m.counts["out"] > 0
    again = read_manifest(out, cfg.storage)
    assert again is not None and again.sha256 == m.sha256
    verify_artifact(out, cfg.storage)
    local = tmp_path / "fetched"
    from pipeline_core.artifacts import fetch_artifact

    fetch_artifact(out, local, cfg.storage, prefix="data/")
    t = ds.dataset(local / "data", format="parquet").to_table()
    assert t.num_rows == m.counts["out"]
    assert all(x["tool_calls"] is None for ms in t.column("messages").to_pylist() for x in ms)


def test_spark_submit_on_json_lines_with_broken_lines(tmp_path):
    recs = nemotron_v1.generate(40, 5)["tool"][:12]
    src = tmp_path / "jsonl"
    nemotron_v1.write_jsonl(recs, src / "data" / "tool-00000-of-00001.jsonl")
    cfg = _cfg(tmp_path, input_format="jsonl", splits=["tool"])
    cfg_file = cfg.dump(tmp_path / "config.yaml")
    out = uris.qualify(tmp_path / "store" / "enriched")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    spark_submit = Path(sys.executable).parent / "spark-submit"
    p = subprocess.run(
        [str(spark_submit), "--master", "local[2]", str(REPO / "spark_jobs" / "enrich" / "job.py"),
         "--input", uris.qualify(src), "--output", out, "--config", str(cfg_file)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    log = p.stdout + p.stderr  # spark-submit relays the Python driver's stderr on its stdout
    assert p.returncode == 0, log[-4000:]
    assert "[enrich] embed+score+write done" in log and "records/s overall" in log
    m = read_manifest(out)
    assert m is not None and m.extra["source"]["format"] == "jsonl"
    rejected = m.counts["rejected"]
    assert rejected.get("unparseable_json") == 2 and rejected.get("not_an_object") == 1
    assert m.counts["in"] == len(recs) + nemotron_v1.BROKEN_JSONL_LINES == m.counts["out"] + sum(rejected.values())


def test_each_record_knows_its_split_across_files_and_arrow_batches(spark, tmp_path):
    """JSON Lines of two splits, each longer than an Arrow batch (512 rows here), read through the
    Python parser: every row carries the split of its own file (what extra.splits counts)."""
    from spark_jobs.enrich.readers import read_records

    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("chat", 700), ("multilingual_de", 530)):
        (data / f"{split}-00000-of-00001.jsonl").write_text(
            "".join(json.dumps({"uuid": f"{split}:{i}", "messages": []}) + "\n" for i in range(n)))
    df, _ = read_records(spark, uris.qualify(tmp_path), ["chat", "multilingual_de"], "auto")
    rows = df.select("uuid", "split").collect()
    assert len(rows) == 1230 and all(r["uuid"].split(":")[0] == r["split"] for r in rows)
