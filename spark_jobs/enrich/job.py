"""enrich: raw Nemotron records -> question, answer, context sentences, similarities, relevant context.

    spark-submit spark_jobs/enrich/job.py --input URI --output URI [--config FILE]

DESIGN.md "enrich" and "Contracts". Spark writes the artifact to a local staging directory
(fully qualified file:// URI), then the stage publishes it to `--output` (file:// or s3://)
through `pipeline_core.artifacts`: data files first, `_manifest.json` last. A run whose output is
already committed with the same config does nothing. Every record ends up either in `data/` or
in `rejects/` with a reason: in = out + rejected.

Output columns beyond the contract: `question_embedding`, `answer_embedding` (array<float>, unit
vectors; the filter stage deduplicates with them), `metadata` (the record's own, e.g. tool
definitions, `train_turns`) and the record's provenance (`license`, `generator`, `used_in`,
`seed_dataset`, `source_split`); the manifest lists them under `extra.extra_columns`.

Every record first becomes the family's one shape (`family.from_record`: SFT-collection JSONL,
v1/v2 Parquet, code-reasoning rows); withheld prompts are re-joined from `enrich.prompt_sources`
(`prompt_sources`, a Spark join), and the manifest's `extra.prompt_sources` counts restored /
unrestorable rows per source with each source's URI and file hashes.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd  # module level: pandas_udf resolves its type hints in this module

# `spark-submit spark_jobs/enrich/job.py` puts spark_jobs/enrich/ itself on sys.path, not the project root;
# the project is normally installed (pip install -e . / the image), this covers a bare checkout.
if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline_core import uris
from pipeline_core.artifacts import Manifest
from pipeline_core.config import Config, EnrichSection, load_config
from pipeline_core.handoffs import EnrichedInfo, PromptSourceOutcome, StageCounts
from pipeline_core.names import Stage
from spark_jobs.common import (
    StageContext,
    StageOutput,
    StageSpec,
    artifact_counts,
    download_dir,
    parse_stage_args,
    rejects_frame,
    run_stage,
    setup_logging,
    task_cpus,
    write_parquet,
)
from spark_jobs.conversations import family
from spark_jobs.conversations.conversation import BAD_TRAIN_TURNS, train_turns
from spark_jobs.conversations.normalize import Rejected, normalise
from spark_jobs.enrich import prompt_sources
from spark_jobs.enrich.readers import MESSAGES_DDL, SPLIT_COLUMN, read_records
from spark_jobs.enrich.scoring import ScoringParams, score_record
from spark_jobs.partitioning import ENRICH_ROWS_PER_PARTITION, stage_partitions
from spark_jobs.preference import PAIR_COLUMNS, with_preference_columns, with_rejected_similarity

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("spark_jobs.enrich.job")

STAGE = Stage.ENRICH
KIND = "enriched"
SPEC = StageSpec(STAGE, KIND, "mft-enrich")
NORMALISED_SCHEMA = (
    "question string, answer string, reasoning_trace string, context_sentences array<string>, "
    "context_turns array<int>, reason string, detail string, messages_json string, restore_status string"
)
FAMILY_SCHEMA = (
    "id string, messages_json string, metadata string, reasoning string, license string, generator string, "
    "used_in array<string>, seed_dataset string, restore_source string, restore_recipe string, restore_key string"
)
# enriched's `messages`: v1's message type + the SFT collection's reasoning_content
ENRICHED_MESSAGES_DDL = MESSAGES_DDL.replace("role:string,content:string,", "role:string,content:string,reasoning_content:string,")
PROVENANCE_COLUMNS = ("license", "generator", "used_in", "seed_dataset", "source_split")
SCORES_SCHEMA = (
    "sim_context_question double, sim_context_answer double, sim_question_answer double, "
    "relevant_sentences array<struct<text:string,index:int,score:double>>, "
    "context_question_scores array<double>, question_embedding array<float>, answer_embedding array<float>"
)
CONTRACT_COLUMNS = (
    "id", "category", "reasoning", "question", "answer", "reasoning_trace", "context_sentences",
    "relevant_sentences", "sim_context_question", "sim_context_answer", "sim_question_answer", "messages",
)
EXTRA_COLUMNS = ("question_embedding", "answer_embedding", "metadata", "context_turns", "context_question_scores",
                 *PROVENANCE_COLUMNS)


def family_row(uuid: str | None, raw: str | None, read_error: str | None, reasoning: str | None) -> dict[str, Any]:
    """One raw row -> the family's one shape (FAMILY_SCHEMA columns); never raises."""
    out: dict[str, Any] = {"id": uuid, "messages_json": None, "metadata": None, "reasoning": reasoning, "license": None,
                           "generator": None, "used_in": [], "seed_dataset": None, "restore_source": None,
                           "restore_recipe": None, "restore_key": None}
    if read_error or raw is None:
        return out
    try:
        rec = json.loads(raw)
        if not isinstance(rec, dict):
            return out
        f = family.from_record(rec)
        messages_json = json.dumps(f.messages, ensure_ascii=False) if f.messages is not None else None
    except (ValueError, RecursionError):
        return out
    out.update(id=f.id, messages_json=messages_json, metadata=f.metadata, license=f.license, generator=f.generator,
               used_in=f.used_in, seed_dataset=f.seed_dataset)
    if reasoning is None:  # the SFT collection: reasoning is "on" where an answer carries reasoning_content
        out["reasoning"] = "on" if any(isinstance(m, dict) and m.get("reasoning_content") for m in f.messages or ()) else None
    if f.restore is not None:
        out.update(restore_source=f.restore.source, restore_recipe=f.restore.recipe, restore_key=f.restore.key)
    return out


