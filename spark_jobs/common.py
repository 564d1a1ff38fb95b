"""What every Spark stage (enrich, filter) shares: arguments, session, staging, rejects, counts,
timings, and publishing through `pipeline_core.artifacts`.

A stage's life is `run_stage`, the one lifecycle both stages use: committed-check (`committed_output`:
the artifact is already there, nothing to do) -> a staging directory of this attempt alone
(`attempt_staging`: unique per attempt, so a retry or a concurrent run never shares or deletes
another attempt's files; what a crashed attempt left is swept by the next attempt of the same
artifact once that attempt is provably dead, spark_jobs.staging) -> Spark session -> the stage's
`compute` (writes Parquet under the staging directory and returns counts + manifest extra) -> count
checks (in = out + rejected; an empty output or a reject share over `pipeline.max_reject_ratio` fails
with the counts) -> `publish` -> cleanup of this attempt's staging (on success and on failure) and
of the frames it persisted.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_core import uris
from pipeline_core.artifacts import ArtifactConflict, Manifest, publish_artifact, read_manifest
from pipeline_core.config import Config, StorageSection, stable_hash
from pipeline_core.handoffs import StageCounts
from pipeline_core.layout import staging_dir
from pipeline_core.store import require_conditional_writes
from spark_jobs.staging import AttemptStaging, sweep_dead_attempts

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("spark_jobs")

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
            from spark_jobs.enrich.readers import parse_hub_uri

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


def stage_staging_dir(cfg: Config, stage: str) -> Path:
    """`<pipeline.staging_uri>/<stage>` as a local path (Spark stages stage to a file:// directory)."""
    uri = staging_dir(cfg, stage)
    if not uris.is_local(uri):
        raise ValueError(
            f"pipeline.staging_uri {cfg.pipeline.staging_uri!r}: Spark stages stage to a file:// directory "
            "(on a cluster, a shared mount) before publishing to the store"
        )
    return uris.to_local_path(uri)


def staging_key(output_uri: str) -> str:
    """The part of an attempt's staging name that says which artifact it writes."""
    return stable_hash(output_uri)[:16]


def attempt_staging(cfg: Config, stage: str, output_uri: str) -> AttemptStaging:
    """A new, empty local staging directory owned by this attempt alone, with its owner record and
    heartbeat (spark_jobs.staging). Named `<output key>-<attempt id>`: attempts never share one, and
    an attempt deletes only its own or, through `sweep_dead_attempts`, a provably dead one's."""
    return AttemptStaging(stage_staging_dir(cfg, stage), staging_key(output_uri), cfg.pipeline.staging_ttl_s)


def download_dir(staging: Path) -> Path:
    """Where a stage copies remote inputs: beside its staging directory, never inside it
    (everything inside is published); removed with it."""
    return staging.with_name(staging.name + "-input")


def clean_staging(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_parquet(df: DataFrame, uri: str) -> list[Path]:
    """Overwrite `uri` (must be fully qualified) with the DataFrame as Parquet. On a local path the
    part files get stable names (`part-00000-c000.parquet`, ...; Spark's carry a random job id) and
    Spark's `_SUCCESS` / `.crc` files are removed; returns the part files."""
    df.write.mode("overwrite").parquet(uris.require_uri(uri, "Spark output"))
    return tidy_parts(uris.to_local_path(uri)) if uris.is_local(uri) else []


_PART = re.compile(r"^part-(\d+)-.*-c(\d+)(\.[a-z0-9]+)?\.parquet$")


def tidy_parts(path: Path) -> list[Path]:
    """Stable part names: task number and file-within-task counter both kept (a task that writes
    several files, e.g. with spark.sql.files.maxRecordsPerFile, gives c000, c001, ...), so no rename
    can land on another part. Refuses to overwrite instead of losing a file."""
    out = []
    for p in sorted(path.iterdir()):
        m = _PART.match(p.name)
        if m:
            dest = p.with_name(f"part-{int(m.group(1)):05d}-c{int(m.group(2)):03d}.parquet")
            if dest.exists() and dest != p:
                raise RuntimeError(f"{p.name} and {dest.name} would get the same name in {path}")
            p.rename(dest)
            out.append(dest)
        elif p.name == "_SUCCESS" or p.name.endswith(".crc"):
            p.unlink()
    return sorted(out)


def rejects_frame(df: DataFrame, stage: str, id_col: str = "id", reason_col: str = "reason", raw_col: str = "raw") -> DataFrame:
    from pyspark.sql import functions as F

    return df.select(
        F.col(id_col).cast("string").alias("id"), F.lit(stage).alias("stage"),
        F.col(reason_col).cast("string").alias("reason"), F.col(raw_col).cast("string").alias("raw"),
    )


def parquet_rows(path: Path | Sequence[Path]) -> int:
    """Rows in every Parquet file under `path` (or in the given files), from the footers (no Spark job)."""
    import pyarrow.parquet as pq

    files = sorted(path.rglob("*.parquet")) if isinstance(path, Path) else list(path)
    return sum(pq.ParquetFile(p).metadata.num_rows for p in files)


def reject_counts(path: Path) -> dict[str, int]:
    """{reason: n} over the rejects Parquet files under `path`."""
    import pyarrow.parquet as pq

    counts: dict[str, int] = {}
    for p in sorted(path.rglob("*.parquet")):
        for reason in pq.read_table(p, columns=["reason"]).column("reason").to_pylist():
            counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def artifact_counts(n_in: int, staging: Path, data: str = "data", rejects: str = "rejects") -> StageCounts:
    """The manifest's counts (in, out, rejected by reason) from what was written; raises
    when in != out + rejected (a record was lost or duplicated)."""
    return StageCounts(rows_in=n_in, rows_out=parquet_rows(staging / data),
                       rejected=reject_counts(staging / rejects)).require_balanced()


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
    counts: StageCounts,
    storage: StorageSection | None,
    timings: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
    inputs: Sequence[str] = (),
) -> Manifest:
    m = publish_artifact(staging, output_uri, kind=kind, config=config, inputs=list(inputs), counts=counts,
                         extra=extra, timings=timings, storage=storage)
    log.info("published %s: in=%s out=%s rejected=%s", output_uri, counts.rows_in, counts.rows_out, counts.rejected)
    return m


class StageFailed(RuntimeError):
    """The stage's output must not be committed (empty, or too many rejects); carries the counts."""


def check_counts(counts: StageCounts, max_reject_ratio: float, stage: str) -> None:
    """in = out + rejected; a non-empty output; rejects at most `max_reject_ratio` of the input."""
    counts.require_balanced(f"[{stage}]")
    n_in, n_out, rejected, n_rej = counts.rows_in, counts.rows_out, counts.rejected, counts.rejected_total
    if n_out == 0:
        raise StageFailed(f"[{stage}] nothing to publish: {n_in} rows in, 0 out, rejected {rejected}; "
                          "an empty artifact is never committed (check the input and the thresholds)")
    if n_in and n_rej / n_in > max_reject_ratio:
        raise StageFailed(
            f"[{stage}] {n_rej} of {n_in} rows rejected ({n_rej / n_in:.1%}) > pipeline.max_reject_ratio="
            f"{max_reject_ratio}: {rejected}; fix the input or raise pipeline.max_reject_ratio")


@dataclass
class StageContext:
    """What a stage's `compute` gets: its Spark session, its own staging directory and timer; frames
    it persists go to `persist` (unpersisted by the lifecycle)."""

    spark: SparkSession
    staging_uri: str
    staging: Path
    timer: StageTimer
    persisted: list[DataFrame] = field(default_factory=list)

    def persist(self, df: DataFrame) -> DataFrame:
        from pyspark import StorageLevel

        df = df.persist(StorageLevel.MEMORY_AND_DISK)
        self.persisted.append(df)
        return df


@dataclass(frozen=True)
class StageOutput:
    """What `compute` returns: the manifest's counts and extra, and the input artifacts it read."""

    counts: StageCounts
    extra: dict[str, Any]
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageSpec:
    name: str  # "enrich" | "filter"
    kind: str  # the artifact kind it publishes
    app_name: str


def run_stage(spec: StageSpec, cfg: Config, section: Any, output_uri: str, config: dict[str, Any],
              compute: Callable[[StageContext], StageOutput], spark: SparkSession | None = None,
              before_compute: Callable[[], None] | None = None) -> Manifest:
    """The lifecycle of a Spark stage (see the module docstring). `section` is the stage's
    SparkStageSection (master, partitions, spark_conf, arrow_batch_rows)."""
    # what crashed attempts of this artifact left behind goes first (also when it is already committed)
    sweep_dead_attempts(stage_staging_dir(cfg, spec.name), staging_key(output_uri), cfg.pipeline.staging_ttl_s)
    done = committed_output(output_uri, config, cfg.storage)
    if done is not None:
        log.info("%s is already committed with this config (counts %s); nothing to do", output_uri, done.counts)
        return done
    require_conditional_writes(output_uri, cfg.storage)  # the commit is a create-if-absent: refuse a store without it now
    if before_compute is not None:
        before_compute()  # checks that must fail before any Spark work
    timer = StageTimer(spec.name)
    attempt = attempt_staging(cfg, spec.name, output_uri)
    staging, staging_uri = attempt.path, uris.qualify(attempt.path)
    own = spark is None
    ctx = None
    try:
        if own:
            conf = {"spark.sql.execution.arrow.maxRecordsPerBatch": str(section.arrow_batch_rows), **section.spark_conf}
            spark = spark_session(spec.app_name, section.spark_master, section.shuffle_partitions, conf)
        ctx = StageContext(spark, staging_uri, staging, timer)
        out = compute(ctx)
        check_counts(out.counts, cfg.pipeline.max_reject_ratio, spec.name)
        timer.total()
        with timer.step("publish"):
            return publish(staging, output_uri, kind=spec.kind, config=config, counts=out.counts, storage=cfg.storage,
                           timings=timer.timings, extra=out.extra, inputs=out.inputs)
    finally:
        for frame in (ctx.persisted if ctx else ()):
            frame.unpersist()
        if own and spark is not None:
            spark.stop()
        attempt.close()  # the staging directory, its -input / -docs siblings, the owner record
