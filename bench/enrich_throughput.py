"""Embedding throughput through the whole enrich Spark job vs plain SentenceTransformer.encode.

    .venv/bin/python bench/enrich_throughput.py [--records 1000] [--sentences 10] [--master local[2]]

One run, the same texts for both: N Nemotron-schema records whose system prompts hold S unique
sentences each (plus a unique question and answer), so nothing is deduplicated away.
  plain: one process, the model loaded once, `encode(all texts, batch_size, normalize_embeddings)`,
         timed with torch on every core (its default) and on one thread; the faster counts;
  job:   `spark_jobs.enrich.job.run` on the same records (local[2]: two Python workers, one torch
         thread each), twice in one Spark application: cold (worker start, torch import and model
         load fall inside the step) and warm (workers and model reused); throughput of its
         embed+score+write step (scoring and the Parquet write included) and of the whole job.
Prints the rates and the ratios job/plain; the issue's target is >= 0.9 on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = ("river mountain engine library theorem protein market signal harbor orbit lattice violin glacier "
         "compiler vaccine desert cathedral satellite enzyme ledger turbine archive meadow circuit volcano "
         "algorithm festival tunnel crystal museum").split()
VERBS = "measures describes protects connects improves reveals supports changes".split()


def sentence(rng: random.Random, i: int) -> str:
    a, b, c = rng.sample(WORDS, 3)
    return f"The {a} {rng.choice(VERBS)} the {b} near the {c} in case {i}."


def make_records(n: int, s: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out, k = [], 0
    for i in range(n):
        ctx = []
        for _ in range(s):
            ctx.append(sentence(rng, k))
            k += 1
        q = f"What does the {rng.choice(WORDS)} do in case {k}?"
        a = f"In case {k + 1} the {rng.choice(WORDS)} {rng.choice(VERBS)} the {rng.choice(WORDS)}."
        k += 2
        out.append({
            "uuid": f"bench-{i:07d}", "license": "cc-by-4.0", "generator": "bench", "version": "v1",
            "category": "chat", "reasoning": "off", "metadata": "{}",
            "messages": [{"role": "system", "content": " ".join(ctx), "tool_calls": None},
                         {"role": "user", "content": q, "tool_calls": None},
                         {"role": "assistant", "content": a, "tool_calls": None}],
        })
    return out


def texts_of(records: list[dict]) -> list[str]:
    from spark_jobs.conversations.sentences import split_sentences

    texts = []
    for r in records:
        texts += split_sentences(r["messages"][0]["content"])
        texts += [r["messages"][1]["content"], r["messages"][2]["content"]]
    return texts


def plain(texts: list[str], model: str, batch_size: int, threads: int) -> float:
    import torch

    from spark_jobs.enrich.embeddings import get_model

    m = get_model(model)
    torch.set_num_threads(threads)
    m.encode(texts[:batch_size], batch_size=batch_size, normalize_embeddings=True)  # warm-up
    t = time.perf_counter()
    m.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--sentences", type=int, default=10)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline_core import uris
    from pipeline_core.config import load_config
    from samples import nemotron_v1
    from spark_jobs.common import spark_session
    from spark_jobs.enrich import job as enrich

    load0 = round(os.getloadavg()[0], 2)
    records = make_records(a.records, a.sentences)
    texts = texts_of(records)
    assert len(set(texts)) == len(texts), "bench texts must be unique"
    with tempfile.TemporaryDirectory(prefix="bench-enrich-") as tmp:
        src = Path(tmp) / "src" / "data"
        src.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(records, schema=nemotron_v1.arrow_schema()), src / "chat-00000-of-00001.parquet")
        cfg = load_config(env={}, overrides={
            "pipeline.staging_uri": uris.qualify(Path(tmp) / "staging"),
            "enrich": {"spark_master": a.master, "shuffle_partitions": a.partitions, "splits": ["chat"],
                       "embedding_batch_size": a.batch_size, "spark_conf": {"spark.ui.enabled": "false"}},
        })
        # The baseline at its best: torch's default (all cores) and one thread, whichever is faster
        # (on a busy machine one thread often wins).
        t_plain_all = plain(texts, cfg.enrich.embedding_model, a.batch_size, os.cpu_count() or 1)
        t_plain_one = plain(texts, cfg.enrich.embedding_model, a.batch_size, 1)
        t_plain = min(t_plain_all, t_plain_one)
        # The job twice in one Spark application: cold (Python workers start, import torch and load
        # the model inside the embed step) and warm (workers reused with the model cached, as on a
        # long job where that start-up is amortised). Different outputs, so neither run is skipped.
        e = cfg.enrich
        spark = spark_session("bench-enrich", e.spark_master, e.shuffle_partitions,
                              {"spark.sql.execution.arrow.maxRecordsPerBatch": str(e.arrow_batch_rows), **e.spark_conf})
        runs = []
        try:
            for name in ("cold", "warm"):
                t0 = time.perf_counter()
                m = enrich.run(uris.qualify(src.parent), uris.qualify(Path(tmp) / f"out-{name}"), cfg, spark=spark)
                runs.append((name, time.perf_counter() - t0, m))
        finally:
            spark.stop()
    res = {
        "records": a.records, "texts": len(texts), "master": a.master, "cpus": os.cpu_count(),
        "load_avg_1m_at_start": load0, "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "plain_sentences_per_s": round(len(texts) / t_plain, 1),
        "plain_all_cores_sentences_per_s": round(len(texts) / t_plain_all, 1),
        "plain_one_thread_sentences_per_s": round(len(texts) / t_plain_one, 1),
    }
    for name, t_job, m in runs:
        assert m.extra["stats"]["texts_embedded"] == len(texts), (m.extra["stats"], len(texts))
        t_embed = m.timings["embed+score+write_s"]
        res[name] = {
            "embed_step_sentences_per_s": round(len(texts) / t_embed, 1),
            "embed_step_records_per_s": round(a.records / t_embed, 1),
            "whole_job_sentences_per_s": round(len(texts) / t_job, 1),
            "whole_job_records_per_s": round(a.records / t_job, 1),
            "ratio_embed_step_vs_plain": round(t_plain / t_embed, 3),
            "ratio_whole_job_vs_plain": round(t_plain / t_job, 3),
            "timings": m.timings,
        }
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
