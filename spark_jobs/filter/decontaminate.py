"""Decontamination: training records that share an n-gram with an evaluation document are rejects.

What Tülu 3 / open-instruct and OLMo do, as a Spark join (no driver-side set of the eval suite, no
all-pairs comparison; linear in the data):
  1. Both sides are cut into normalised tokens (`normalised_tokens`: NFKC, case folded, punctuation
     replaced by spaces, split on white space) and hashed n-grams of `filter.decontam_ngram` tokens
     (`gram_hashes`, 64-bit blake2b of the n tokens; never spanning two fields or turns). An eval text
     shorter than n tokens (but of at least `decontam_min_tokens`) is one "gram" of its own length;
     the training side then also hashes grams of those few lengths.
  2. The distinct hashes of each side are exploded into (key, hash) rows and equi-joined on the hash
     (a shuffle or broadcast hash join, never a nested loop).
  3. Per (record, eval document) the shared hashes are counted: the document contaminates the record
     when shared / the document's grams > `filter.decontam_threshold` (0: any shared gram). A record
     keeps the worst match (largest share; first eval set, smallest doc id on ties) for its reject's detail.
Eval sets are resolved (files listed, sha256 of each) before any compute (`resolve_eval_sets`); the
hashes go into the stage config, so a changed eval file never silently reuses an artifact made with
the old one, and into the manifest with the rows each set removed (`pipeline_core.handoffs.DecontamInfo`).
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd  # module level: pandas_udf resolves its type hints in this module

from pipeline_core import uris
from pipeline_core.config import EvalSetSpec, FilterSection, StorageSection
from pipeline_core.handoffs import DecontamInfo, EvalSetCount
from pipeline_core.store import open_store

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

CONTAMINATED = "contaminated"
EVAL_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
GRAMS_SCHEMA = "array<bigint>"
DOC_SCHEMA = "grams array<bigint>, short_lens array<int>"


def _is_punct(ch: str) -> bool:
    return unicodedata.category(ch).startswith("P")


def normalised_tokens(text: str | None) -> list[str]:
    """NFKC, case folded, punctuation -> space, split on white space (symbols such as + = $ stay)."""
    if not text:
        return []
    t = unicodedata.normalize("NFKC", text).casefold()
    return "".join(" " if _is_punct(c) else c for c in t).split()


def _h64(tokens: Sequence[str]) -> int:
    return int.from_bytes(hashlib.blake2b("\u0001".join(tokens).encode(), digest_size=8).digest(), "big", signed=True)


def gram_hashes(texts: Iterable[str | None], n: int, short_lengths: Sequence[int] = ()) -> list[int]:
    """Distinct hashes of every n-gram of each text (grams never span two texts), plus every k-gram
    for k in `short_lengths` (the lengths of eval documents shorter than n), sorted."""
    out: set[int] = set()
    for text in texts:
        toks = normalised_tokens(text)
        for k in (n, *short_lengths):
            out.update(_h64(toks[i:i + k]) for i in range(len(toks) - k + 1))
    return sorted(out)


def document_grams(texts: Iterable[str | None], n: int, min_tokens: int) -> tuple[list[int], list[int]]:
    """An eval document's grams (each text's n-grams; a text shorter than n tokens but with at least
    `min_tokens` is one gram of its own length) and the lengths of those short grams. A document
    without grams cannot be matched (counted as too short)."""
    grams: set[int] = set()
    short: set[int] = set()
    for text in texts:
        toks = normalised_tokens(text)
        if len(toks) >= n:
            grams.update(_h64(toks[i:i + n]) for i in range(len(toks) - n + 1))
        elif len(toks) >= min_tokens:
            grams.add(_h64(toks))
            short.add(len(toks))
    return sorted(grams), sorted(short)


def conversation_texts(messages_json: str | None, answers: bool) -> list[str]:
    """The texts of a training record that are matched: every non-assistant turn's content (system,
    user, tool results), and with `answers` the assistant turns' too (reasoning included)."""
    import json

    try:
        msgs = json.loads(messages_json) if messages_json else []
    except ValueError:
        return []
    if not isinstance(msgs, list):
        return []
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            continue
        if m.get("role") != "assistant" or answers:
            out.append(m["content"])
    return out


# ---------------------------------------------------------------- eval sets, resolved before compute


@dataclass(frozen=True)
class EvalFile:
    uri: str
    size: int
    sha256: str


@dataclass(frozen=True)
class EvalSet:
    """An eval set as this run read it: its files with their sha256, and the content hash over them."""

    spec: EvalSetSpec
    files: tuple[EvalFile, ...]
    sha256: str
    format: str

    def as_config(self) -> dict:
        return {"name": self.spec.name, "uri": self.spec.uri, "sha256": self.sha256}