def family_udf():
    from pyspark.sql.functions import pandas_udf

    cols = [c.split(" ")[0] for c in FAMILY_SCHEMA.split(", ")]

    @pandas_udf(FAMILY_SCHEMA)
    def _family(uuid: pd.Series, raw: pd.Series, read_error: pd.Series, reasoning: pd.Series) -> pd.DataFrame:
        return pd.DataFrame([family_row(u, x, r, rs) for u, x, r, rs in zip(uuid, raw, read_error, reasoning, strict=True)],
                            columns=cols)

    return _family


def _restore(messages: list[Any], e: EnrichSection, source: str, recipe: str | None, key: str | None,
             prompt: str | None, system: str | None) -> list[Any]:
    """The withheld prompt filled from its seed, or `Rejected` naming the config key / the key."""
    if source not in e.prompt_sources:
        raise Rejected(prompt_sources.SOURCE_MISSING,
                       f"the prompt is withheld and its seed dataset {source!r} has no copy configured: set "
                       f"enrich.prompt_sources[{source!r}] to the URI of your copy")
    if not key or prompt is None:
        raise Rejected(prompt_sources.NOT_FOUND, f"{recipe} key {key!r} is not in {source} "
                       f"({e.prompt_sources[source]})" if key else f"the record names {source} but no key into it")
    return family.restore_messages(messages, prompt, system)


