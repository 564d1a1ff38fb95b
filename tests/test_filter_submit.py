"""The filter stage as it is deployed: the real `spark-submit` running spark_jobs/filter/job.py
with `--input/--output/--config`, input and output on S3 (moto's real server over HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from pipeline_core import uris
from pipeline_core.artifacts import fetch_artifact, read_manifest
from pipeline_core.config import load_config
from pipeline_core.handoffs import TrainReadyInfo
from samples.enriched import publish_enriched
from tests.filter_helpers import FILTER_SETTINGS, KEEP, NEAR, crafted_table

REPO = Path(__file__).resolve().parents[1]


def test_spark_submit_filters_s3_enriched_artifact_into_train_ready_shards(s3_server, tmp_path):
    bucket = f"s3://{s3_server.new_bucket()}"
    in_uri = uris.join(bucket, "datasets", "t", "enriched", "e1")
    out_uri = uris.join(bucket, "datasets", "t", "train", "f1")
    publish_enriched(crafted_table(), tmp_path / "enriched", in_uri, s3_server.storage, files=3)
    cfg = load_config(env={}, overrides={
        "filter": {**FILTER_SETTINGS, "spark_master": "local[2]", "shuffle_partitions": 2},
        "storage": s3_server.storage.model_dump(),
        "pipeline": {"store_uri": bucket, "staging_uri": uris.qualify(tmp_path / "staging")},
    })
    config_file = cfg.dump(tmp_path / "config.yaml")

    env = {**os.environ, **s3_server.env, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    p = subprocess.run(
        [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[2]",
         "--conf", "spark.ui.enabled=false", str(REPO / "spark_jobs" / "filter" / "job.py"),
         "--input", in_uri, "--output", out_uri, "--config", str(config_file)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-5000:]
    summary = json.loads(next(line for line in p.stdout.splitlines() if line.startswith('{"uri"')))
    assert summary["counts"]["out"] == len(KEEP)

    manifest = read_manifest(out_uri, s3_server.storage)
    assert manifest is not None and manifest.kind == "train-ready"
    assert manifest.counts["rejected"]["near_duplicate"] == len(NEAR)
    info = TrainReadyInfo.from_manifest(manifest)  # the typed hand-off the trainer reads
    assert info.tokenizer.name == "mistral-v1" and info.seq_len == cfg.filter.seq_len
    local = tmp_path / "fetched"
    fetch_artifact(out_uri, local, s3_server.storage)  # every file verified against the manifest's sha256
    rows = pq.read_table(local / "data" / "train").num_rows + pq.read_table(local / "data" / "val").num_rows
    assert rows == sum(info.sequences.values()) > 0
    assert sorted(f["path"] for f in manifest.files if f["path"].startswith("data/")) == [
        "data/render_sample/part-00000-c000.parquet",  # the export's render check (pipeline_core.render_sample)
        "data/train/part-00000-c000.parquet", "data/val/part-00000-c000.parquet"]  # common.tidy_parts names
    assert not (tmp_path / "staging" / "filter").exists() or not any((tmp_path / "staging" / "filter").iterdir())
