"""Bad input to the data stages, loud and lossless (issue 13 item 7): real Spark local[2] through the
stages' `run(...)` entry points, the real MiniLM and Mistral tokenizer, a local-directory store.

- a JSON Lines line nested deeper than Python's stack and a line of invalid UTF-8 become rejects
  with their reasons; rows in = rows out + rejects; the stage still commits;
- a requested split with no files fails naming the missing split and the splits present;
- an input that is all rejects, or whose rejects exceed `pipeline.max_reject_ratio`, fails the
  stage with the counts and commits nothing;
- the filter verifies a file:// input artifact's files against its manifest (sha256) and refuses
  a tampered file, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import CorruptArtifact, read_manifest
from pipeline_core.config import load_config
from samples import nemotron_v1
from samples.enriched import enriched_table, publish_enriched
from spark_jobs.common import StageFailed
from spark_jobs.enrich import job as enrich
from tests.filter_helpers import FILTER_SETTINGS, KEEP

DEEP = 100_000  # nesting levels: far past Python's recursion limit (json.loads raises RecursionError)


def enrich_cfg(tmp: Path, max_reject_ratio: float = 0.5, **enrich_overrides):
    return load_config(env={}, overrides={
        "pipeline.staging_uri": uris.qualify(tmp / "staging"),
        "pipeline.max_reject_ratio": max_reject_ratio,
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2, "input_format": "jsonl",
                   "splits": ["chat"], **enrich_overrides},
    })


def good_records(n: int) -> list[dict]:
    """Generated chat records the normaliser keeps (none of the sample's crafted rejects)."""
    recs = [r for r in nemotron_v1.generate(60, 11)["chat"]
            if not json.loads(r["metadata"])["sample"]["expected"].get("reject_reason")]
    assert len(recs) >= n
    return recs[:n]


def write_lines(path: Path, records: list[dict], extra: list[bytes] = ()) -> Path:
    """JSON Lines: the records, then the `extra` lines verbatim (bytes: they may not be UTF-8)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False).encode() + b"\n")
        for line in extra:
            f.write(line + b"\n")
    return path


DEEP_LINE = b'{"uuid": "deep", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"
# \xff\xfe is not UTF-8: Spark's text reader turns it into U+FFFD, the reader rejects the line
BAD_UTF8_LINE = b'{"uuid": "bad-utf8", "messages": [{"role": "user", "content": "caf\xff\xfe?"}, ' \
                b'{"role": "assistant", "content": "A cafe."}]}'


def committed(uri: str) -> bool:
    return read_manifest(uri) is not None


def staging_is_clean(tmp: Path) -> bool:
    return not any((tmp / "staging").rglob("*.parquet"))


def test_deep_nesting_and_invalid_utf8_become_rejects_and_the_stage_commits(spark, tmp_path):
    recs = good_records(8)
    src = tmp_path / "raw"
    write_lines(src / "data" / "chat-00000-of-00001.jsonl", recs, [DEEP_LINE, BAD_UTF8_LINE])
    out = uris.qualify(tmp_path / "store" / "enriched")
    m = enrich.run(uris.qualify(src), out, enrich_cfg(tmp_path), spark=spark)
    c = m.counts
    assert c["rejected"] == {"unparseable_json": 1, "invalid_utf8": 1}, c
    assert c["in"] == len(recs) + 2 == c["out"] + sum(c["rejected"].values())
    root = uris.to_local_path(out)
    rejects = ds.dataset(root / m.object_path("rejects"), format="parquet").to_table().to_pylist()
    assert sorted(r["reason"] for r in rejects) == ["invalid_utf8", "unparseable_json"]
    deep = next(r for r in rejects if r["reason"] == "unparseable_json")
    assert deep["raw"].startswith('{"uuid": "deep"') and len(deep["raw"]) == len(DEEP_LINE)  # the line, kept whole
    bad = next(r for r in rejects if r["reason"] == "invalid_utf8")
    assert '"uuid": "bad-utf8"' in bad["raw"] and "\ufffd" in bad["raw"]
    kept = ds.dataset(root / m.object_path("data"), format="parquet").to_table().column("id").to_pylist()
    assert sorted(kept) == sorted(r["uuid"] for r in recs)


def test_line_bytes_decode_to_text_and_invalid_utf8_to_its_reject():
    from spark_jobs.enrich.readers import decode_line, parse_json_line

    assert parse_json_line(decode_line(BAD_UTF8_LINE))["read_error"].startswith("invalid_utf8")
    ok = parse_json_line(decode_line('{"uuid": "é", "messages": []}'.encode()))
    assert ok["read_error"] is None and ok["uuid"] == "é"


def test_a_requested_split_with_no_files_fails_naming_it_and_the_splits_present(spark, tmp_path):
    src = tmp_path / "raw"
    write_lines(src / "data" / "chat-00000-of-00001.jsonl", good_records(3))
    write_lines(src / "data" / "math-00000-of-00001.jsonl", good_records(3))
    out = uris.qualify(tmp_path / "store" / "enriched")
    cfg = enrich_cfg(tmp_path, splits=["chat", "multilingual_de"])
    with pytest.raises(FileNotFoundError) as e:
        enrich.run(uris.qualify(src), out, cfg, spark=spark)
    msg = str(e.value)
    assert "['multilingual_de']" in msg and "splits present: ['chat', 'math']" in msg and "enrich.splits" in msg
    assert not committed(out) and staging_is_clean(tmp_path)


def test_an_input_of_only_rejects_is_never_committed(spark, tmp_path):
    src = tmp_path / "raw"
    write_lines(src / "data" / "chat-00000-of-00001.jsonl", [], [b"not json", b'["an", "array"]', DEEP_LINE])
    out = uris.qualify(tmp_path / "store" / "enriched")
    # max_reject_ratio=1.0: only the empty-output rule can refuse it
    with pytest.raises(StageFailed, match=r"nothing to publish: 3 rows in, 0 out") as e:
        enrich.run(uris.qualify(src), out, enrich_cfg(tmp_path, max_reject_ratio=1.0), spark=spark)
    assert "'unparseable_json': 2" in str(e.value) and "'not_an_object': 1" in str(e.value)
    assert not committed(out) and staging_is_clean(tmp_path)


def test_rejects_over_max_reject_ratio_fail_the_stage_with_the_counts(spark, tmp_path):
    src = tmp_path / "raw"
    write_lines(src / "data" / "chat-00000-of-00001.jsonl", good_records(6), [b"not json", BAD_UTF8_LINE])
    out = uris.qualify(tmp_path / "store" / "enriched")
    with pytest.raises(StageFailed) as e:  # 2 of 8 = 25% > 20%
        enrich.run(uris.qualify(src), out, enrich_cfg(tmp_path, max_reject_ratio=0.2), spark=spark)
    msg = str(e.value)
    assert "2 of 8 rows rejected (25.0%) > pipeline.max_reject_ratio=0.2" in msg, msg
    assert "'invalid_utf8': 1" in msg and "'unparseable_json': 1" in msg
    assert not committed(out) and staging_is_clean(tmp_path)


def test_the_filter_refuses_a_local_input_whose_file_does_not_match_its_manifest(spark, tmp_path):
    from spark_jobs.filter.job import run

    store = tmp_path / "store"
    cfg = load_config(env={}, overrides={
        "filter": FILTER_SETTINGS,
        "pipeline": {"store_uri": uris.qualify(store), "staging_uri": uris.qualify(tmp_path / "staging")},
    })
    in_uri = uris.join(cfg.pipeline.store_uri, "datasets", "t", "enriched", "e1")
    m = publish_enriched(enriched_table(KEEP[:4]), tmp_path / "enriched", in_uri)
    victim = next(f["path"] for f in m.files if f["path"].startswith("data/"))
    p = uris.to_local_path(in_uri) / m.object_path(victim)  # under the manifest's payload prefix
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte; the size stays the same
    p.write_bytes(bytes(data))
    out = uris.join(cfg.pipeline.store_uri, "datasets", "t", "train", "f1")
    with pytest.raises(CorruptArtifact, match=rf"{m.object_path(victim)} does not match its manifest"):
        run(in_uri, out, cfg, spark=spark)
    assert not committed(out) and staging_is_clean(tmp_path)
