"""The typed hand-offs read manifests as the current code writes them, and fail loudly on a renamed key."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pipeline_core.artifacts import Manifest
from pipeline_core.handoffs import FileEntry, StageCounts

SHA = "ab" * 32

# A filtered-stage manifest exactly as pipeline_core.artifacts.Manifest.to_json writes it today.
MANIFEST_JSON = json.dumps({
    "uri": "s3://bucket/runs/r1/filtered", "kind": "filtered", "manifest_version": 2, "payload": "_attempts/a1",
    "files": [{"path": "data/part-0.parquet", "size": 1234, "sha256": SHA}],
    "counts": {"in": 10, "out": 7, "rejected": {"too_long": 2, "contaminated": 1}},
    "config": {}, "config_hash": "h", "inputs": [], "code_version": "abc", "content_sha256": SHA,
    "created_at": 1.0, "timings": {}, "extra": {},
}, indent=2, sort_keys=True).encode()


def test_counts_and_files_round_trip_a_written_manifest():
    m = Manifest.from_json(MANIFEST_JSON)
    c = StageCounts.from_manifest(m)
    assert (c.rows_in, c.rows_out, c.rejected_total, c.balanced) == (10, 7, 3, True)
    assert c.to_counts() == json.loads(MANIFEST_JSON)["counts"]
    files = FileEntry.all_of(m)
    assert [f.to_entry() for f in files] == json.loads(MANIFEST_JSON)["files"]


def test_a_renamed_count_key_fails_loudly():
    d = json.loads(MANIFEST_JSON)
    d["counts"]["rows_in"] = d["counts"].pop("in")
    with pytest.raises(ValidationError, match="in"):
        StageCounts.from_manifest(Manifest.from_json(json.dumps(d).encode()))


def test_a_count_less_artifact_has_no_counts():
    d = json.loads(MANIFEST_JSON)
    d["counts"] = {}
    assert StageCounts.of(Manifest.from_json(json.dumps(d).encode())) is None


def test_a_file_entry_without_its_hash_fails_loudly():
    d = json.loads(MANIFEST_JSON)
    del d["files"][0]["sha256"]
    with pytest.raises(ValidationError, match="sha256"):
        FileEntry.all_of(Manifest.from_json(json.dumps(d).encode()))
