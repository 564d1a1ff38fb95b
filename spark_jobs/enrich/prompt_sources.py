"""Withheld prompts re-joined from the seed datasets a user holds (`enrich.prompt_sources`), in Spark.

A row whose prompt is withheld carries a `family.RestoreKey` (source hub id, recipe, key). Each
configured source is read with Spark (Parquet or JSON Lines; any URI the readers take) into
(`restore_source`, `restore_recipe`, `restore_key`, `seed_prompt`, `seed_system`), one row per key,
and joined to the records (a shuffle join: seed tables are millions of rows; Spark broadcasts a
small one itself). Recipes (docs/data-sources.md):
  - `sha256`: key = sha256 of the seed's first user turn as UTF-8, no normalisation (WildChat-1M's
    and lmsys-chat-1m's `conversation[0].content`); the seed's first system message fills a
    withheld system turn;
  - `index`: key = `<split>/<row>`: the row's position in the seed's split (files `<split>-*` /
    `<split>.<ext>` in name order, rows in file order); the text is TACO's / APPS' `question`,
    code_contests' `description`, codeforces' description + input / output formats + examples + note.
Several seed rows with one key (the same first prompt in two conversations) keep the smallest
(prompt, system) pair: deterministic. Each source's files are listed with size and sha256 for the
manifest, so a result names exactly what it was joined against.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline_core import uris
from pipeline_core.handoffs import PromptSourceOutcome, SourceFile

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from pipeline_core.config import StorageSection

log = logging.getLogger("spark_jobs.enrich.prompt_sources")

SEED_SCHEMA = "restore_source string, restore_recipe string, restore_key string, seed_prompt string, seed_system string"
SOURCE_MISSING = "prompt_source_missing"  # the row's seed dataset has no enrich.prompt_sources entry
NOT_FOUND = "prompt_not_found"  # the source is configured, the key is not in it
RESTORED = "restored"
_SPLIT_OF_SEED_FILE = re.compile(r"([^/]+?)(?:-[^/]*|\.[^/.]+)$")
CONVERSATION_COLUMNS = ("conversation", "messages")
# hub id (lower case) -> the columns whose text is the question, for the `index` recipe
QUESTION_COLUMNS = {"baai/taco": "question", "codeparrot/apps": "question", "deepmind/code_contests": "description"}
CODEFORCES = "open-r1/codeforces"


@dataclass
class SourceInfo:
    """One configured source, as the manifest records it."""

    hub_id: str
    uri: str
    recipes: list[str] = field(default_factory=list)
    files: list[SourceFile] = field(default_factory=list)
    rows: int = 0
    downloaded_to: str | None = None

    def as_manifest(self, counts: dict[str, int]) -> PromptSourceOutcome:
        """`counts`: restore status -> rows of this source."""
        return PromptSourceOutcome(
            uri=self.uri, config_key=f"enrich.prompt_sources[{self.hub_id!r}]", recipes=self.recipes, rows=self.rows,
            files=self.files, downloaded_to=self.downloaded_to, restored=counts.get(RESTORED, 0),
            unrestorable=sum(n for k, n in counts.items() if k != RESTORED), outcomes=dict(sorted(counts.items())))


def _local_copy(uri: str, dest: Path, storage: StorageSection | None, spark: SparkSession) -> str | None:
    """hub datasets, and s3:// without an s3a connector, are copied to staging first."""
    from spark_jobs.enrich.readers import HUB_PREFIX, download_store_prefix, parse_hub_uri, spark_reads_s3

    if uri.startswith(HUB_PREFIX):
        from huggingface_hub import snapshot_download

        repo_id, revision = parse_hub_uri(uri)
        local = snapshot_download(repo_id=repo_id, repo_type="dataset", revision=revision, local_dir=str(dest),
                                  allow_patterns=["*.parquet", "*.jsonl", "*.json"])
        return uris.qualify(local)
    if uris.scheme_of(uri) == "s3" and not spark_reads_s3(spark):
        return download_store_prefix(uri, [], dest, storage)
    return None


def seed_files(spark: SparkSession, uri: str) -> list[str]:
    """Parquet / JSON Lines files of a seed copy: the file itself, or those at its top, under
    `data/` or one directory down (`<split>/…`)."""
    from spark_jobs.enrich.readers import glob_files

    base = uris.to_spark_uri(uri).rstrip("/")
    exts = ("parquet", "jsonl", "json")
    if base.endswith(tuple(f".{e}" for e in exts)):
        return glob_files(spark, base)
    for layout in ("", "data/", "*/"):
        files = sorted({p for e in exts for p in glob_files(spark, f"{base}/{layout}*.{e}")})
        if files:
            return files
    raise FileNotFoundError(f"no .parquet/.jsonl files under {uri}")


def _read_indexed(spark: SparkSession, files: list[str]) -> DataFrame:
    """The seed's rows + `_split` and `_row` (position in its split: files in name order)."""
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    frames = []
    for f in files:  # per file: a row's position in it (a driver loop over files, not rows)
        if f.endswith(".parquet"):
            df = spark.read.parquet(f).withColumn("_pos", F.col("_metadata.row_index"))
        else:
            df = spark.read.json(f)
            schema = df.schema.add("_pos", "long")
            df = spark.createDataFrame(df.rdd.zipWithIndex().map(lambda r: (*r[0], r[1])), schema)
        frames.append(df.withColumn("_file", F.lit(f)))
    out = frames[0]
    for df in frames[1:]:
        out = out.unionByName(df, allowMissingColumns=True)
    out = out.withColumn("_split", F.regexp_extract("_file", _SPLIT_OF_SEED_FILE.pattern, 1))
    sizes = out.groupBy("_split", "_file").agg(F.count(F.lit(1)).alias("_n"))
    w = Window.partitionBy("_split").orderBy("_file").rowsBetween(Window.unboundedPreceding, -1)
    offsets = sizes.withColumn("_off", F.coalesce(F.sum("_n").over(w), F.lit(0))).select("_split", "_file", "_off")
    return out.join(F.broadcast(offsets), ["_split", "_file"]).withColumn("_row", F.col("_off") + F.col("_pos"))


