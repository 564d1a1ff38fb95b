"""Embedding throughput of the project's Encoder (the function enrich's UDF calls) vs plain
`SentenceTransformer.encode()`, same texts, same weights, same process. GPU or CPU.

    python bench/embed_bench.py --device cuda --texts 200000 --json OUT.json [--model DIR]
    .venv/bin/python bench/embed_bench.py --device cpu --texts 4000 --threads 1

Texts: a Nemotron-like mix, all unique (no dedup advantage): 80% context sentences (6-40 words),
12% questions (8-60 words), 8% answers (60-700 words; longer than MiniLM's 256-token window).
Baselines (plain `encode`, normalize_embeddings=True, its own length sorting): fp32 at its
default batch size 32 and at 128, and fp16 (`model.half()`) at 256 and 1024 on a GPU: the best a
skilled user gets from the library. Ours: `Encoder.encode_batches` over batches of `--call-texts`
texts (what an iterator UDF streams), truncate mode (the same work as plain encode) and chunk_mean
(long texts embedded whole, more work), for each tokenizer mode (process / thread), worker count
and batch token budget given; the first process variant is also timed phase by phase (tokenise
alone, device work alone on ready tokens, copy back). Checks ours against the fp32 baseline
(cosine per text) before reporting. Rates: texts/s over the timed region; GPU work synchronised
before the clock stops (results are host arrays).

Then the records mix (`make_records`, GPU only): enrich's batches of 512 records, questions asked
~7.5x (adjacent, as enrich sorts by question), long answers, context sentences; the same batches
for plain fp16 encode, plain fp16 encode of the distinct texts only (a user's own dedup: the
strongest plain baseline on this mix) and ours with its carry-over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

WORDS = ("the of and to in is that for it as with was on be by this are from at or an which have not but "
         "river mountain engine library theorem protein market signal harbor orbit lattice violin glacier "
         "compiler vaccine desert cathedral satellite enzyme ledger turbine archive meadow circuit volcano "
         "algorithm festival tunnel crystal museum function integral matrix derivative polynomial prime "
         "molecule reaction voltage gradient network database query server request thread memory cache").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        u = rng.random()
        k = rng.randint(6, 40) if u < 0.80 else rng.randint(8, 60) if u < 0.92 else rng.randint(60, 700)
        out.append(f"{i} " + " ".join(rng.choice(WORDS) for _ in range(k)) + ".")
    return out


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args) -> tuple[float, object]:
    sync()
    t = time.perf_counter()
    r = fn(*args)
    sync()
    return time.perf_counter() - t, r


def plain(model, texts: list[str], batch_size: int) -> np.ndarray:
    return model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                        show_progress_bar=False)


def ours(encoder, texts: list[str], call: int) -> np.ndarray:
    return np.concatenate([encoder.encode(texts[i : i + call]) for i in range(0, len(texts), call)])


def make_records(n_texts: int, seed: int = 1, repeats: float = 7.5, batch_records: int = 512) -> list[list[str]]:
    """Nemotron-like record batches as enrich's score UDF sees them (records sorted by question, so
    repeats are adjacent): per batch [questions, answers, context sentences]. A question is asked
    `repeats` times on average (math/stem), each time with a distinct answer (60-700 words, many past
    MiniLM's 256-token window) and 0-6 context sentences (6-40 words)."""
    rng = random.Random(seed)
    batches, total, q, left = [], 0, "", 0
    while total < n_texts:
        qs, ans, ctx = [], [], []
        for _ in range(batch_records):
            if left <= 0:
                q = f"q{total} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60))) + "?"
                left = max(1, round(rng.expovariate(1 / repeats)))
            left -= 1
            qs.append(q)
            ans.append(f"a{total} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 700))) + ".")
            for _ in range(rng.choice((0, 0, 0, 2, 4, 6))):
                ctx.append(f"c{total} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))) + ".")
            total += 1
        batch = qs + ans + ctx
        batches.append(batch)
        total += len(batch) - batch_records
    return batches


def phases(encoder, texts: list[str], workers: int) -> dict:
    """Where the time goes, each phase alone: tokenisation (one process; the worker pool), the device
    work on ready tokens (batch gather + forward + un-permute), the copy back."""
    from spark_jobs.enrich.embeddings import _encode_flat

    out = {}
    t = time.perf_counter()
    _encode_flat(encoder._tokenise._tok, texts[:20000])
    out["tokenise_1proc_texts_per_s"] = round(20000 / (time.perf_counter() - t))
    t = time.perf_counter()
    step = 512
    futs = [encoder._tokenise.submit(texts[i : i + step]) for i in range(0, len(texts), step)]
    parts = [f.result() for f in futs]
    out[f"tokenise_pool{workers}_texts_per_s"] = round(len(texts) / (time.perf_counter() - t))
    segs = []
    for k in range(0, len(parts), 16):  # windows of 16 tasks = 8,192 texts
        g = parts[k : k + 16]
        segs.append((encoder._chunk(np.concatenate([x[0] for x in g]), np.concatenate([x[1] for x in g])),
                     sum(len(x[1]) for x in g)))
    sync()
    t = time.perf_counter()
    res = [encoder._forward_window(s, n) for s, n in segs]
    sync()
    out["device_texts_per_s"] = round(len(texts) / (time.perf_counter() - t))
    t = time.perf_counter()
    for r in res:
        r.cpu()
    out["copy_back_s"] = round(time.perf_counter() - t, 3)
    tokens = sum(int(s.length.sum()) + len(s) * (len(encoder.prefix) + len(encoder.suffix)) for s, _ in segs)
    out["model_tokens"] = tokens
    out["rows"] = sum(len(s) for s, _ in segs)
    return out


def streamed(encoder, batches: list[list[str]]) -> np.ndarray:
    return np.concatenate(list(encoder.encode_batches(batches)))


def main(argv: list[str] | None = None) -> int:
    import copy

    import torch

    from spark_jobs.enrich.embeddings import EmbeddingSpec, Encoder, get_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--texts", type=int, default=200_000)
    ap.add_argument("--baseline-texts", type=int, default=0, help="texts for the (slower) baselines; 0 = all")
    ap.add_argument("--call-texts", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (CPU)")
    ap.add_argument("--workers", default="15", help="tokenizer workers of the variants, e.g. 8,15")
    ap.add_argument("--modes", default="process,thread")
    ap.add_argument("--batch-tokens", default="0")
    ap.add_argument("--batch-records", type=int, default=512, help="records mix: records per batch (enrich's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--all-rows", action="store_true", help="CPU: every GPU row too, tiny sizes (a dry run)")
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda") or a.all_rows
    if a.threads:
        torch.set_num_threads(a.threads)
    texts = make_texts(a.texts)
    base_texts = texts[: a.baseline_texts or len(texts)]
    res: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
                 "cpus": os.cpu_count(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                 "command": "bench/embed_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "texts": len(texts), "baseline_texts": len(base_texts), "call_texts": a.call_texts,
                 "mean_words": round(float(np.mean([t.count(" ") + 1 for t in texts])), 1)}

    def save():
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=2))

    m32 = get_model(a.model, a.threads, a.device)
    res["model_max_seq_length"] = m32.max_seq_length
    res["attn_implementation"] = getattr(m32[0].auto_model.config, "_attn_implementation", None)
    plain(m32, base_texts[:2048], 128)  # warm-up: kernels, allocator
    baselines = {}
    variants = [("fp32_bs32", m32, 32), ("fp32_bs128", m32, 128)]
    m16 = None
    if gpu:
        m16 = copy.deepcopy(m32).half() if a.device.startswith("cuda") else m32  # fp16 on a CPU: hours
        plain(m16, base_texts[:2048], 1024)
        variants += [("fp16_bs256", m16, 256), ("fp16_bs1024", m16, 1024)]
    ref = None
    for name, model, bs in variants:
        dt, vecs = timed(plain, model, base_texts, bs)
        baselines[name] = round(len(base_texts) / dt, 1)
        if name == "fp32_bs128":
            ref = vecs
        print(f"plain {name}: {baselines[name]:,.0f} texts/s", flush=True)
    res["plain_texts_per_s"] = baselines
    best_plain_name = max(baselines, key=baselines.get)
    best_plain = baselines[best_plain_name]
    save()

    calls = [texts[i : i + a.call_texts] for i in range(0, len(texts), a.call_texts)]
    runs, profile, settings = {}, {}, {}
    precisions = ["fp16"] if a.device.startswith("cuda") else ["fp32"]
    grid = [(m, int(w), int(bt)) for m in a.modes.split(",") for w in a.workers.split(",")
            for bt in a.batch_tokens.split(",")] if gpu else [("thread", 1, 0)]
    for long_text in ("truncate", "chunk_mean"):
        for precision in precisions:
            for mode, workers, bt in grid:
                if long_text == "chunk_mean" and (mode, workers, bt) != grid[0]:
                    continue
                spec = EmbeddingSpec(model=a.model, device=a.device, precision=precision, long_text=long_text,
                                     tokenizer_threads=workers, tokenizer_mode=mode, threads=a.threads,
                                     batch_tokens=bt, max_batch_rows=4096 if gpu else 64, carry_texts=0)
                enc = Encoder(spec)
                streamed(enc, [texts[:4096], texts[4096:8192]])  # warm-up (and worker start)
                dt, vecs = timed(streamed, enc, calls)
                name = f"{long_text}_{precision}_{mode}{workers}_bt{bt or enc.batch_tokens}"
                r = {"texts_per_s": round(len(texts) / dt, 1), "seconds": round(dt, 3)}
                if long_text == "truncate":
                    cos = np.einsum("ij,ij->i", vecs[: len(ref)], ref)
                    r["min_cos_vs_plain_fp32"] = round(float(cos.min()), 5)
                    assert cos.min() > 0.99, (name, float(cos.min()))
                r["x_best_plain"] = round(r["texts_per_s"] / best_plain, 2)
                runs[name] = r
                settings[name] = (mode, workers, bt)
                print(f"ours {name}: {r}", flush=True)
                if gpu and long_text == "truncate" and name not in profile and mode == "process":
                    profile[name] = phases(enc, texts, workers)
                    print(f"phases {name}: {profile[name]}", flush=True)
                enc.close()
                res["ours"], res["phases"] = runs, profile
                save()
    best = max((kv for kv in runs.items() if kv[0].startswith("truncate")), key=lambda kv: kv[1]["texts_per_s"])

    if gpu:  # the records mix: questions repeated ~7.5x, long answers; the same batches for everyone
        batches = make_records(a.texts, batch_records=a.batch_records)
        flat = [t for b in batches for t in b]
        n_uniq = len(set(flat))
        rec = {"texts": len(flat), "distinct": n_uniq, "batches": len(batches),
               "mean_words": round(float(np.mean([t.count(" ") + 1 for t in flat])), 1)}
        sub = flat[: a.baseline_texts or len(flat)]
        dt, _ = timed(plain, m16, sub, 1024)
        rec["plain_fp16_bs1024_texts_per_s"] = round(len(sub) / dt, 1)

        def plain_dedup(model, ts):  # a skilled user's own dedup: distinct texts only, then scatter back
            index: dict[str, int] = {}
            pos = np.fromiter((index.setdefault(t, len(index)) for t in ts), dtype=np.int64, count=len(ts))
            return plain(model, list(index), 1024)[pos]

        dt, _ = timed(plain_dedup, m16, sub)
        rec["plain_fp16_bs1024_dedup_texts_per_s"] = round(len(sub) / dt, 1)
        mode, workers, bt = settings[best[0]]
        rec["ours_settings"] = best[0]
        for lt in ("truncate", "chunk_mean"):
            spec = EmbeddingSpec(model=a.model, device=a.device, precision=precisions[0], long_text=lt,
                                 tokenizer_threads=workers, tokenizer_mode=mode, batch_tokens=bt,
                                 carry_texts=4096, max_batch_rows=4096)
            enc = Encoder(spec)
            streamed(enc, batches[:2])
            enc._carry.clear()
            dt, _ = timed(streamed, enc, batches)
            rec[f"ours_{lt}_texts_per_s"] = round(len(flat) / dt, 1)
            enc.close()
        strongest = max(rec["plain_fp16_bs1024_texts_per_s"], rec["plain_fp16_bs1024_dedup_texts_per_s"])
        rec["x_strongest_plain_truncate"] = round(rec["ours_truncate_texts_per_s"] / strongest, 2)
        rec["x_plain_no_dedup_truncate"] = round(rec["ours_truncate_texts_per_s"] / rec["plain_fp16_bs1024_texts_per_s"], 2)
        res["records_mix"] = rec
        print(f"records mix: {rec}", flush=True)
    res["summary"] = {"best_plain": best_plain, "best_plain_variant": best_plain_name,
                      "ours_best_truncate": best[0], "ours_texts_per_s": best[1]["texts_per_s"],
                      "ratio_vs_best_plain": best[1]["x_best_plain"], "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
    print(json.dumps(res["summary"], indent=2))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
