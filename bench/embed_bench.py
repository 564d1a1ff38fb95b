"""Embedding throughput of the project's Encoder (the function enrich's UDF calls) vs plain
`SentenceTransformer.encode()`, same texts, same weights, same process. GPU or CPU.

    python bench/embed_bench.py --device cuda --texts 200000 --json OUT.json [--model DIR]
    .venv/bin/python bench/embed_bench.py --device cpu --texts 4000 --threads 1

Texts: a Nemotron-like mix, all unique (no dedup advantage): 80% context sentences (6-40 words),
12% questions (8-60 words), 8% answers (60-700 words; longer than MiniLM's 256-token window).
Baselines (plain `encode`, normalize_embeddings=True, its own length sorting): fp32 at its
default batch size 32 and at 128, and fp16 (`model.half()`) at 128 and 1024 on a GPU: the best a
skilled user gets from the library. Ours: `Encoder.encode` in calls of `--call-texts` texts (the
size of one Arrow batch's texts), truncate mode (the same work as plain encode) and chunk_mean
(long texts embedded whole, more work), with several tokenizer-thread counts. Checks ours against
the fp32 baseline (cosine per text) before reporting. Rates: texts/s over the timed region;
GPU work synchronised before the clock stops (the encode call returns host arrays).
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


def timed(fn, *args) -> tuple[float, object]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t, r


def plain(model, texts: list[str], batch_size: int) -> np.ndarray:
    return model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                        show_progress_bar=False)


def ours(encoder, texts: list[str], call: int) -> np.ndarray:
    return np.concatenate([encoder.encode(texts[i : i + call]) for i in range(0, len(texts), call)])


def main(argv: list[str] | None = None) -> int:
    import copy

    import torch

    from spark_jobs.embeddings import EmbeddingSpec, Encoder, get_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--texts", type=int, default=200_000)
    ap.add_argument("--baseline-texts", type=int, default=0, help="texts for the (slower) baselines; 0 = all")
    ap.add_argument("--call-texts", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (CPU)")
    ap.add_argument("--tokenizer-threads", default="1,8,16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    if a.threads:
        torch.set_num_threads(a.threads)
    texts = make_texts(a.texts)
    base_texts = texts[: a.baseline_texts or len(texts)]
    res: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
                 "cpus": os.cpu_count(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
                 "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
                 "command": "bench/embed_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "texts": len(texts), "baseline_texts": len(base_texts), "call_texts": a.call_texts,
                 "mean_words": round(float(np.mean([t.count(" ") + 1 for t in texts])), 1)}
    m32 = get_model(a.model, a.threads, a.device)
    res["model_max_seq_length"] = m32.max_seq_length
    plain(m32, base_texts[:2048], 128)  # warm-up: kernels, allocator
    baselines = {}
    variants = [("fp32_bs32", m32, 32), ("fp32_bs128", m32, 128)]
    if gpu:
        m16 = copy.deepcopy(m32).half()
        plain(m16, base_texts[:2048], 1024)
        variants += [("fp16_bs128", m16, 128), ("fp16_bs1024", m16, 1024)]
    ref = None
    for name, model, bs in variants:
        dt, vecs = timed(plain, model, base_texts, bs)
        baselines[name] = round(len(base_texts) / dt, 1)
        if name == "fp32_bs128":
            ref = vecs
        print(f"plain {name}: {baselines[name]:,.0f} texts/s", flush=True)
    res["plain_texts_per_s"] = baselines
    best_plain = max(baselines.values())
    default_plain = baselines["fp32_bs32"]

    runs = {}
    threads = [int(x) for x in a.tokenizer_threads.split(",")] if gpu else [1]
    precisions = ["fp16", "bf16"] if gpu else ["fp32"]
    for long_text in ("truncate", "chunk_mean"):
        for precision in precisions:
            for tt in threads:
                if precision == "bf16" and tt != max(threads):
                    continue
                spec = EmbeddingSpec(model=a.model, device=a.device, precision=precision, long_text=long_text,
                                     tokenizer_threads=tt, threads=a.threads, max_batch_rows=4096 if gpu else 64,
                                     carry_texts=0)
                enc = Encoder(spec)
                ours(enc, texts[:4096], a.call_texts)  # warm-up
                dt, vecs = timed(ours, enc, texts, a.call_texts)
                name = f"{long_text}_{precision}_tok{tt}"
                r = {"texts_per_s": round(len(texts) / dt, 1), "seconds": round(dt, 3)}
                if long_text == "truncate":
                    cos = np.einsum("ij,ij->i", vecs[: len(ref)], ref)
                    r["min_cos_vs_plain_fp32"] = round(float(cos.min()), 5)
                    assert cos.min() > 0.99, (name, float(cos.min()))
                r["x_best_plain"] = round(r["texts_per_s"] / best_plain, 2)
                r["x_default_plain"] = round(r["texts_per_s"] / default_plain, 2)
                runs[name] = r
                print(f"ours {name}: {r}", flush=True)
    res["ours"] = runs
    best = max(runs.items(), key=lambda kv: kv[1]["texts_per_s"] if kv[0].startswith("truncate") else 0)
    res["summary"] = {"best_plain": best_plain, "best_plain_variant": max(baselines, key=baselines.get),
                      "ours_best_truncate": best[0], "ours_texts_per_s": best[1]["texts_per_s"],
                      "ratio_vs_best_plain": best[1]["x_best_plain"], "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
    print(json.dumps(res["summary"], indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
