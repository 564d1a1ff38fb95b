"""The embedding path at scale (spark_jobs/enrich/embeddings.py) and partition sizing (spark_jobs/partitioning.py),
on CPU with the real bundled all-MiniLM-L6-v2: same vectors as SentenceTransformer.encode, long texts
as chunk means, identical texts embedded once, invalid settings refused."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from spark_jobs.enrich.embeddings import EmbeddingSpec, Encoder, get_model, spec_for
from spark_jobs.partitioning import Slots, partitions_for

WORDS = "river mountain engine library theorem protein market signal harbor orbit lattice violin".split()


def texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 30)))) + f" {i}." for i in range(n)]


@pytest.fixture(scope="module")
def plain_model():
    return get_model("all-MiniLM-L6-v2", 1, "cpu")


def test_truncate_mode_equals_plain_encode(plain_model):
    t = [*texts(150), "long " * 600, "", "Hello world.", *texts(20)]  # a text over the window, an empty one, repeats
    want = plain_model.encode(t, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    got = Encoder(EmbeddingSpec(long_text="truncate", threads=1, max_batch_rows=16, batch_tokens=600)).encode(t)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() < 1e-5


def test_chunk_mean_sees_the_end_of_long_texts():
    head = " ".join(WORDS[i % len(WORDS)] for i in range(400))
    a, b = head + " the answer is seven.", head + " " + "completely different ending about violins " * 60
    trunc = Encoder(EmbeddingSpec(long_text="truncate", threads=1)).encode([a, b])
    chunk = Encoder(EmbeddingSpec(long_text="chunk_mean", threads=1)).encode([a, b])
    assert float(trunc[0] @ trunc[1]) > 0.9999  # both cut inside the shared head
    assert float(chunk[0] @ chunk[1]) < 0.97
    assert np.allclose(np.linalg.norm(chunk, axis=1), 1, atol=1e-5)
    short = texts(5)  # texts inside the window: the same in both modes
    in_chunks = Encoder(EmbeddingSpec(long_text="chunk_mean", threads=1)).encode(short)
    assert np.abs(in_chunks - Encoder(EmbeddingSpec(long_text="truncate", threads=1)).encode(short)).max() < 1e-6


@contextlib.contextmanager
def counted_rows(enc: Encoder):
    """The model rows each forward of `enc` computes (a list filled while the block runs)."""
    rows: list[int] = []
    forward = enc.model.forward

    def counting(features):
        rows.append(int(features["input_ids"].shape[0]))
        return forward(features)

    enc.model.forward = counting
    try:
        yield rows
    finally:
        enc.model.forward = forward


def test_identical_texts_are_embedded_once_across_calls():
    enc = Encoder(EmbeddingSpec(threads=1, carry_texts=100))
    with counted_rows(enc) as rows:
        t = texts(30)
        first = enc.encode(t + t[:10])
        assert sum(rows) == 30  # 40 texts, 30 distinct
        second = enc.encode(t[:10] + texts(35)[30:])
        assert sum(rows) == 35  # the 10 repeats come from the carry-over, 5 new ones are embedded
        assert np.array_equal(first[:10], second[:10])


def test_stream_equals_plain_encode_with_carry_over_in_flight(plain_model):
    """encode_batches with tokenisation in 2 threads: each batch's vectors equal plain encode's, and a
    text repeated in the next batch (still in flight when that batch starts) is embedded once."""
    a, b, c = texts(40), texts(60)[40:], ["long " * 600, *texts(70)[60:]]
    batches = [a + a[:5], a[30:] + b, b[:10] + c]
    enc = Encoder(EmbeddingSpec(long_text="truncate", threads=1, tokenizer_threads=2,
                                max_batch_rows=16, batch_tokens=600, carry_texts=100))
    try:
        with counted_rows(enc) as rows:
            got = list(enc.encode_batches(iter(batches)))
    finally:
        enc.close()
    for batch, vecs in zip(batches, got, strict=True):
        want = plain_model.encode(batch, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
        assert vecs.shape == want.shape and np.abs(vecs - want).max() < 1e-5
    assert sum(rows) == 40 + 20 + 11  # distinct texts over the three batches, each embedded once


def test_half_precision_on_cpu_is_refused():
    with pytest.raises(ValueError, match="fp16 is for GPUs"):
        Encoder(EmbeddingSpec(precision="fp16", device="cpu", threads=1))


def test_spec_from_the_config_section():
    from pipeline_core.config import ConfigError, EnrichSection, load_config

    s = spec_for(EnrichSection(embedding_tokenizer_threads=0, embedding_threads=0), task_cpus=4)
    assert (s.threads, s.tokenizer_threads, s.long_text, s.device) == (4, 4, "chunk_mean", "auto")
    with pytest.raises(ConfigError, match="embedding_device"):
        load_config(env={}, overrides={"enrich.embedding_device": "gpu0"})


def test_partitions_follow_rows_and_slots():
    cpu = Slots(cores=64, task_cpus=1, executors=8, gpus_per_executor=0, gpus_per_task=0)
    gpu = Slots(cores=64, task_cpus=8, executors=8, gpus_per_executor=1, gpus_per_task=1)
    assert partitions_for(300, cpu, 20_000) == 128  # two waves of 64 slots
    assert partitions_for(25_700_000, cpu, 20_000) == 1344  # 1285 -> whole waves of 64
    assert partitions_for(25_700_000, gpu, 20_000) == 1288  # 8 GPU slots
    assert partitions_for(300, Slots(2, 1, 1, 0, 0), 20_000) == 4
