"""Rows are never lost quietly to `spark.sql.files.ignoreCorruptFiles` (issue 26.9b), through the enrich
stage (`enrich.run`, the stage command's body): the setting is refused in a stage's spark_conf unless
the deployment accepts the loss; when the session skips a corrupt file's rows anyway (a cluster
default), the rows read per file are compared with the file's own count (its Parquet footer) and the
stage fails naming the file; with the loss accepted, the manifest records it per file and
in = out + rejected still holds (`rejected.corrupt_input_file`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest
from pipeline_core.config import ConfigError, load_config
from spark_jobs.enrich import job as enrich
from spark_jobs.enrich.readers import CorruptInputFiles

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "nemotron_v1" / "data"
IGNORE = "spark.sql.files.ignoreCorruptFiles"


def _input(tmp: Path) -> tuple[Path, int]:
    """chat as shipped, and code whose column chunks are garbage from its third row group on (its footer intact)."""
    data = tmp / "raw" / "data"
    data.mkdir(parents=True)
    shutil.copy(SAMPLE / "chat-00000-of-00001.parquet", data)
    code = data / "code-00000-of-00001.parquet"
    table = pq.read_table(SAMPLE / "code-00000-of-00001.parquet")
    pq.write_table(table, code, row_group_size=10, compression="zstd")
    meta = pq.read_metadata(code)
    raw = bytearray(code.read_bytes())
    for g in range(2, meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            col = group.column(c)
            start = min(o for o in (col.dictionary_page_offset, col.data_page_offset) if o)
            for i in range(start, start + col.total_compressed_size):
                raw[i] ^= 0x5A
    code.write_bytes(bytes(raw))
    return tmp / "raw", table.num_rows


def _cfg(tmp: Path, **enrich):
    return load_config(env={}, overrides={
        "pipeline.staging_uri": uris.qualify(tmp / "staging"),
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2, "splits": ["chat", "code"], **enrich}})


def test_the_setting_is_refused_unless_the_deployment_accepts_the_loss(tmp_path):
    with pytest.raises(ConfigError, match=rf"enrich: .*{IGNORE}.*enrich\.accept_corrupt_file_loss"):
        _cfg(tmp_path, spark_conf={IGNORE: "true"})
    with pytest.raises(ConfigError, match=r"filter: .*only the enrich stage"):
        load_config(env={}, overrides={"filter.spark_conf": {IGNORE: "true"}})
    from plugins.mft_airflow.settings import load_settings
    with pytest.raises(ValueError, match="SPARK_CONF.*enrich.accept_corrupt_file_loss"):
        load_settings(env={"MFT_DEPLOY__SPARK_CONF": f"{{{IGNORE}: 'true'}}"})


def test_rows_a_corrupt_file_loses_fail_the_stage_or_are_recorded(spark, tmp_path):
    raw, code_rows = _input(tmp_path)
    store = uris.qualify(tmp_path / "store")
    out = uris.join(store, "datasets", "v1", "enriched", "a")
    spark.conf.set(IGNORE, "true")  # as a cluster's spark-defaults.conf would
    try:
        with pytest.raises(CorruptInputFiles, match=r"code-00000-of-00001\.parquet: 52 vs \d+"):
            enrich.run(uris.qualify(raw), out, _cfg(tmp_path), spark=spark)
        assert read_manifest(out) is None  # nothing committed
        accepted = uris.join(store, "datasets", "v1", "enriched", "b")
        m = enrich.run(uris.qualify(raw), accepted,
                       _cfg(tmp_path, spark_conf={IGNORE: "true"}, accept_corrupt_file_loss=True), spark=spark)
    finally:
        spark.conf.unset(IGNORE)
    (name, loss), = m.extra["source"]["corrupt_files"].items()
    assert name.endswith("code-00000-of-00001.parquet") and loss["expected"] == code_rows == 52
    assert 0 < loss["read"] < code_rows
    lost = m.counts["rejected"]["corrupt_input_file"]
    assert lost == code_rows - loss["read"]
    assert m.counts["in"] == m.counts["out"] + sum(m.counts["rejected"].values())
    chat_rows = pq.read_metadata(raw / "data" / "chat-00000-of-00001.parquet").num_rows
    assert m.counts["in"] == chat_rows + code_rows  # every input row is accounted for, lost ones included
