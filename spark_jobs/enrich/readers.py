"""Read raw Nemotron records into one row shape, whatever the source.

Sources: the Nemotron v1/v2 Parquet layout (`data/{split}-*.parquet`, or the files at the top of
the directory), JSON Lines (`*.jsonl` / `*.json`), a single file, an object-store prefix, or a
Hugging Face hub dataset (`hf://datasets/<repo-id>[@revision]`, downloaded to staging first).
Every source becomes the columns of `RAW_SCHEMA`; a line that is not a JSON object does not
crash the job, it carries `read_error` and becomes a reject downstream.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import pandas as pd  # module level: pandas_udf resolves its type hints in this module

from pipeline_core import uris
from pipeline_core.config import LOSSY_SPARK_SETTINGS
from pipeline_core.uris import safe_relpath

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from pipeline_core.config import StorageSection

log = logging.getLogger("spark_jobs.enrich.readers")

STRING_FIELDS = ("uuid", "license", "generator", "version", "category", "reasoning", "metadata")
RAW_SCHEMA = ", ".join(f"{f} string" for f in STRING_FIELDS) + ", messages_json string, raw string, read_error string"
# The v1 `messages` type; v2 (no tool_calls) and JSON Lines records are read into it.
MESSAGES_DDL = (
    "array<struct<role:string,content:string,"
    "tool_calls:array<struct<id:string,type:string,function:struct<name:string,arguments:string>>>>>"
)
EXTENSIONS = {"parquet": ("parquet",), "jsonl": ("jsonl", "json")}


def glob_files(spark: SparkSession, pattern: str) -> list[str]:
    """Files matching a Hadoop glob on any file system Spark can reach (file://, s3a://, hdfs://),
    listed by Spark's own file index (no py4j `_jvm`, so it works under Spark Connect too)."""
    from pyspark.errors import AnalysisException

    parent, _, name = pattern.rstrip("/").rpartition("/")
    reader = spark.read.format("binaryFile")
    if not any(c in parent for c in "*?[{"):
        # list the concrete directory with a name filter: a glob path that matches nothing makes
        # Spark log a stack trace while it looks for streaming metadata
        reader, pattern = reader.option("pathGlobFilter", name).option("recursiveFileLookup", "false"), parent
    try:
        files = reader.load(pattern).inputFiles()
        return sorted(f for f in files if f.rpartition("/")[0].rstrip("/") == parent.rstrip("/")
                      or any(c in parent for c in "*?[{"))
    except AnalysisException as e:  # PATH_NOT_FOUND: nothing matches
        if "PATH_NOT_FOUND" in str(e) or "Path does not exist" in str(e):
            return []
        raise


def find_input_files(spark: SparkSession, input_uri: str, splits: list[str], fmt: str) -> tuple[str, list[str]]:
    """(format, files). Split selection applies to files named `<split>-*`: every requested split
    must have files (else an error naming the missing ones and the splits that exist). A directory
    with no such names at all is read whole (with a warning)."""
    base = uris.to_spark_uri(input_uri).rstrip("/")
    formats = ["parquet", "jsonl"] if fmt == "auto" else [fmt]
    tried = []
    for f in formats:
        exts = EXTENSIONS[f]
        if base.endswith(tuple(f".{e}" for e in exts)):
            return f, glob_files(spark, base)
        for layout in ("data/", ""):
            per_split = {s: sorted({p for e in exts for pat in (f"{s}-*.{e}", f"{s}.{e}")
                                    for p in glob_files(spark, f"{base}/{layout}{pat}")})
                         for s in splits}
            tried += [f"{base}/{layout}{s}-*.{e}" for s in splits for e in exts]
            if any(per_split.values()):
                missing = [s for s, fs in per_split.items() if not fs]
                if missing:
                    present = sorted({re.search(SPLIT_OF_FILE, p).group(1)
                                      for e in exts for p in glob_files(spark, f"{base}/{layout}*.{e}")})
                    raise FileNotFoundError(
                        f"requested split(s) {missing} have no {layout}<split>-*.{exts[0]} files under {input_uri}; "
                        f"splits present: {present}. Set enrich.splits to the ones you mean")
                return f, sorted({p for fs in per_split.values() for p in fs})
        for layout in ("data/", ""):
            pats = [f"{base}/{layout}*.{e}" for e in exts]
            tried += pats
            files = sorted({p for pat in pats for p in glob_files(spark, pat)})
            if files:
                log.warning("no files named <split>-*.%s under %s: reading all %d files, split selection %s "
                            "does not apply", exts[0], input_uri, len(files), splits)
                return f, files
    raise FileNotFoundError(f"no input files for splits {splits} under {input_uri}; looked for {tried}")


HUB_PREFIX = "hf://datasets/"
_HUB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def parse_hub_uri(input_uri: str) -> tuple[str, str | None]:
    """`hf://datasets/<owner>/<name>[@revision]` -> (repo id, revision or None); anything else is
    refused here, before Spark starts or the hub is asked."""
    spec = input_uri[len(HUB_PREFIX):] if input_uri.startswith(HUB_PREFIX) else ""
    repo_id, at, revision = spec.partition("@")
    parts = repo_id.split("/")
    if (len(parts) != 2 or not all(_HUB_NAME.fullmatch(p) and ".." not in p for p in parts)
            or (at and not revision.strip())):
        raise ValueError(f"--input {input_uri!r}: hub datasets are written hf://datasets/<owner>/<name>[@revision], "
                         "e.g. hf://datasets/nvidia/Nemotron-Post-Training-Dataset-v1@main")
    return repo_id, revision or None


def download_hub_dataset(input_uri: str, splits: list[str], dest: Path) -> str:
    """`hf://datasets/<repo-id>[@revision]` -> a local copy of the selected splits (file:// URI)."""
    from huggingface_hub import snapshot_download

    repo_id, revision = parse_hub_uri(input_uri)
    patterns = [f"data/{s}{sep}.{e}" for s in splits for sep in ("-*", "") for e in ("parquet", "jsonl")]
    local = snapshot_download(repo_id=repo_id, repo_type="dataset", revision=revision or None,
                              allow_patterns=patterns, local_dir=str(dest))
    return uris.qualify(local)


def spark_reads_s3(spark: SparkSession) -> bool:
    """Whether this Spark has Hadoop's s3a connector (hadoop-aws): in its jars directory or in the
    session's jars/packages conf (read through the session, so Spark Connect works too)."""
    import glob
    import os

    import pyspark

    jars = f"{spark.conf.get('spark.jars', '')},{spark.conf.get('spark.jars.packages', '')}"
    home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
    return "hadoop-aws" in jars or bool(glob.glob(os.path.join(home, "jars", "hadoop-aws-*.jar")))


def download_store_prefix(input_uri: str, splits: list[str], dest: Path, storage: StorageSection | None) -> str:
    """Copy the input files under an s3:// prefix to `dest` through the shared store (sha256
    verified), keeping their relative paths; the selected splits only, when files are named so."""
    from pipeline_core.store import open_store

    store, key = open_store(input_uri, storage)
    prefix = key.rstrip("/") + "/" if key else ""
    exts = tuple(f".{e}" for es in EXTENSIONS.values() for e in es)
    files = [o.key for o in store.list(prefix) if o.key.endswith(exts)]
    named = [k for k in files if k.rpartition("/")[2].startswith(tuple(f"{s}-" for s in splits))
             or k.rpartition("/")[2].rpartition(".")[0] in splits]
    chosen = named or files
    if not chosen:
        raise FileNotFoundError(f"no .parquet/.jsonl/.json files under {input_uri}")
    # a key is data, never a path: `raw//abs/x.parquet` or `raw/../x.jsonl` would write outside `dest`
    # (issue 26.8a); every key is checked before any file is copied
    root = dest.resolve()
    targets = []
    for k in chosen:
        try:
            rel = safe_relpath(k[len(prefix):], f"input key {k!r} under {input_uri}")
        except ValueError as e:
            raise ValueError(f"{e}; remove or rename that object") from None
        target = dest / rel
        if not target.resolve().is_relative_to(root):  # a symlink planted in the download directory
            raise ValueError(f"input key {k!r} under {input_uri} resolves outside the download directory {dest}")
        targets.append((k, target))
    for k, target in targets:
        store.get_file(k, target)
    log.info("copied %d input file(s) from %s to %s (this Spark has no s3a connector)", len(chosen), input_uri, dest)
    return uris.qualify(dest)


def parse_json_line(line: str) -> dict[str, Any]:
    """One JSON Lines record -> the raw columns; never raises."""
    out: dict[str, Any] = dict.fromkeys(STRING_FIELDS)
    out.update(messages_json=None, raw=line, read_error=None)
    if "\ufffd" in line:  # `decode_line` replaced invalid UTF-8 bytes with U+FFFD
        out["read_error"] = "invalid_utf8: the line holds bytes that are not UTF-8 (or a U+FFFD replacement character)"
        return out
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's stack
        out["read_error"] = f"unparseable_json: {type(e).__name__}: {str(e)[:200]}"
        return out
    if not isinstance(rec, dict):
        out["read_error"] = f"not_an_object: a JSON {type(rec).__name__}"
        return out
    try:
        for f in STRING_FIELDS:
            v = rec.get(f)
            out[f] = v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        if rec.get("messages") is not None:
            out["messages_json"] = json.dumps(rec["messages"], ensure_ascii=False)
    except RecursionError:
        out.update(dict.fromkeys(STRING_FIELDS), messages_json=None,
                   read_error="unparseable_json: RecursionError: nested too deeply to re-encode")
    return out


def _read_parquet(spark: SparkSession, files: list[str], require_messages: bool = True) -> DataFrame:
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    df = spark.read.option("mergeSchema", "true").parquet(*files)
    cols = set(df.columns)
    if "messages" not in cols and require_messages:
        raise ValueError(f"input Parquet has no 'messages' column (columns: {sorted(cols)}); not the Nemotron schema")
    if "messages" not in cols:  # preference records (objective dpo) are read from `raw`
        m = F.lit(None).cast("string")
    else:
        m = F.col("messages") if isinstance(df.schema["messages"].dataType, StringType) else F.to_json("messages")
    fields = [(F.col(f).cast("string") if f in cols else F.lit(None).cast("string")).alias(f) for f in STRING_FIELDS]
    return df.select(
        *fields, m.alias("messages_json"), F.to_json(F.struct(*[F.col(c) for c in df.columns])).alias("raw"),
        F.lit(None).cast("string").alias("read_error"), split_of_file(),
    )


def _read_jsonl(spark: SparkSession, files: list[str]) -> DataFrame:
    from pyspark.sql import functions as F
    from pyspark.sql.functions import pandas_udf

    @pandas_udf(RAW_SCHEMA)
    def parse(lines: pd.Series) -> pd.DataFrame:
        return pd.DataFrame([parse_json_line(decode_line(x)) for x in lines],
                            columns=[*STRING_FIELDS, "messages_json", "raw", "read_error"])

    lines = numbered_lines(spark, files).where(F.trim("value") != "")  # blank lines are not records
    # Spark's text reader keeps a line's bytes as they are, invalid UTF-8 included, and Arrow refuses
    # to turn such a string into Python: hand the UDF the bytes and decode them there.
    parsed = lines.select(parse(F.col("value").cast("binary")).alias("r"), "_where", SPLIT_COLUMN).select(
        "r.*", "_where", SPLIT_COLUMN)
    # A line that does not parse has no uuid: its reject's id is where it is, `<file>:<line>`.
    return parsed.withColumn("uuid", F.when(F.col("read_error").isNotNull() & F.col("uuid").isNull(), F.col("_where"))
                             .otherwise(F.col("uuid"))).drop("_where")


def numbered_lines(spark: SparkSession, files: list[str]) -> DataFrame:
    """Text lines with `split` and `_where` = `<file>:<line number>` (1-based), computed without
    moving the lines: each file split's first line number comes from a small per-split count
    (`_metadata.file_block_start`), each line's place in its split from its position in the task."""
    from pyspark.sql import functions as F

    lines = spark.read.text(files).select(
        "value", split_of_file(), F.col("_metadata.file_path").alias("_f"),
        F.col("_metadata.file_block_start").alias("_b"), F.monotonically_increasing_id().alias("_m"))
    blocks = sorted((r["_f"], int(r["_b"]), int(r["n"]), int(r["m0"])) for r in
                    lines.groupBy("_f", "_b").agg(F.count(F.lit(1)).alias("n"), F.min("_m").alias("m0")).collect())
    starts, before, current = [], 0, None
    for f, b, n, m0 in blocks:
        before = 0 if f != current else before
        current = f
        starts.append((f, b, before, m0))
        before += n
    table = spark.createDataFrame(starts or [("", 0, 0, 0)], "_f string, _b long, _before long, _m0 long")
    return (lines.join(F.broadcast(table), ["_f", "_b"])
            .withColumn("_where", F.concat_ws(":", "_f", (F.col("_before") + F.col("_m") - F.col("_m0") + 1).cast("string")))
            .drop("_f", "_b", "_m", "_before", "_m0"))


SPLIT_COLUMN = "split"


def split_of_file():
    """The record's split: its file's name up to the first `-` (`data/<split>-*`); '' for files not
    named by split; `<split>.jsonl` names its split too. Per-split counts in the manifest come from it. From the scan's `_metadata`
    column, a value of the row itself (`input_file_name()` is per-thread state that a Python UDF
    evaluated in the same stage can read out of step with the rows)."""
    from pyspark.sql import functions as F

    return F.regexp_extract(F.col("_metadata.file_path"), SPLIT_OF_FILE, 1).alias(SPLIT_COLUMN)


# `data/<split>-00000-of-00001.parquet` (v1/v2) or `data/<split>.jsonl` (the SFT collection)
SPLIT_OF_FILE = r"([^/]+?)(?:-[^/]*|\.[^/.]+)$"


def decode_line(line: bytes | bytearray) -> str:
    """A line's bytes as text; invalid UTF-8 becomes U+FFFD, which `parse_json_line` rejects."""
    return bytes(line).decode("utf-8", errors="replace")


def _local_file(spark_path: str) -> Path | None:
    parts = urlsplit(spark_path)
    return Path(unquote(parts.path)) if parts.scheme in ("", "file") else None


def own_row_count(spark_path: str, fmt: str) -> int | None:
    """A file's rows by its own account: the Parquet footer, or the non-blank lines of a JSON Lines
    file (the text reader's line ends); None when the file cannot say (unreadable, not local)."""
    path = _local_file(spark_path)
    if path is None:
        return None
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows
        return sum(1 for line in path.read_bytes().splitlines() if line.strip(b" "))
    except (OSError, ValueError):
        return None


def rows_lost_per_file(spark: SparkSession, files: list[str], fmt: str) -> dict[str, dict[str, int | None]]:
    """Files whose rows Spark read differ from their own count: what `spark.sql.files.ignoreCorruptFiles`
    would drop without a word (issue 26.9b). One extra scan; run only when that setting is on."""
    from pyspark.sql import functions as F

    reader = spark.read.parquet(*files) if fmt == "parquet" else spark.read.text(files).where(F.trim("value") != "")
    # a hash of every column, consumed: a bare count() (or the count of a never-null hash, which
    # the optimizer turns into one) is answered from the footers without decoding a page
    decoded = reader.select(F.col("_metadata.file_path").alias("f"), F.xxhash64(*reader.columns).alias("h"))
    got = {str(_local_file(r[0]) or r[0]): r[1]
           for r in decoded.groupBy("f").agg(F.count(F.lit(1)), F.max("h")).collect()}
    out = {}
    for f in files:
        read = got.get(str(_local_file(f) or f), 0)
        expected = own_row_count(f, fmt)
        if expected is None or read != expected:
            out[f] = {"expected": expected, "read": read}
    return out


class CorruptInputFiles(ValueError):
    """Input files Spark skipped (in part) under spark.sql.files.ignoreCorruptFiles."""


def read_records(spark: SparkSession, input_uri: str, splits: list[str], fmt: str = "auto",
                 download_dir: Path | None = None, storage: StorageSection | None = None,
                 accept_corrupt_file_loss: bool = False,
                 require_messages: bool = True) -> tuple[DataFrame, dict[str, Any]]:
    """(records with the RAW_SCHEMA columns and `split`, a description of the source for the manifest).
    Hub datasets, and s3:// prefixes when Spark has no s3a connector, are first copied to
    `download_dir` (a staging directory). When the session skips corrupt files
    (`spark.sql.files.ignoreCorruptFiles`, from the stage's spark_conf or the cluster's defaults),
    the rows read per file are compared with each file's own count: a shortfall fails the read,
    naming the files, unless `accept_corrupt_file_loss`; then `source["corrupt_files"]` records it."""
    source: dict[str, Any] = {"uri": input_uri}
    remote = input_uri.startswith("hf://") or (uris.scheme_of(input_uri) == "s3" and not spark_reads_s3(spark))
    if remote and download_dir is None:
        raise ValueError(f"reading {input_uri} needs a download directory")
    if input_uri.startswith("hf://"):
        input_uri = download_hub_dataset(input_uri, splits, download_dir)
        source["downloaded_to"] = input_uri
    elif remote:
        input_uri = download_store_prefix(input_uri, splits, download_dir, storage)
        source["downloaded_to"] = input_uri
    fmt, files = find_input_files(spark, input_uri, splits, fmt)
    source.update(format=fmt, files=files, splits=splits)
    if any(spark.conf.get(k, "false").strip().lower() == "true" for k in LOSSY_SPARK_SETTINGS):
        lost = rows_lost_per_file(spark, files, fmt)
        if lost and not accept_corrupt_file_loss:
            raise CorruptInputFiles(
                f"{'/'.join(LOSSY_SPARK_SETTINGS)}=true made Spark skip rows of {len(lost)} input file(s) (expected vs read): "
                + "; ".join(f"{f}: {v['expected']} vs {v['read']}" for f, v in sorted(lost.items()))
                + "; fix or remove those files, or set enrich.accept_corrupt_file_loss to commit without their rows "
                  "(the manifest then records the loss)")
        source.update(ignore_corrupt_files=True, corrupt_files=lost)
    log.info("reading %d %s file(s) from %s", len(files), fmt, input_uri)
    df = _read_parquet(spark, files, require_messages) if fmt == "parquet" else _read_jsonl(spark, files)
    return df, source
