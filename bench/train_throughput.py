"""Training-throughput benchmark: the project's trainer vs strong Hugging Face baselines.

One setup per process (the drivers ``bench/run_trainer_bench.sh`` (1 GPU) and
``bench/run_gpu_bench.sh`` (2 GPUs) run them in one go):

  trainer    what users run: training/train.py's own Trainer.setup (plan, engine, client AdamW,
             token-mean loss, fast kernels, fp32 gradient accumulation) and its data loader over a
             real train-ready artifact written first; the steps are timed here
  hf_single  plain PyTorch on one GPU: HF MistralForCausalLM, fused AdamW, gradient accumulation;
             ``--master fp32`` keeps fp32 weights under bf16 autocast, ``--hf-liger`` adds Liger,
             ``--sliding-window none`` keeps SDPA on its flash kernel
  hf_zero2   DeepSpeed ZeRO-2 over all ranks with the HF model (torchrun); bf16 weights with
             DeepSpeed's fp32 master partitions (its bf16 ZeRO optimizer keeps them), no recompute
             with ``--act-ckpt 0``, Liger with ``--hf-liger``, window-free SDPA with
             ``--sliding-window none``
  fsdp2      PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard`` per decoder layer + root) with
             the HF model: fp32 sharded master weights, MixedPrecisionPolicy(bf16 params, fp32
             reduce), fused AdamW, same kernel flags as hf_zero2 (torchtitan's recipe)

``--checkpoint`` (trainer): after the timed steps, one checkpoint save through the trainer's own
``save_checkpoint`` (the stall training sees: local save + barrier + queueing the upload), the
upload drained, then ``Trainer.resume`` from the store and one step after it.
Packed rows also get document-aware FLOPs (training/flops.py, Σ len_d² attention credit) next to
the published convention's full-row credit.

Weights are random and created on the device in bf16 (no download). Sequences are packed
multi-document rows (position_ids restart per document; the pipeline's attention stays inside
each document) or, with ``--docs causal``, one document per row. Warm-up steps, then the median
of ``--steps`` timed steps. Rank 0 writes one JSON object to ``--out``.

CPU dry run (same code paths, tiny model): ``--device cpu --model tiny`` (DS_ACCELERATOR=cpu).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.metrics import (  # noqa: E402
    H100_H200_BF16_DENSE_FLOPS,
    MISTRAL_7B,
    ModelShape,
    analytic_bubble,
    bubble_share,
    throughput_summary,
)
from bench.power import PowerMeter  # noqa: E402
from training import flops  # noqa: E402
from training.fp8 import FP8_RECIPES  # noqa: E402

SETUPS = ("trainer", "hf_single", "hf_zero2", "fsdp2")


# ----------------------------------------------------------------------------- config / data
def mistral_config(model: str, seq_len: int, attn: str = "sdpa", sliding_window: str = "default",
                   layers: int | None = None):
    from transformers import MistralConfig

    if model == "7b":  # Mistral-7B-v0.1's architecture (``layers``: a slice of it)
        cfg = MistralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers or 32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
            rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False,
        )
    elif model == "tiny":
        cfg = MistralConfig(
            vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(4096, seq_len),
            sliding_window=4096, tie_word_embeddings=False,
        )
    else:
        raise ValueError(f"--model: unknown {model!r}")
    if sliding_window == "none":
        cfg.sliding_window = None
    cfg.use_cache = False
    cfg._attn_implementation = attn
    return cfg


def doc_lengths(seq_len: int, gen: torch.Generator, lo: int, hi: int) -> list[int]:
    """Documents of random length in [lo, hi] packed into one row; the last one is cut to fit."""
    out, total = [], 0
    while total < seq_len:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        n = min(n, seq_len - total)
        out.append(n)
        total += n
    return out


def make_micro_batches(*, n: int, micro_batch: int, seq_len: int, vocab: int, docs: str, seed: int = 0):
    """``n`` distinct micro-batches: dict(input_ids, position_ids, labels, targets), int64, CPU.
    ``labels`` are HF-style (unshifted, -100 on each document's prompt third); ``targets`` are
    the trainer's (shifted, never across a document boundary)."""
    from training.model import shift_targets

    gen = torch.Generator().manual_seed(seed)
    lo, hi = max(16, seq_len // 32), max(32, seq_len // 2)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (micro_batch, seq_len), generator=gen)
        pos = torch.empty_like(ids)
        labels = ids.clone()
        for row in range(micro_batch):
            lengths = (doc_lengths(seq_len, gen, lo, hi) if docs == "packed"
                       else [seq_len // 2, seq_len - seq_len // 2] if docs == "pairs"  # one DPO pair per row
                       else [seq_len])
            start = 0
            for n_tok in lengths:
                pos[row, start:start + n_tok] = torch.arange(n_tok)
                labels[row, start:start + n_tok // 3] = -100  # prompt tokens carry no loss
                start += n_tok
        batches.append({"input_ids": ids, "position_ids": pos, "labels": labels,
                        "targets": shift_targets(labels, pos)})
    return batches


def packed_flops_per_token(shape: ModelShape, args, vocab: int, rows: int = 64) -> float:
    """Document-aware FLOPs/token of the packed rows: the mean over rows drawn from the same
    generator and seed as the benchmark's (every row holds ``seq_len`` tokens)."""
    sample = make_micro_batches(n=rows, micro_batch=1, seq_len=args.seq_len, vocab=vocab, docs="packed",
                                seed=args.seed)
    per_row = []
    for b in sample:
        pos = b["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        per_row.append(flops.document_flops_per_token(shape, [e - s for s, e in zip(starts, starts[1:], strict=False)]))
    return statistics.fmean(per_row)


# ----------------------------------------------------------------------------- device helpers
class Device:
    def __init__(self, kind: str, local_rank: int):
        self.kind = kind
        self.cuda = kind == "cuda"
        self.torch_device = torch.device(f"cuda:{local_rank}" if self.cuda else "cpu")
        if self.cuda:
            torch.cuda.set_device(self.torch_device)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> dict:
        if not self.cuda:
            return {"peak_alloc_gib": None, "peak_reserved_gib": None}
        return {"peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


class InstructionTimer:
    """Times every pipeline instruction of a DeepSpeed PipelineEngine on the stage's compute stream
    (CUDA events, no extra synchronisation) and on the host (data-loading stall)."""

    BUSY = ("ForwardPass", "BackwardPass", "OptimizerStep", "ReduceGrads", "ReduceTiedGrads")

    def __init__(self, engine, device: Device):
        self.device = device
        self.active = False
        self.events: dict[str, list] = {}
        self.host: dict[str, float] = {}
        timer = self
        wrapped = {}
        for instr, fn in type(engine)._INSTRUCTION_MAP.items():
            wrapped[instr] = timer._wrap(fn, instr.__name__)
        engine._INSTRUCTION_MAP = wrapped  # instance attribute shadows the class map

    def _wrap(self, fn, name):
        timer = self

        def run(engine_self, *args, **kwargs):
            if not timer.active:
                return fn(engine_self, *args, **kwargs)
            t0 = time.perf_counter()
            if timer.device.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(engine_self, *args, **kwargs)
                end.record()
                timer.events.setdefault(name, []).append((start, end))
            else:
                out = fn(engine_self, *args, **kwargs)
                timer.events.setdefault(name, []).append(time.perf_counter() - t0)
            timer.host[name] = timer.host.get(name, 0.0) + time.perf_counter() - t0
            return out

        return run

    def gpu_seconds(self) -> dict[str, float]:
        self.device.sync()
        out = {}
        for name, evs in self.events.items():
            if self.device.cuda:
                out[name] = sum(s.elapsed_time(e) for s, e in evs) / 1e3
            else:
                out[name] = sum(evs)
        return out


# ----------------------------------------------------------------------------- setups
def build_hf_model(args, device: Device, dtype: torch.dtype | None = None):
    from transformers import MistralForCausalLM

    cfg = mistral_config(args.model, args.seq_len, attn=args.hf_attention, sliding_window=args.sliding_window,
                         layers=args.layers)
    if args.hf_liger:  # patches transformers' Mistral classes for this process, before the model exists
        from liger_kernel.transformers import apply_liger_kernel_to_mistral

        apply_liger_kernel_to_mistral(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                      cross_entropy=False)
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype or (torch.float32 if args.master == "fp32" else torch.bfloat16))
    try:
        with device.torch_device:
            model = MistralForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    if args.act_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, cfg


def adamw(params, device: Device, lr: float = 1e-5):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.cuda or None)


def cycled_batches(args, device: Device, vocab: int, seed: int):
    """Four micro-batches of the run's row kind on the device, repeated forever (the baselines' loader)."""
    import itertools

    batches = make_micro_batches(n=4, micro_batch=args.micro_batch, seq_len=args.seq_len, vocab=vocab,
                                 docs=args.docs, seed=seed)
    return itertools.cycle([{k: v.to(device.torch_device) for k, v in b.items()} for b in batches])


def setup_hf_single(args, device: Device):
    model, cfg = build_hf_model(args, device)
    opt = adamw(model.parameters(), device)
    batches = cycled_batches(args, device, cfg.vocab_size, seed=args.seed)

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.master == "fp32" and device.cuda)

    def step():
        for _ in range(args.grad_accum):
            b = next(batches)
            kwargs = {"position_ids": b["position_ids"]} if args.hf_position_ids else {}
            with autocast:
                loss = model(input_ids=b["input_ids"], labels=b["labels"], **kwargs).loss
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len
    return step, tokens_per_step, cfg, {"micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
                                        "master": args.master, "liger": args.hf_liger}, None


def setup_hf_zero2(args, device: Device):
    from training.engine import build_engine

    model, cfg = build_hf_model(args, device)
    world = torch.distributed.get_world_size()
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    opt = adamw(model.parameters(), device)
    engine = build_engine(model, ds_config, device.torch_device, [], optimizer=opt).engine
    rank = torch.distributed.get_rank()
    batches = cycled_batches(args, device, cfg.vocab_size, seed=args.seed + rank)

    def step():
        for _ in range(args.grad_accum):
            b = next(batches)
            kwargs = {"position_ids": b["position_ids"]} if args.hf_position_ids else {}
            loss = engine(input_ids=b["input_ids"], labels=b["labels"], **kwargs).loss
            engine.backward(loss)
            engine.step()
        return loss.detach()

    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len * world
    master = type(engine.optimizer).__name__
    return step, tokens_per_step, cfg, {**ds_config, "extra": {"optimizer": master, "master_weights": "fp32"}}, None


def setup_fsdp2(args, device: Device):
    """FSDP2 as torchtitan configures it: one FSDP unit per decoder layer plus the root, fp32
    sharded parameters (the master copy), bf16 all-gathered parameters for compute, fp32
    gradient reduce-scatter; gradients are reduced every micro-batch (FSDP2's default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.kind, (world,))
    model, cfg = build_hf_model(args, device, dtype=torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = adamw(model.parameters(), device)
    rank = torch.distributed.get_rank()
    batches = cycled_batches(args, device, cfg.vocab_size, seed=args.seed + rank)

    def step():
        for _ in range(args.grad_accum):
            b = next(batches)
            kwargs = {"position_ids": b["position_ids"]} if args.hf_position_ids else {}
            loss = model(input_ids=b["input_ids"], labels=b["labels"], **kwargs).loss
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().float()

    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len * world
    settings = {"micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "liger": args.hf_liger,
                "extra": {"param_dtype": "bf16", "reduce_dtype": "fp32", "master_weights": "fp32",
                          "units": len(model.model.layers) + 1,
                          # this rank's shard (fp32): about 1/world of the model when sharding took effect
                          "local_param_numel": sum(p.to_local().numel() for p in model.parameters()),
                          "local_param_dtype": str(next(model.parameters()).dtype)}}
    return step, tokens_per_step, cfg, settings, None


class RepeatingBatches:
    """The pipeline's data iterator: ((input_ids, position_ids), targets) from pinned host memory,
    cycling over a few pre-built micro-batches so the host does no work in the timed loop."""

    def __init__(self, batches, pin: bool):
        self.items = []
        for b in batches:
            t = ((b["input_ids"], b["position_ids"]), b["targets"])
            if pin:
                t = ((t[0][0].pin_memory(), t[0][1].pin_memory()), t[1].pin_memory())
            self.items.append(t)
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = self.items[self.i % len(self.items)]
        self.i += 1
        return item


def random_train_ready(root: Path, *, seq_len: int, rows: int, vocab: int, docs: str, seed: int,
                      objective: str = "sft") -> str:
    """A committed train-ready artifact of random tokens (``docs``: one causal document per row,
    or packed documents), written by the product writer (spark_jobs/filter/train_ready.py), for the
    trainer's own loader; each row's documents are one packing buffer, so every row stays full."""
    from pipeline_core import uris
    from pipeline_core.artifacts import read_manifest
    from pipeline_core.handoffs import TokenizerSpec
    from spark_jobs.filter.train_ready import document
    from spark_jobs.filter.train_ready import write_train_ready as write
    from spark_jobs.packing import split_documents

    store = uris.qualify(root / "store")
    uri = uris.join(store, "datasets", "bench", "train", f"{docs}-{seq_len}-{rows}-{vocab}-{objective}")
    if read_manifest(uri) is not None:
        return uri
    batches = make_micro_batches(n=rows, micro_batch=1, seq_len=seq_len, vocab=vocab, docs=docs, seed=seed)
    documents = []
    for b in batches:
        ids, labels, pos = (b[k][0].numpy() for k in ("input_ids", "labels", "position_ids"))
        documents.append([document(ids[s:e], labels[s:e]) for s, e in split_documents(pos)])
    write(uri, root / "ready" / f"{docs}-{seq_len}", {"train": [d for row in documents for d in row],
                                                       "val": [d for row in documents[:2] for d in row]},
          seq_len=seq_len, tokenizer=TokenizerSpec(name="mistral-v1", vocab_size=vocab), pad_id=0,
          buffers={"train": [len(row) for row in documents], "val": [len(row) for row in documents[:2]]},
          objective=objective)
    return uri


def publish_ready_dir(root: Path, data_dir: Path) -> str:
    """A train-ready directory written by bench/parity_corpus.py (real text through the filter's own
    render and pack), committed into the bench store as the filter stage would commit it."""
    from pipeline_core import uris
    from pipeline_core.artifacts import publish_artifact, read_manifest
    from pipeline_core.handoffs import StageCounts

    uri = uris.join(uris.qualify(root / "store"), "datasets", "bench", "train", f"text-{data_dir.name}")
    if read_manifest(uri) is None:
        meta = json.loads((data_dir / "train_ready.json").read_text())
        publish_artifact(data_dir, uri, kind="train-ready", counts=StageCounts.read(meta["counts"]),
                         extra=meta["info"])
    return uri


def save_random_model(cfg, out: Path, device: Device) -> Path:
    from transformers import MistralForCausalLM

    if (out / "config.json").exists():
        return out
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device.torch_device:
            model = MistralForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp), max_shard_size="4GB")
    del model
    os.replace(tmp, out)
    return out


def setup_trainer(args, device: Device):
    """training/train.py's own setup and data path; only the step loop is the benchmark's."""
    from pipeline_core import uris
    from pipeline_core.config import load_config
    from training import train

    work = Path(args.work)
    rank = torch.distributed.get_rank()
    base = mistral_config(args.model, args.seq_len, sliding_window=args.sliding_window, layers=args.layers)
    if args.data and args.model == "tiny":  # the CPU dry run of a real-text row: the tokenizer's vocabulary
        base.vocab_size = json.loads((Path(args.data) / "train_ready.json").read_text())["info"]["tokenizer"]["vocab_size"]
    # the window is part of the saved config.json: rows with and without it never share a model
    model_dir = work / f"model-{args.model}-{base.num_hidden_layers}L-{base.vocab_size}-w{base.sliding_window}"
    world = torch.distributed.get_world_size()
    dp = world // args.stages
    rows = args.micro_batch * args.grad_accum * dp * 4  # the loader cycles over 4 steps' worth
    def ready() -> str:
        if args.data:
            return publish_ready_dir(work, Path(args.data))
        return random_train_ready(work, seq_len=args.seq_len, rows=rows, vocab=base.vocab_size, docs=args.docs,
                                 seed=args.seed, objective=args.objective)

    if rank == 0:
        save_random_model(base, model_dir, device)
        ready()
    torch.distributed.barrier()
    input_uri = ready()  # committed by rank 0: returns its URI
    cfg = load_config(overrides={
        "pipeline.store_uri": uris.qualify(args.store or work / "store"), "pipeline.staging_uri": uris.qualify(work / "staging"),
        "train.base_model": str(model_dir), "train.pipeline_stages": args.stages, "train.seq_len": args.seq_len,
        "train.micro_batch_size": args.micro_batch, "train.gradient_accumulation_steps": args.grad_accum,
        "train.steps": args.warmup + args.steps, "train.attention_backend": args.attention,
        "train.fast_kernels": args.kernels, "train.grad_accum_dtype": args.grad_accum_dtype,
        "train.activation_checkpoint_interval": args.act_ckpt, "train.precision": args.precision if args.precision != "auto" else ("bf16" if device.cuda else "fp32"),
        "train.learning_rate": args.lr, "train.checkpoint_every": args.checkpoint_every,
        "train.compile_layers": bool(args.compile_layers), "train.sync_free_attention": bool(args.sync_free),
        "train.pin_memory": bool(args.pin_memory),
        # rows without --checkpoint never save: no background reservation of checkpoint host memory
        "train.async_checkpoint": bool(args.async_checkpoint) and args.checkpoint,
        "train.causal_rows_sdpa": bool(args.causal_rows_sdpa), "train.fused_grad_accumulation": bool(args.fused_accum),
        "train.fused_wgrad_accumulation": bool(args.fused_wgrad), "train.fp8": args.fp8,
        "train.recompute": args.recompute, "train.recompute_every": args.recompute_every,
        "enrich.objective": args.objective, "filter.objective": args.objective, "train.objective": args.objective,
    })
    plan = train.make_plan(cfg, input_uri, uris.join(cfg.pipeline.store_uri, "runs", f"bench-{args.label or 'run'}"),  # one run per row: rows never share checkpoints
                           world, device.cuda)
    trainer = train.Trainer(plan)
    trainer.setup(train.RunState(t0=time.time()))
    if args.checkpoint:
        trainer.resume(train.RunState(t0=time.time()))  # a fresh run: opens the metrics log save_checkpoint copies
    engine = trainer.engine
    reference = reference_pass(trainer, device) if args.objective == "dpo" else None
    batches = trainer.train_batches(0)
    timer = InstructionTimer(engine, device)

    def step():
        return engine.train_batch(data_iter=batches.next_step())

    def timed_save(at: int) -> float:
        """One save as fit() does it, timed as the stall training sees."""
        torch.distributed.barrier()
        device.sync()
        t0 = time.perf_counter()
        trainer.save_checkpoint(at, at * args.grad_accum)
        device.sync()
        return time.perf_counter() - t0

    def wait_pushed(at: int, timeout_s: float = 300.0) -> None:
        """Until checkpoint ``at`` is written and uploaded (at checkpoint_every 200 it long is)."""
        if trainer.ckpt_writer is not None:
            trainer.ckpt_writer.flush()
        deadline = time.monotonic() + timeout_s
        while trainer.uploader is not None and at not in trainer.uploader.pushed and time.monotonic() < deadline:
            trainer.uploader.raise_if_failed()
            time.sleep(0.2)
        torch.distributed.barrier()

    def checkpoint_probe(step_s: float) -> dict:
        """Two saves, each timed as the stall training sees: the run's first (its host memory was
        reserved in the background at setup; the save waits only for what is not done yet) and, one
        step after the first is pushed, a second one (what every later save costs); then the upload
        drained and a resume from the store."""
        done = args.warmup + args.steps
        writer = trainer.ckpt_writer
        reserve = {} if writer is None else {"reserve_s": writer.reserve_s, "reserved_bytes": writer.reserved_bytes}
        first = timed_save(done)
        if writer is not None:
            reserve["carved_bytes"] = writer.carved_bytes
        wait_pushed(done)
        step()
        done += 1
        stall = timed_save(done)
        t1 = time.perf_counter()
        if trainer.uploader is not None:
            trainer.uploader.close()  # the push runs in the background; wait so resume finds it
        torch.distributed.barrier()
        upload = time.perf_counter() - t1
        t2 = time.perf_counter()
        state = train.RunState(t0=time.time())
        trainer.resume(state)
        resume_s = time.perf_counter() - t2
        device.sync()
        t3 = time.perf_counter()
        loss = engine.train_batch(data_iter=trainer.train_batches(state.position).next_step())
        device.sync()
        every = args.checkpoint_every
        return {"first_save_stall_s": first, "save_stall_s": stall, "upload_drain_s": upload, "resume_s": resume_s,
                "resumed_step": state.start_step, "step_after_resume_s": time.perf_counter() - t3,
                "loss_after_resume": float(loss) if loss is not None else None,
                "checkpoint_every": every, "stall_share_at_every": stall / (stall + every * step_s), **reserve}

    step.checkpoint_probe = checkpoint_probe

    tokens_per_step = args.micro_batch * args.grad_accum * args.seq_len * dp
    extra = {
        "reference_pass": reference,
        "stage": engine.stage_id, "analytic_bubble": analytic_bubble(args.stages, args.grad_accum),
        "layers_on_stage": sum(1 for m in engine.module.modules() if type(m).__name__ == "DecoderLayerPipe"),
        "params_on_stage": sum(p.numel() for p in engine.module.parameters()),
        "resolved": {"precision": plan.settings.precision, "attention": plan.settings.attention_backend,
                     "kernels": plan.settings.fast_kernels, "optimizer": type(engine.optimizer).__name__,
                     "recompute": plan.recompute, "recompute_every": plan.recompute_every,
                     "estimated_stage_gib": round(plan.memory.total / 2**30, 2) if plan.memory else None,
                     **dataclasses.asdict(trainer.fast_paths)},
    }
    return step, tokens_per_step, plan.hf_config, {**plan.ds_config, "extra": extra}, timer


def reference_pass(trainer, device: Device) -> dict:
    """objective dpo: the trainer's own reference pass (forward only, every train/val row; the first
    one, which also hashes the model and commits the artifact), then the same forward pass over the
    train rows again, warm, timed alone (what a long run's pass costs per token)."""
    from training import dpo_train
    from training.data import COLUMNS, ShardSet, split_files

    t = trainer.t
    splits = {s: ShardSet(f, t.seq_len, COLUMNS) for s in ("train", "val")
              if (f := split_files(trainer.plan.staging / "input", s))}
    rows = sum(sh.num_rows for sh in splits.values())
    device.sync()
    t0 = time.perf_counter()
    trainer.reference = dpo_train.ensure_reference(trainer, splits, resumed=False)
    device.sync()
    elapsed = time.perf_counter() - t0
    ref = trainer.reference_summary  # the forward pass alone (hashing the model and committing excluded)
    torch.distributed.barrier()
    t1 = time.perf_counter()
    dpo_train.sequence_logps(trainer.engine, trainer.role, trainer.loss, splits["train"], t)
    device.sync()
    warm = time.perf_counter() - t1
    return {"rows": rows, "time_s": ref.get("reference_time_s"), "tokens_per_s": ref.get("reference_tokens_per_s"),
            "with_hash_and_commit_s": elapsed, "reused": ref.get("reference_reused"),
            "warm_rows": splits["train"].num_rows, "warm_time_s": warm,
            "warm_tokens_per_s": splits["train"].num_rows * t.seq_len / warm}


def profile_step(step, device: Device, out: Path) -> None:
    """One step under torch.profiler: GPU busy vs wall time and the kernels by total GPU time
    (what the step spends its time on, and the idle gaps between kernels)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.cuda else [])
    device.sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        device.sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    attr = "self_device_time_total" if device.cuda else "self_cpu_time_total"
    busy_us = sum(getattr(e, attr, 0.0) for e in events if e.device_type.name == ("CUDA" if device.cuda else "CPU"))
    lines = [f"wall {wall:.3f} s; kernel time {busy_us / 1e6:.3f} s ({busy_us / 1e6 / wall:.1%} of wall)"]
    lines.append(events.table(sort_by=attr, row_limit=45, max_name_column_width=90))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(lines[0], flush=True)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=SETUPS, required=True)
    p.add_argument("--label", default=None, help="row name in the results table")
    p.add_argument("--model", choices=("7b", "tiny"), default="7b")
    p.add_argument("--layers", type=int, default=None, help="7b: decoder layers of the slice (default all 32)")
    p.add_argument("--work", default="/dev/shm/mft-bench", help="trainer: model, artifact and staging directory")
    p.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), default="fp32", help="trainer: train.grad_accum_dtype")
    p.add_argument("--master", choices=("bf16", "fp32"), default="bf16",
                   help="hf_single: pure bf16 weights, or fp32 master weights under bf16 autocast")
    p.add_argument("--hf-liger", action="store_true", help="HF baselines: Liger kernels (apply_liger_kernel_to_mistral)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (trainer: m)")
    p.add_argument("--docs", choices=("packed", "causal", "pairs"), default="packed",
                   help="pairs: two documents per row (a DPO pair's chosen and rejected sides)")
    p.add_argument("--objective", choices=("sft", "dpo"), default="sft", help="trainer: train.objective")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--attention", default="torch_varlen", help="trainer attention backend")
    p.add_argument("--kernels", choices=("auto", "none", "liger"), default="none")
    p.add_argument("--act-ckpt", type=int, default=0, help="trainer: checkpoint interval; HF: 0/1")
    p.add_argument("--recompute", default="none", choices=("auto", "none", "full", "attention", "mlp", "every_n"),
                   help="trainer: train.recompute (auto: training/memory.py's rule)")
    p.add_argument("--recompute-every", type=int, default=2, help="trainer: train.recompute_every")
    p.add_argument("--hf-attention", default="sdpa")
    p.add_argument("--hf-position-ids", action="store_true", help="HF baselines: pass packed position_ids")
    p.add_argument("--sliding-window", choices=("default", "none"), default="default",
                   help="HF baselines: Mistral-7B-v0.1's 4096 window (default) or none")
    p.add_argument("--checkpoint", action="store_true",
                   help="trainer: after the timed steps, one checkpoint save (stall timed) and one resume")
    p.add_argument("--checkpoint-every", type=int, default=200,
                   help="trainer: train.checkpoint_every the save stall is reported against (issue 16: 200)")
    p.add_argument("--store", default=None,
                   help="trainer: store URI for the run and its checkpoints (default: <work>/store); put it on "
                        "another disk than --work when a full checkpoint does not fit twice")
    p.add_argument("--compile-layers", type=int, choices=(0, 1), default=0, help="trainer: train.compile_layers")
    p.add_argument("--sync-free", type=int, choices=(0, 1), default=1, help="trainer: train.sync_free_attention")
    p.add_argument("--pin-memory", type=int, choices=(0, 1), default=1, help="trainer: train.pin_memory")
    p.add_argument("--causal-rows-sdpa", type=int, choices=(0, 1), default=1, help="trainer: train.causal_rows_sdpa")
    p.add_argument("--fused-accum", type=int, choices=(0, 1), default=1, help="trainer: train.fused_grad_accumulation")
    p.add_argument("--async-checkpoint", type=int, choices=(0, 1), default=1, help="trainer: train.async_checkpoint")
    p.add_argument("--fused-wgrad", type=int, choices=(0, 1), default=1,
                   help="trainer: train.fused_wgrad_accumulation")
    p.add_argument("--fp8", choices=("off", *FP8_RECIPES), default="off", help="trainer: train.fp8")
    p.add_argument("--lr", type=float, default=1e-5, help="trainer: train.learning_rate (loss-parity runs)")
    p.add_argument("--data", default=None,
                   help="trainer: a train-ready directory from bench/parity_corpus.py pack (real text) instead of random rows")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="trainer: train.precision (auto: bf16 on a GPU, fp32 for a CPU dry run)")
    p.add_argument("--profile", default=None,
                   help="after the timed steps, one more step under torch.profiler; its kernel table to this file")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for name in ("seq_len", "micro_batch", "grad_accum", "stages", "steps", "checkpoint_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.checkpoint and args.setup != "trainer":
        p.error("--checkpoint needs --setup trainer (the save/resume measured is the trainer's own)")
    if args.model == "7b" and args.device == "cpu":
        p.error("--model 7b needs --device cuda (use --model tiny for a CPU dry run)")
    return args


def init_distributed(device: Device, setup: str) -> None:
    if setup == "fsdp2":  # a plain PyTorch job: no DeepSpeed in the process
        torch.distributed.init_process_group(backend="nccl" if device.cuda else "gloo",
                                             device_id=device.torch_device if device.cuda else None)
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device.cuda else "gloo")


def run(args) -> dict | None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = Device(args.device, local_rank)
    distributed = args.setup in ("trainer", "hf_zero2", "fsdp2")
    if distributed:
        init_distributed(device, args.setup)
    rank = torch.distributed.get_rank() if distributed else 0
    t_setup = time.perf_counter()
    builder = {"trainer": setup_trainer, "hf_single": setup_hf_single,
               "hf_zero2": setup_hf_zero2, "fsdp2": setup_fsdp2}[args.setup]
    step, tokens_per_step, cfg, settings, timer = builder(args, device)
    setup_s = time.perf_counter() - t_setup

    meter = PowerMeter(device.torch_device.index or 0) if device.cuda else None
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        timed = i >= args.warmup
        if i == args.warmup:
            device.reset_peak()
            if meter:
                meter.start()
            if timer:
                timer.active = True
        if distributed:
            torch.distributed.barrier()
        device.sync()
        t0 = time.perf_counter()
        loss = step()
        device.sync()
        dt = time.perf_counter() - t0
        if timed:
            times.append(dt)
        losses.append(float(loss) if loss is not None else float("nan"))
        if rank == 0:
            print(f"[{args.label or args.setup}] step {i} {'timed' if timed else 'warmup'} {dt:.3f}s loss {losses[-1]:.4f}",
                  flush=True)
    energy = meter.stop() if meter else {"energy_j": None}
    if timer:
        timer.active = False
    if args.profile and rank == 0:
        profile_step(step, device, Path(args.profile))
    probe = getattr(step, "checkpoint_probe", None) if args.checkpoint else None
    checkpoint = probe(statistics.median(times)) if probe else None
    local = {"rank": rank, "times": times, **device.peak_gib(), "power": energy, "losses": losses}
    if timer:
        gpu = timer.gpu_seconds()
        busy = sum(v for k, v in gpu.items() if k in InstructionTimer.BUSY)
        total = sum(times)
        local["instr_gpu_s"] = gpu
        local["instr_host_s"] = timer.host
        local["bubble_share"] = bubble_share(total, busy)
        # GPU-stream time of loading micro-batches (H2D copies). The host-side time is larger only
        # because the copy waits for the queued compute: that wait is not a stall of the GPU.
        local["data_stall_share"] = gpu.get("LoadMicroBatch", 0.0) / total
        local["load_host_share"] = timer.host.get("LoadMicroBatch", 0.0) / total
        local["stage"] = settings["extra"]["stage"]
        local["layers_on_stage"] = settings["extra"]["layers_on_stage"]
        local["params_on_stage"] = settings["extra"]["params_on_stage"]
    ranks = [local]
    if distributed:
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, local)
    if rank != 0:
        return None

    num_gpus = len(ranks)
    energies = [r["power"].get("energy_j") for r in ranks]
    energy_j = sum(energies) if all(e is not None for e in energies) else None
    shape = ModelShape.from_hf_config(cfg)
    summary = throughput_summary(
        step_times_s=ranks[0]["times"], tokens_per_step=tokens_per_step, num_gpus=num_gpus, shape=shape,
        seq_len=args.seq_len, energy_j=energy_j, timed_tokens=tokens_per_step * len(ranks[0]["times"]),
    )
    result = {
        "label": args.label or args.setup,
        "setup": args.setup,
        "args": vars(args),
        "settings": settings,
        "model_params": shape.num_parameters(),
        "is_mistral_7b": shape == MISTRAL_7B,
        "setup_s": setup_s,
        **summary,
        "peak_alloc_gib_max": max((r["peak_alloc_gib"] or 0) for r in ranks) if device.cuda else None,
        "peak_alloc_gib": [r["peak_alloc_gib"] for r in ranks],
        "peak_reserved_gib": [r["peak_reserved_gib"] for r in ranks],
        "mean_power_w": [r["power"].get("mean_power_w") for r in ranks],
        "energy_counter_j": [r["power"].get("energy_counter_j") for r in ranks],
        "losses": ranks[-1]["losses"],
        "step_times_s": ranks[0]["times"],
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if device.cuda else "cpu",
    }
    if args.docs == "packed":
        fpt = packed_flops_per_token(shape, args, cfg.vocab_size)
        result["doc_flops_per_token"] = fpt
        result["doc_mfu"] = flops.mfu(result["tokens_per_s_per_gpu"], fpt, H100_H200_BF16_DENSE_FLOPS)
    if checkpoint:
        result["checkpoint"] = checkpoint
    if timer:
        result["bubble_share"] = [r["bubble_share"] for r in ranks]
        result["data_stall_share"] = [r["data_stall_share"] for r in ranks]
        result["load_host_share"] = [r["load_host_share"] for r in ranks]
        result["instr_gpu_s"] = [r["instr_gpu_s"] for r in ranks]
        result["stage_of_rank"] = [r["stage"] for r in ranks]
        result["layers_on_stage"] = [r["layers_on_stage"] for r in ranks]
        result["params_on_stage"] = [r["params_on_stage"] for r in ranks]
        result["analytic_bubble"] = settings["extra"]["analytic_bubble"]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(
        f"RESULT {result['label']}: {result['tokens_per_s_per_gpu']:.0f} tok/s/GPU, MFU {result['mfu']:.1%}, "
        f"peak {result['peak_alloc_gib_max']} GiB, tokens/kJ {result.get('tokens_per_kj')}",
        flush=True,
    )
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    run(args)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