def normalise_raw(uuid: str | None, messages_json: str | None, read_error: str | None, e: EnrichSection,
                  metadata: str | None = None, restore: tuple | None = None) -> dict[str, Any]:
    """One raw row -> the normalised columns, or `reason` (and `detail`) set (never raises).
    `restore`: (source, recipe, key, seed prompt, seed system) of a withheld row."""
    empty = {"question": None, "answer": None, "reasoning_trace": None, "context_sentences": None, "context_turns": None,
             "detail": None, "messages_json": messages_json, "restore_status": None}
    if read_error:
        return {**empty, "reason": read_error.split(":", 1)[0]}
    if uuid is None or not str(uuid).strip():
        return {**empty, "reason": "missing_id"}
    status = None
    try:
        messages = json.loads(messages_json) if messages_json is not None else None
        if messages is not None and not isinstance(messages, list):
            raise Rejected("bad_message", f"messages is a {type(messages).__name__}, not a list")
        if restore is not None and restore[0] is not None and messages:
            try:
                messages = _restore(messages, e, *restore)
            except Rejected as r:
                status = r.reason
                raise
            status = prompt_sources.RESTORED
            messages_json = json.dumps(messages, ensure_ascii=False)
        flags = train_turns(metadata)
        if flags is not None and messages is not None and len(flags) != len(messages):
            raise Rejected(BAD_TRAIN_TURNS, f"metadata.train_turns has {len(flags)} entries for {len(messages)} messages")
        n = normalise(messages, reasoning=e.reasoning, max_context_sentences=e.max_context_sentences,
                      max_sentence_chars=e.max_sentence_chars)
    except Rejected as r:
        return {**empty, "reason": r.reason, "detail": r.detail or None, "restore_status": status}
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
        return {**empty, "reason": "unparseable_messages"}
    return {"question": n.question, "answer": n.answer, "reasoning_trace": n.reasoning_trace,
            "context_sentences": n.context_sentences, "context_turns": n.context_turns, "reason": None,
            "detail": None, "messages_json": messages_json, "restore_status": status}


def normalise_udf(e: EnrichSection):
    from pyspark.sql.functions import pandas_udf

    cols = [c.split(" ")[0] for c in NORMALISED_SCHEMA.split(", ")]

    @pandas_udf(NORMALISED_SCHEMA)
    def _normalise(uuid: pd.Series, messages_json: pd.Series, read_error: pd.Series, metadata: pd.Series,
                   source: pd.Series, recipe: pd.Series, key: pd.Series, prompt: pd.Series,
                   system: pd.Series) -> pd.DataFrame:
        rows = [normalise_raw(u, m, r, e, md, (s, rc, k, p, sy))
                for u, m, r, md, s, rc, k, p, sy in zip(uuid, messages_json, read_error, metadata, source, recipe, key,
                                                         prompt, system, strict=True)]
        return pd.DataFrame(rows, columns=cols)

    return _normalise


def score_batch(questions: Sequence[str], answers: Sequence[str], contexts: Sequence[Sequence[str]],
                e: EnrichSection, threads: int) -> list[dict[str, Any]]:
    """Embed a batch's questions, answers and context sentences in one batched encode, then score."""
    return next(score_batches(iter([(questions, answers, contexts)]), e, threads))


def score_batches(batches: Iterator[tuple[Sequence[str], Sequence[str], Sequence[Sequence[str]]]],
                  e: EnrichSection, threads: int) -> Iterator[list[dict[str, Any]]]:
    """score_batch of each (questions, answers, contexts) batch, in order, through the Encoder's
    stream: the next batch is tokenised while the device embeds this one."""
    from spark_jobs.enrich.embeddings import get_encoder, spec_for

    pending: deque[tuple[int, list[list[str]]]] = deque()

    def texts() -> Iterator[list[str]]:
        for questions, answers, contexts in batches:
            ctx = [list(c) if c is not None else [] for c in contexts]
            pending.append((len(questions), ctx))
            yield [*questions, *answers, *(s for c in ctx for s in c)]

    params = ScoringParams(e.top_k, e.relevance_threshold, e.question_weight, e.answer_weight)
    for vecs in get_encoder(spec_for(e, threads)).encode_batches(texts()):
        n, contexts = pending.popleft()
        yield _score_rows(vecs, n, contexts, params)