def _format_of(spec: EvalSetSpec, name: str) -> str | None:
    if spec.format != "auto":
        return spec.format
    return EVAL_SUFFIXES.get(Path(name).suffix.lower())


def resolve_eval_sets(specs: Sequence[EvalSetSpec], storage: StorageSection | None) -> list[EvalSet]:
    """List and hash every eval set's files; a missing set or one without readable files is a
    ValueError naming the setting (raised before any Spark work)."""
    out = []
    for spec in specs:
        store, key = open_store(spec.uri, storage)
        head = store.head(key)
        infos = [head] if head is not None else [o for o in store.list(key.rstrip("/") + "/")]
        infos = [o for o in infos if _format_of(spec, o.key) is not None]
        if not infos:
            raise ValueError(f"filter.decontaminate: eval set {spec.name!r} at {spec.uri} has no .jsonl/.json/.parquet "
                             "files (or set its 'format')")
        formats = {_format_of(spec, o.key) for o in infos}
        if len(formats) > 1:
            raise ValueError(f"filter.decontaminate: eval set {spec.name!r} mixes formats {sorted(formats)}; "
                             "give one file or a directory of one format")
        files = []
        for o in infos:
            data = store.get_bytes(o.key)  # eval sets are small: hashed whole, once
            files.append(EvalFile(store.uri(o.key), len(data), hashlib.sha256(data).hexdigest()))
        digest = hashlib.sha256("\n".join(f"{uris.name(f.uri)} {f.sha256}" for f in files).encode()).hexdigest()
        out.append(EvalSet(spec, tuple(files), digest, formats.pop()))
    return out


def local_eval_files(es: EvalSet, download: Path, storage: StorageSection | None) -> list[str]:
    """file:// URIs Spark reads for `es`; remote files are copied under `download`, each checked
    against the sha256 this run recorded (a file that changed since is an error, not a silent mix)."""
    out = []
    for i, f in enumerate(es.files):
        store, key = open_store(f.uri, storage)
        if uris.is_local(f.uri):
            from pipeline_core.store import sha256_file

            if sha256_file(uris.to_local_path(f.uri)) != f.sha256:
                raise ValueError(f"eval set {es.spec.name!r}: {f.uri} changed while the filter ran")
            out.append(f.uri)
            continue
        dest = download / "eval" / es.spec.name / f"{i:05d}-{uris.name(f.uri)}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(key, dest, expected_sha256=f.sha256)
        out.append(uris.qualify(dest))
    return out


# ---------------------------------------------------------------- Spark


def _grams_udf(fn):
    from pyspark.sql.functions import pandas_udf

    @pandas_udf(GRAMS_SCHEMA)
    def grams(texts: pd.Series) -> pd.Series:
        return pd.Series([fn(t) for t in texts])

    return grams


def _doc_grams_udf(n: int, min_tokens: int):
    from pyspark.sql.functions import pandas_udf

    @pandas_udf(DOC_SCHEMA)
    def doc_grams(texts: pd.Series) -> pd.DataFrame:
        rows = [document_grams(list(t), n, min_tokens) for t in texts]
        return pd.DataFrame(rows, columns=["grams", "short_lens"])

    return doc_grams


def eval_documents(spark: SparkSession, es: EvalSet, paths: list[str], fcfg: FilterSection) -> DataFrame:
    """One row per eval document: `_set`, `_doc` (its id), `_grams` (hashes; empty when too short to
    match) and `_short_lens` (token counts of its texts shorter than n that are grams of their own)."""
    from pyspark.sql import functions as F

    spec = es.spec
    df = spark.read.parquet(*paths) if es.format == "parquet" else spark.read.json(list(paths))
    if "_corrupt_record" in df.columns:
        bad = df.filter(F.col("_corrupt_record").isNotNull()).count()
        if bad:
            raise ValueError(f"filter.decontaminate: eval set {spec.name!r} ({spec.uri}) has {bad} lines that are not "
                             "JSON objects")
    fields = [f for f in spec.fields if f in df.columns]
    if not fields:
        raise ValueError(f"filter.decontaminate: eval set {spec.name!r} ({spec.uri}) has none of the text fields "
                         f"{spec.fields} (its columns: {df.columns}); set 'fields'")
    if fcfg.decontaminate_answers:
        fields += [f for f in spec.answer_fields if f in df.columns and f not in fields]
    texts = F.array(*[F.col(f).cast("string") for f in fields])
    text_id = F.concat(F.lit("sha256:"), F.substring(F.sha2(F.concat_ws("\u0001", texts), 256), 1, 16))
    doc = F.col(spec.id_field).cast("string") if spec.id_field in df.columns else text_id
    g = _doc_grams_udf(fcfg.decontam_ngram, fcfg.decontam_min_tokens)(texts)
    return df.select(F.lit(spec.name).alias("_set"), F.coalesce(doc, text_id).alias("_doc"),
                     g["grams"].alias("_grams"), g["short_lens"].alias("_short_lens"))


