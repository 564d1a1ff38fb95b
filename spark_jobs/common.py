"""What every Spark stage (enrich, filter) shares: arguments, session, staging, rejects, counts,
timings, and publishing through `pipeline_core.artifacts`.

A stage's life: `parse_stage_args` -> `load_config` -> `committed_output` (skip: the artifact is
already there) -> `spark_session` -> write Parquet to `staging_for(...)` (a fully qualified
file:// path) -> `artifact_counts` -> `publish` -> `clean_staging`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_core import uris
from pipeline_core.artifacts import ArtifactConflict, Manifest, publish_artifact, read_manifest
from pipeline_core.config import Config, StorageSection, stable_hash
from pipeline_core.layout import staging_dir

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("spark_jobs")

REJECT_SCHEMA = "id string, stage string, reason string, raw string"
REJECT_COLUMNS = ("id", "stage", "reason", "raw")


def setup_logging() -> None:
    """INFO from the project's loggers to stderr (the driver's log). Explicit handlers: under
    spark-submit the root logger is already configured, so basicConfig would do nothing."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("spark_jobs", "pipeline_core"):
        lg = logging.getLogger(name)
        if not lg.handlers:
            lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        lg.propagate = False


def parse_stage_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """`--input URI --output URI --config FILE`. URIs must be fully qualified; a bare path is an
    error here, never something Spark's fs.defaultFS gets to reinterpret."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--input", required=True, help="input URI (file://, s3://, hdfs://, hf://datasets/<id>)")
    ap.add_argument("--output", required=True, help="artifact URI to publish (file:// or s3://)")
    ap.add_argument("--config", default=None, help="resolved config file (YAML/JSON); defaults otherwise")
    a = ap.parse_args(argv)
    for name in ("input", "output"):
        value = getattr(a, name)
        if value.startswith("hf://"):
            if name == "output":
                ap.error(f"--output {value!r}: a stage publishes to file:// or s3://, not to the hub")
            from spark_jobs.readers import parse_hub_uri

            try:
                parse_hub_uri(value)
            except ValueError as e:
                ap.error(str(e))
            continue
        try:
            setattr(a, name, uris.require_uri(value, f"--{name}"))
        except ValueError as e:
            ap.error(f"{e}. To use a local directory say so explicitly: --{name} {uris.qualify(value)}")
    return a


def spark_session(app_name: str, master: str, shuffle_partitions: int, conf: Mapping[str, str] | None = None) -> SparkSession:
    """A SparkSession for a stage. Under `spark-submit` the master it was given wins (Spark's own
    convention; the launcher passes the config's); in-process runs use `master` from the config."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    b = SparkSession.builder.appName(app_name)
    if submitted:
        SparkContext._ensure_initialized()
        given = SparkConf().get("spark.master", None)
        if given and given != master:
            log.warning("spark-submit master %s overrides the config's spark_master %s", given, master)
    else:
        b = b.master(master)
    if master.startswith("local") and not os.environ.get("PYSPARK_PYTHON"):
        # Local Python workers must run the driver's interpreter (the one with the project installed);
        # PySpark reads only the environment variable for this, not spark.pyspark.python.
        os.environ["PYSPARK_PYTHON"] = sys.executable
    settings = {
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.parquet.compression.codec": "zstd",
        "spark.python.worker.reuse": "true",  # keeps the per-process model cache alive across tasks
        "spark.ui.showConsoleProgress": "false",
        **dict(conf or {}),
    }
    if shuffle_partitions > 0:  # 0: the stage sets it from its row count (partitioning.stage_partitions)
        settings.setdefault("spark.sql.shuffle.partitions", str(shuffle_partitions))
    for k, v in settings.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def task_cpus(spark: SparkSession) -> int:
    return int(spark.conf.get("spark.task.cpus", "1") or 1)


def committed_output(output_uri: str, config: dict[str, Any], storage: StorageSection | None) -> Manifest | None:
    """The output's manifest when it is already committed with this config (the stage has nothing to
    do), None when it does not exist. A committed artifact made with another config is an error:
    artifacts are immutable, a new config needs a new URI."""
    m = read_manifest(output_uri, storage)
    if m is None:
        return None
    mine = stable_hash(config)[:12]
    if m.config_hash != mine:
        raise ArtifactConflict(
            f"{output_uri} is already committed with config {m.config_hash}, this run's config is {mine}; "
            "artifacts are immutable: publish under a new URI (the layout's <cfg> part changes with the config)"
        )
    return m


def staging_for(cfg: Config, stage: str, output_uri: str) -> tuple[str, Path]:
    """An empty local staging directory for `output_uri`: (file:// URI for Spark, path for publishing)."""
    uri = staging_dir(cfg, stage, stable_hash(output_uri)[:16])
    if not uris.is_local(uri):
        raise ValueError(
            f"pipeline.staging_uri {cfg.pipeline.staging_uri!r}: Spark stages stage to a file:// directory "
            "(on a cluster, a shared mount) before publishing to the store"
        )
    path = uris.to_local_path(uri)
    clean_staging(path)
    path.mkdir(parents=True, exist_ok=True)
    return uri, path


def clean_staging(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_parquet(df: DataFrame, uri: str) -> None:
    """Overwrite `uri` (must be fully qualified) with the DataFrame as Parquet. On a local path the
    part files get stable names (`part-00000-c000.parquet`, ...; Spark's carry a random job id), so a
    re-run after a crash between upload and manifest overwrites the same keys, and Spark's
    `_SUCCESS` / `.crc` files are removed."""
    df.write.mode("overwrite").parquet(uris.require_uri(uri, "Spark output"))
    if uris.is_local(uri):
        tidy_parts(uris.to_local_path(uri))


_PART = re.compile(r"^part-(\d+)-.*-c(\d+)(\.[a-z0-9]+)?\.parquet$")


def tidy_parts(path: Path) -> None:
    for p in sorted(path.iterdir()):
        m = _PART.match(p.name)
        if m:
            p.rename(p.with_name(f"part-{int(m.group(1)):05d}-c{int(m.group(2)):03d}.parquet"))
        elif p.name == "_SUCCESS" or p.name.endswith(".crc"):
            p.unlink()


def rejects_frame(df: DataFrame, stage: str, id_col: str = "id", reason_col: str = "reason", raw_col: str = "raw") -> DataFrame:
    from pyspark.sql import functions as F

    return df.select(
        F.col(id_col).cast("string").alias("id"), F.lit(stage).alias("stage"),
        F.col(reason_col).cast("string").alias("reason"), F.col(raw_col).cast("string").alias("raw"),
    )


def parquet_rows(path: Path) -> int:
    """Rows in every Parquet file under `path`, from the footers (no Spark job)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in sorted(path.rglob("*.parquet")))


def reject_counts(path: Path) -> dict[str, int]:
    """{reason: n} over the rejects Parquet files under `path`."""
    import pyarrow.parquet as pq

    counts: dict[str, int] = {}
    for p in sorted(path.rglob("*.parquet")):
        for reason in pq.read_table(p, columns=["reason"]).column("reason").to_pylist():
            counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def artifact_counts(n_in: int, staging: Path, data: str = "data", rejects: str = "rejects") -> dict[str, Any]:
    """The manifest's counts `{"in", "out", "rejected": {reason: n}}` from what was written; raises
    when in != out + rejected (a record was lost or duplicated)."""
    out = parquet_rows(staging / data)
    rejected = reject_counts(staging / rejects)
    if n_in != out + sum(rejected.values()):
        raise RuntimeError(f"row counts do not add up: in={n_in}, out={out}, rejected={rejected}")
    return {"in": n_in, "out": out, "rejected": rejected}


class StageTimer:
    """Wall time per step, logged with rows/s; goes into the manifest's timings."""

    def __init__(self, stage: str):
        self.stage = stage
        self.timings: dict[str, float] = {}
        self._t0 = time.perf_counter()

    @contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        info: dict[str, Any] = {}  # the body may set rows=..., plus other rates (e.g. sentences=...)
        t = time.perf_counter()
        log.info("[%s] %s ...", self.stage, name)
        yield info
        dt = time.perf_counter() - t
        self.timings[f"{name}_s"] = round(dt, 3)
        rates = ", ".join(f"{v} {k} ({v / dt:,.1f} {k}/s)" for k, v in info.items() if isinstance(v, int | float))
        log.info("[%s] %s done in %.2f s%s", self.stage, name, dt, f": {rates}" if rates else "")

    def total(self) -> float:
        self.timings["total_s"] = round(time.perf_counter() - self._t0, 3)
        return self.timings["total_s"]


def publish(
    staging: Path,
    output_uri: str,
    *,
    kind: str,
    config: dict[str, Any],
    counts: dict[str, Any],
    storage: StorageSection | None,
    timings: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
    inputs: Sequence[str] = (),
) -> Manifest:
    m = publish_artifact(staging, output_uri, kind=kind, config=config, inputs=list(inputs), counts=counts,
                         extra=extra, timings=timings, storage=storage)
    log.info("published %s: in=%s out=%s rejected=%s", output_uri, counts.get("in"), counts.get("out"),
             counts.get("rejected"))
    return m