def _score_rows(vecs, n: int, contexts: list[list[str]], params: ScoringParams) -> list[dict[str, Any]]:
    rows, off = [], 2 * n
    for i, ctx in enumerate(contexts):
        q, a, s = vecs[i], vecs[n + i], vecs[off : off + len(ctx)]
        off += len(ctx)
        r = score_record(q, a, s, params)
        r["relevant_sentences"] = [{"text": ctx[j], "index": j, "score": sc} for j, sc in r["relevant_sentences"]]
        r["context_question_scores"] = [float(x) for x in (s @ q)] if len(ctx) else []
        r["question_embedding"], r["answer_embedding"] = q.tolist(), a.tolist()
        rows.append(r)
    return rows


def score_udf(e: EnrichSection, threads: int):
    from pyspark.sql.functions import pandas_udf

    cols = ["sim_context_question", "sim_context_answer", "sim_question_answer", "relevant_sentences",
            "context_question_scores", "question_embedding", "answer_embedding"]

    @pandas_udf(SCORES_SCHEMA)
    def _score(batches: Iterator[tuple[pd.Series, pd.Series, pd.Series]]) -> Iterator[pd.DataFrame]:
        lists = ((q.tolist(), a.tolist(), c.tolist()) for q, a, c in batches)
        for rows in score_batches(lists, e, threads):
            yield pd.DataFrame(rows, columns=cols)

    return _score


def stage_config(cfg: Config, input_uri: str) -> dict[str, Any]:
    """What determines the artifact's content: recorded in (and hashed into) the manifest."""
    return {"stage": STAGE, "input": input_uri, "enrich": cfg.enrich.content_settings()}


def run(input_uri: str, output_uri: str, cfg: Config, spark: SparkSession | None = None) -> Manifest:
    output_uri = uris.require_uri(output_uri, "--output").rstrip("/")
    if not input_uri.startswith("hf://"):
        input_uri = uris.require_uri(input_uri, "--input").rstrip("/")
    m = run_stage(SPEC, cfg, cfg.enrich, output_uri, stage_config(cfg, input_uri),
                  lambda ctx: _compute(ctx, input_uri, cfg), spark=spark)
    total = (m.timings or {}).get("total_s")
    if total:
        log.info("[enrich] %.1f records/s overall", StageCounts.from_manifest(m).rows_in / max(total, 1e-9))
    return m