def _first_of_role(conv: Column, role: str) -> Column:
    from pyspark.sql import functions as F

    return F.try_element_at(F.filter(conv, lambda m: F.lower(m["role"]) == role), F.lit(1))["content"]


def _codeforces_text(df: DataFrame) -> Column:
    """description, Input, Output, Examples (each input / output), Note: the problem as shown."""
    from pyspark.sql import functions as F

    def col(name: str) -> Column:
        return F.col(name).cast("string") if name in df.columns else F.lit(None).cast("string")

    examples = (F.array_join(F.transform(F.col("examples"), lambda e: F.concat_ws(
        "\n", F.lit("Input"), e["input"], F.lit("Output"), e["output"])), "\n\n")
        if "examples" in df.columns else F.lit(None).cast("string"))
    return F.concat_ws(
        "\n\n", col("description"),
        F.when(col("input_format").isNotNull(), F.concat(F.lit("Input\n\n"), col("input_format"))),
        F.when(col("output_format").isNotNull(), F.concat(F.lit("Output\n\n"), col("output_format"))),
        F.when(examples.isNotNull() & (examples != ""), F.concat(F.lit("Examples\n\n"), examples)),
        F.when(col("note").isNotNull(), F.concat(F.lit("Note\n\n"), col("note"))),
    )


def seed_frame(spark: SparkSession, hub_id: str, files: list[str]) -> tuple[DataFrame, list[str]]:
    """(rows of SEED_SCHEMA, recipes) of one source, by the columns it has."""
    from pyspark.sql import functions as F

    df = _read_indexed(spark, files)
    frames, recipes = [], []
    conv = next((c for c in CONVERSATION_COLUMNS if c in df.columns), None)
    if conv:
        prompt = _first_of_role(F.col(conv), "user")
        frames.append(df.select(F.lit("sha256").alias("restore_recipe"), F.sha2(prompt, 256).alias("restore_key"),
                                prompt.alias("seed_prompt"), _first_of_role(F.col(conv), "system").alias("seed_system")))
        recipes.append("sha256")
    question = (_codeforces_text(df) if hub_id.lower() == CODEFORCES and "description" in df.columns
                else F.col(QUESTION_COLUMNS[hub_id.lower()]) if QUESTION_COLUMNS.get(hub_id.lower()) in df.columns
                else F.col("question") if "question" in df.columns else None)
    if question is not None:
        frames.append(df.select(F.lit("index").alias("restore_recipe"),
                                F.concat_ws("/", "_split", F.col("_row").cast("string")).alias("restore_key"),
                                question.cast("string").alias("seed_prompt"), F.lit(None).cast("string").alias("seed_system")))
        recipes.append("index")
    if not frames:
        raise ValueError(f"enrich.prompt_sources[{hub_id!r}]: {files[0]} has none of the columns a recipe reads "
                         f"({', '.join(CONVERSATION_COLUMNS)}, question, description); columns: {df.columns}")
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f)
    best = F.min(F.struct("seed_prompt", "seed_system")).alias("_best")
    out = (out.where(F.col("restore_key").isNotNull() & F.col("seed_prompt").isNotNull())
           .groupBy("restore_recipe", "restore_key").agg(best))
    return out.select(F.lit(hub_id).alias("restore_source"), "restore_recipe", "restore_key",
                      F.col("_best.seed_prompt").alias("seed_prompt"),
                      F.col("_best.seed_system").alias("seed_system")), recipes


def file_hashes(spark: SparkSession, files: list[str]) -> list[SourceFile]:
    """path (a URI here), size and sha256 of each file, through Spark's binaryFile source (any file system)."""
    from pyspark.sql import functions as F

    rows = (spark.read.format("binaryFile").load(files)
            .select("path", "length", F.sha2("content", 256).alias("sha256")).collect())
    return sorted((SourceFile(path=path, size=int(size), sha256=sha) for path, size, sha in rows), key=lambda f: f.path)


def seeds(spark: SparkSession, sources: dict[str, str], staging: Path,
          storage: StorageSection | None = None) -> tuple[DataFrame | None, dict[str, SourceInfo]]:
    """Every configured source's seed rows, unioned (None when none is configured), and their
    manifest descriptions."""
    frames, infos = [], {}
    for i, (hub_id, uri) in enumerate(sorted(sources.items())):
        info = SourceInfo(hub_id, uri)
        info.downloaded_to = _local_copy(uri, staging / "seeds" / str(i), storage, spark)
        files = seed_files(spark, info.downloaded_to or uri)
        frame, info.recipes = seed_frame(spark, hub_id, files)
        info.files = file_hashes(spark, files)
        frames.append(frame)
        infos[hub_id] = info
    if not frames:
        return None, infos
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f)
    return out, infos


def join_seeds(records: DataFrame, seed_rows: DataFrame | None) -> DataFrame:
    """`records` (with `restore_source`, `restore_recipe`, `restore_key`) + `seed_prompt`, `seed_system`."""
    from pyspark.sql import functions as F

    if seed_rows is None:
        return records.withColumn("seed_prompt", F.lit(None).cast("string")).withColumn(
            "seed_system", F.lit(None).cast("string"))
    return records.join(seed_rows, ["restore_source", "restore_recipe", "restore_key"], "left")
