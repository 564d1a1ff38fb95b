"""Bad input gets a clear error and leaves nothing behind: each refusal names what is wrong and
what to change, and no artifact is committed. Driven through the stages' own entry points (the
command line, `run(...)`, `load_tokenizer`), real Spark local[2]."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest
from pipeline_core.config import load_config
from spark_jobs import enrich
from tests.conftest import REPO


@pytest.fixture(scope="module")
def spark():
    from spark_jobs.common import spark_session

    s = spark_session("test-error-paths", "local[2]", 2, {"spark.ui.enabled": "false"})
    yield s
    s.stop()


def _cfg(tmp: Path):
    return load_config(env={}, overrides={"pipeline.staging_uri": uris.qualify(tmp / "staging"),
                                          "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2}})


def _out(tmp: Path) -> str:
    return uris.join(uris.qualify(tmp / "store"), "datasets", "v1", "enriched", "x")


def test_enrich_with_no_input_files_names_the_input_and_commits_nothing(spark, tmp_path):
    src = tmp_path / "empty"
    (src / "data").mkdir(parents=True)
    (src / "data" / "README.txt").write_text("not a data file")
    out = _out(tmp_path)
    with pytest.raises(FileNotFoundError, match="no input files") as e:
        enrich.run(uris.qualify(src), out, _cfg(tmp_path), spark=spark)
    assert uris.qualify(src) in str(e.value)
    assert read_manifest(out) is None


def test_enrich_refuses_parquet_without_messages(spark, tmp_path):
    src = tmp_path / "src" / "data"
    src.mkdir(parents=True)
    pq.write_table(pa.table({"uuid": ["a", "b"], "category": ["chat", "chat"], "text": ["hi", "there"]}),
                   src / "chat-00000-of-00001.parquet")
    out = _out(tmp_path)
    with pytest.raises(ValueError, match="no 'messages' column") as e:
        enrich.run(uris.qualify(src.parent), out, _cfg(tmp_path), spark=spark)
    assert "text" in str(e.value), "the message lists the columns found"
    assert read_manifest(out) is None


@pytest.mark.parametrize("bad", [
    "hf://nvidia/Nemotron-Post-Training-Dataset-v1",  # no datasets/ part
    "hf://datasets/",
    "hf://datasets/nvidia",  # no dataset name
    "hf://datasets/nvidia/Nemotron@",  # empty revision
    "hf://datasets/nvidia/../../etc@main",
])
def test_enrich_command_refuses_a_malformed_hub_uri_before_spark_starts(tmp_path, bad):
    cmd = [sys.executable, str(REPO / "spark_jobs" / "enrich.py"), "--input", bad, "--output", _out(tmp_path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])  # argparse's usage error
    assert "hf://datasets/<owner>/<name>[@revision]" in r.stderr and bad in r.stderr, r.stderr[-2000:]
    assert "SparkContext" not in r.stderr and "Spark" not in r.stdout


def test_a_well_formed_hub_uri_passes_the_command_line():
    from spark_jobs.common import parse_stage_args

    a = parse_stage_args("x", ["--input", "hf://datasets/nvidia/Nemotron-Post-Training-Dataset-v1@v1.1",
                               "--output", "s3://bucket/datasets/v1/enriched/x"])
    assert a.input == "hf://datasets/nvidia/Nemotron-Post-Training-Dataset-v1@v1.1"
    with pytest.raises(SystemExit):
        parse_stage_args("x", ["--input", "file:///data", "--output", "hf://datasets/me/out"])