def _compute(ctx: StageContext, input_uri: str, cfg: Config) -> StageOutput:
    from pyspark.sql import functions as F

    e, spark, timer, staging, staging_uri = cfg.enrich, ctx.spark, ctx.timer, ctx.staging, ctx.staging_uri
    pairs = e.objective == "dpo"
    with timer.step("read+normalise") as info:
        raw, source = read_records(spark, input_uri, e.splits, e.input_format, download_dir=download_dir(staging),
                                   storage=cfg.storage, accept_corrupt_file_loss=e.accept_corrupt_file_loss,
                                   require_messages=not pairs)
        if pairs:  # preference records: prompt + chosen as the conversation, the rejected answer beside it
            none = F.lit(None).cast("string")
            joined = with_preference_columns(raw).select(
                F.col("uuid").alias("id"), "category", "reasoning", "metadata", "messages_json", "raw", "read_error",
                SPLIT_COLUMN, *PAIR_COLUMNS, none.alias("license"), none.alias("generator"),
                F.array().cast("array<string>").alias("used_in"), none.alias("seed_dataset"),
                *[none.alias(c) for c in ("restore_source", "restore_recipe", "restore_key", "seed_prompt", "seed_system")])
            source_infos: dict = {}
        else:  # the Nemotron family's shapes, withheld prompts re-joined from the configured seed copies
            fam = raw.select(
                "category", "raw", "read_error", SPLIT_COLUMN,
                family_udf()("uuid", "raw", "read_error", "reasoning").alias("f"),
            ).select("*", "f.*").drop("f")
            seed_rows, source_infos = prompt_sources.seeds(spark, e.prompt_sources, staging, cfg.storage)
            joined = prompt_sources.join_seeds(fam, seed_rows)
        normalised = joined.select(
            "id", "category", "reasoning", "metadata", "raw", "restore_source", SPLIT_COLUMN,
            "license", "generator", "used_in", "seed_dataset", F.col(SPLIT_COLUMN).alias("source_split"),
            *PAIR_COLUMNS * pairs,
            normalise_udf(e)("id", "messages_json", "read_error", "metadata", "restore_source", "restore_recipe",
                             "restore_key", "seed_prompt", "seed_system").alias("n"),
        ).select("*", "n.*").drop("n")
        # A reject's raw: the record; a restoration reject's also says which source / key was missing.
        raw_out = F.when(F.col("reason").isin(prompt_sources.SOURCE_MISSING, prompt_sources.NOT_FOUND),
                         F.to_json(F.struct(F.col("detail"), F.col("raw").alias("record"))))
        # Lean persisted frame: the record's JSON (`raw`) only where it is a reject, the messages only
        # where they are kept (the output carries them).
        norm = ctx.persist(normalised.select(
            *[c for c in normalised.columns if c not in ("raw", "messages_json", "detail")],
            F.when(F.col("reason").isNull(), F.col("messages_json")).alias("messages_json"),
            F.when(F.col("reason").isNotNull(), F.coalesce(raw_out, F.col("raw"))).alias("raw"),
        ))
        stats = norm.agg(
            F.count(F.lit(1)).alias("rows"),
            F.sum(F.when(F.col("reason").isNull(), F.size("context_sentences")).otherwise(0)).alias("sentences"),
            F.sum(F.when(F.col("reason").isNull(), 1).otherwise(0)).alias("accepted"),
        ).first()
        n_in, n_sent, n_ok = int(stats["rows"]), int(stats["sentences"] or 0), int(stats["accepted"])
        info["rows"] = n_in
        per_split = split_counts(norm.groupBy(SPLIT_COLUMN, "reason").count().collect())
        restore_counts = norm.where(F.col("restore_source").isNotNull()).groupBy(
            "restore_source", F.coalesce("restore_status", "reason").alias("s")).count().collect()
        per_license = {(r[0] if r[0] is not None else ""): int(r[1]) for r in
                       norm.where(F.col("reason").isNull()).groupBy("license").count().collect()}

    with timer.step("write rejects") as info:
        write_parquet(rejects_frame(norm.where(F.col("reason").isNotNull()), STAGE), uris.join(staging_uri, "rejects"))
        info["rows"] = n_in - n_ok

    threads = e.embedding_threads or task_cpus(spark)
    with timer.step("embed+score+write") as info:
        # Partitions from the row count and Spark's task slots; by question, sorted, so a question's
        # repeats share an Arrow batch and are embedded once (embeddings.Encoder).
        parts = stage_partitions(spark, e.shuffle_partitions, n_ok, ENRICH_ROWS_PER_PARTITION)
        accepted = (
            norm.where(F.col("reason").isNull()).drop("raw", "reason")
            # a question's repeats (~7.5 answers each in math/stem) share a batch: embedded once
            .repartition(parts, F.xxhash64("question"))
            .sortWithinPartitions(F.xxhash64("question"), "id")
        )
        scored = accepted.select("*", score_udf(e, threads)("question", "answer", "context_sentences").alias("s"))
        out = scored.select(
            *[c for c in CONTRACT_COLUMNS[:7]], "s.relevant_sentences", "s.sim_context_question",
            "s.sim_context_answer", "s.sim_question_answer",
            F.from_json("messages_json", ENRICHED_MESSAGES_DDL).alias("messages"),
            "s.question_embedding", "s.answer_embedding", "metadata", "context_turns", "s.context_question_scores",
            *PROVENANCE_COLUMNS, *PAIR_COLUMNS * pairs,
        )
        if pairs:  # prompt<->rejected similarity (an annotation; the filter gates on prompt<->chosen)
            out = with_rejected_similarity(out, e, threads)
        write_parquet(out, uris.join(staging_uri, "data"))
        info["rows"] = n_ok
        info["sentences"] = n_sent + 2 * n_ok  # texts embedded: context sentences + question + answer

    counts = artifact_counts(n_in, staging)
    lost = [v["expected"] - v["read"] for v in (source.get("corrupt_files") or {}).values() if v["expected"] is not None]
    if source.get("corrupt_files"):  # accepted (read_records refuses otherwise): in = out + rejected still holds
        counts = counts.plus_rejected("corrupt_input_file", sum(lost))
    extra = {
        "schema": "enriched",
        "columns": [*CONTRACT_COLUMNS, *EXTRA_COLUMNS, *((*PAIR_COLUMNS, "sim_question_rejected") if pairs else ())],
        "extra_columns": {"question_embedding": "array<float> unit vector of the question",
                          "answer_embedding": "array<float> unit vector of the answer",
                          "metadata": "the input record's metadata string",
                          "context_turns": "array<int>: index in messages of each context_sentences unit",
                          "context_question_scores": "array<double>: cosine of each context unit to the question",
                          "license": "the record's license", "generator": "the model that wrote the answers",
                          "used_in": "array<string>: the models the record was used to train",
                          "seed_dataset": "the seed dataset of a withheld prompt (hub id)",
                          "source_split": "the input split (file name) the record came from"},
        "embedding_model": e.embedding_model,
        "embedding_dim": _embedding_dim(staging),
        "source": source,
        "stats": {"context_sentences": n_sent, "texts_embedded": n_sent + 2 * n_ok},
        "licenses": dict(sorted(per_license.items())),
        **EnrichedInfo(objective=e.objective, splits=per_split, prompt_sources=prompt_source_counts(restore_counts, source_infos)).to_extra(),
    }
    log.info("[enrich] %d records in, %d out, %d rejected %s", counts.rows_in, counts.rows_out,
             counts.rejected_total, counts.rejected)
    return StageOutput(counts, extra)