def record_grams(messages_json: Column, fcfg: FilterSection, short_lengths: Sequence[int]) -> Column:
    """The distinct gram hashes of each training record's matched texts (`conversation_texts`)."""
    n, answers, lengths = fcfg.decontam_ngram, fcfg.decontaminate_answers, tuple(short_lengths)
    return _grams_udf(lambda m: gram_hashes(conversation_texts(m, answers), n, lengths))(messages_json)


def contaminated(rows: DataFrame, docs: DataFrame, fcfg: FilterSection, set_order: Sequence[str]) -> DataFrame:
    """(`_key`, `_set`, `_doc`, `_shared`, `_grams_n`) of the `rows` (`_key`, `_grams`) that an eval
    document in `docs` (`_set`, `_doc`, `_grams`) contaminates: one row per contaminated key."""
    from pyspark.sql import functions as F

    train = rows.select("_key", F.explode("_grams").alias("_h"))
    evals = (docs.withColumn("_grams_n", F.size("_grams"))
             .select("_set", "_doc", "_grams_n", F.explode("_grams").alias("_h")))
    order = F.array_position(F.array(*[F.lit(s) for s in set_order]), F.col("_set"))
    pairs = (train.join(evals, "_h")  # equi-join on the gram hash: no cartesian product
             .groupBy("_key", "_set", "_doc", "_grams_n").agg(F.count(F.lit(1)).alias("_shared"))
             .filter(F.col("_shared") / F.col("_grams_n") > fcfg.decontam_threshold))
    worst = pairs.groupBy("_key").agg(F.min(F.struct(
        (-F.col("_shared") / F.col("_grams_n")).alias("neg_share"), order.alias("order"),
        F.col("_doc"), F.col("_set"), F.col("_shared"), F.col("_grams_n"))).alias("_m"))
    return worst.select("_key", "_m._set", "_m._doc", "_m._shared", "_m._grams_n")


def reject_detail() -> Column:
    from pyspark.sql import functions as F

    return F.format_string("eval set %s, document %s: %d of its %d grams shared", F.col("_set"), F.col("_doc"),
                           F.col("_shared"), F.col("_grams_n"))


@dataclass
class Decontaminator:
    """The eval side, ready for `filter_rows.decisions`: every set's documents (one frame), the short
    documents' lengths, and what the manifest says about each set."""

    docs: DataFrame
    sets: list[EvalSet]
    short_lengths: tuple[int, ...]
    documents: dict[str, int]
    too_short: dict[str, int]

    def removed_per_set(self, marks: DataFrame) -> dict[str, int]:
        """{set: rows rejected as contaminated by it} from the contaminated frame (one row per set)."""
        from pyspark.sql import functions as F

        return {r["_set"]: int(r["n"]) for r in marks.groupBy("_set").agg(F.count(F.lit(1)).alias("n")).collect()}

    def report(self, removed: dict[str, int], fcfg: FilterSection) -> DecontamInfo:
        return DecontamInfo(ngram=fcfg.decontam_ngram, threshold=fcfg.decontam_threshold,
                            answers=fcfg.decontaminate_answers, eval_sets=tuple(EvalSetCount(
                                name=es.spec.name, uri=es.spec.uri, sha256=es.sha256, files=len(es.files),
                                documents=self.documents.get(es.spec.name, 0),
                                documents_too_short=self.too_short.get(es.spec.name, 0),
                                rows_removed=removed.get(es.spec.name, 0)) for es in self.sets))


def prepare(spark: SparkSession, sets: list[EvalSet], fcfg: FilterSection, download: Path,
            storage: StorageSection | None, persist) -> Decontaminator:
    """Read every eval set into one persisted frame of documents and their grams. What reaches the
    driver is small aggregates only: documents per set and the distinct lengths of short documents
    (fewer than decontam_ngram - decontam_min_tokens + 1 values), never the documents."""
    from functools import reduce

    from pyspark.sql import functions as F

    frames = [eval_documents(spark, es, local_eval_files(es, download, storage), fcfg) for es in sets]
    docs = persist(reduce(lambda a, b: a.unionByName(b), frames))
    stats = docs.groupBy("_set").agg(F.count(F.lit(1)).alias("n"),
                                     F.sum((F.size("_grams") == 0).cast("int")).alias("short")).collect()
    lengths = sorted(int(r[0]) for r in docs.select(F.explode("_short_lens")).distinct().collect())
    return Decontaminator(docs.filter(F.size("_grams") > 0).drop("_short_lens"), sets, tuple(lengths),
                          {r["_set"]: int(r["n"]) for r in stats}, {r["_set"]: int(r["short"] or 0) for r in stats})