def split_counts(rows) -> dict[str, StageCounts]:
    """Counts per input split from (split, reason, count) rows (reason null: accepted); records of
    files not named by split count under "" ."""
    out: dict[str, StageCounts] = {}
    for split, reason, n in sorted(((r[0] or "", r[1], int(r[2])) for r in rows), key=lambda r: (r[0], r[1] or "")):
        c = out.setdefault(split, StageCounts(rows_in=0, rows_out=0))
        out[split] = (c.plus_rejected(reason, n) if reason is not None
                      else StageCounts(rows_in=c.rows_in + n, rows_out=c.rows_out + n, rejected=c.rejected))
    return out


def prompt_source_counts(rows, infos: dict[str, prompt_sources.SourceInfo]) -> dict[str, PromptSourceOutcome]:
    """Per seed dataset named by a withheld row: restored / unrestorable (by reason), and for a
    configured source its URI and files (size, sha256)."""
    by_source: dict[str, dict[str, int]] = {}
    for source, status, n in rows:
        by_source.setdefault(source, {})[status] = int(n)
    out = {}
    for source in sorted(set(by_source) | set(infos)):
        counts = by_source.get(source, {})
        if source in infos:
            out[source] = infos[source].as_manifest(counts)
        else:
            out[source] = PromptSourceOutcome(uri=None, config_key=f"enrich.prompt_sources[{source!r}]", restored=0,
                                              unrestorable=sum(counts.values()), outcomes=dict(sorted(counts.items())))
    return out


def _embedding_dim(staging) -> int | None:
    import pyarrow.parquet as pq

    for p in sorted((staging / "data").rglob("*.parquet")):
        col = pq.read_table(p, columns=["question_embedding"]).column(0)
        if len(col):
            return len(col[0].as_py())
    return None


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    args = parse_stage_args(__doc__.strip().splitlines()[0], argv)
    cfg = load_config(args.config)  # invalid settings fail here, before Spark starts
    run(args.input, args.output, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
