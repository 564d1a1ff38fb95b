"""The trainer's DPO hooks (objective dpo; docs/dpo.md). train.py calls these, nothing else here
knows the trainer's internals beyond its engine, role and plan.

- ``check_artifact``: the train-ready artifact's objective must be the config's.
- ``make_loss`` / ``use_hidden_states``: the pipeline's loss is ``DPOLoss`` and the head hands it
  ``(hidden, weight)`` (the fused-loss seam), so no [tokens, vocab] logits are kept.
- ``ensure_reference``: the frozen reference model (the base weights, before any update) runs
  forward once through the same pipeline engine over every train and val row; each row's summed
  log-probs of its chosen and rejected sides are committed as a ``reference`` artifact under
  ``<store>/reference/<key>``, key = sha256(reference model files, train-ready manifest). A retry or
  a later run with the same model and data fetches it (verified against its manifest) instead. No
  second model is ever in memory: the pass runs before the first optimizer step, and a resumed run
  reads the artifact.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pipeline_core import uris
from pipeline_core.artifacts import fetch_artifact, publish_artifact, read_manifest
from pipeline_core.handoffs import RowsPerSplit
from pipeline_core.names import SPLITS
from training.collectives import broadcast, gather_value
from training.dpo_data import PairMicroBatches
from training.dpo_loss import DPOLoss, DPOMetrics
from training.loss import StepBatches

if TYPE_CHECKING:
    from pipeline_core.config import TrainSection
    from pipeline_core.handoffs import TrainReadyInfo

log = logging.getLogger("training.dpo")

# what the report manifest carries for the promotion gate (training/dpo_promote.py)
REPORT_KEYS = ("eval_reward_accuracy", "eval_reward_margin", "eval_dpo_loss", "reference_uri")
REFERENCE_KIND = "reference"


class ObjectiveMismatch(ValueError):
    pass


def check_artifact(info: TrainReadyInfo | None, t: TrainSection, input_uri: str) -> None:
    made = info.objective if info is not None else "sft"
    if made != t.objective:
        raise ObjectiveMismatch(
            f"--input {input_uri}: the train-ready artifact was made for objective {made!r} but train.objective="
            f"{t.objective!r}; filter the data with filter.objective {t.objective!r} (one objective for the run)")


def make_loss(t: TrainSection) -> DPOLoss:
    return DPOLoss(t.dpo.beta, t.dpo.label_smoothing, t.dpo.loss_type)


def use_hidden_states(pipe) -> int:
    """The head of this stage (if it holds it) returns (hidden, weight) to the loss, as under the fused
    cross-entropy (``fast_kernels.fused_lm_head_forward``)."""
    import types

    from training.fast_kernels import fused_lm_head_forward
    from training.model import LMHeadPipe

    n = 0
    for layer in pipe.modules():
        if isinstance(layer, LMHeadPipe):
            layer.forward = types.MethodType(fused_lm_head_forward, layer)
            n += 1
    return n


def model_hash(model_dir: Path) -> str:
    """sha256 over the model directory's config and weight files (names, sizes, contents)."""
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and (p.suffix in (".safetensors", ".bin") or p.name == "config.json"):
            h.update(f"{p.name}:{p.stat().st_size}:".encode())
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()


def reference_uri(store_uri: str, model_sha: str, data_sha: str) -> str:
    key = hashlib.sha256(f"{model_sha}:{data_sha}".encode()).hexdigest()[:24]
    return uris.join(store_uri, "reference", key)


def _read_table(path: Path, shards) -> np.ndarray:
    import pyarrow.parquet as pq

    t = pq.read_table(path).to_pydict()
    names = [f.name for f in shards.files]
    offsets = np.concatenate([[0], np.cumsum(shards.rows)[:-1]])
    out = np.full((shards.num_rows, 2), np.nan)
    for f, r, c, j in zip(t["file"], t["row"], t["chosen"], t["rejected"], strict=True):
        if f not in names:
            raise ValueError(f"reference artifact names {f!r}, not a file of this split")
        out[int(offsets[names.index(f)]) + int(r)] = (c, j)
    if np.isnan(out).any():
        raise ValueError(f"reference artifact misses {int(np.isnan(out[:, 0]).sum())} rows of the split")
    return out


def sequence_logps(engine, role, loss: DPOLoss, shards, t: TrainSection) -> tuple[np.ndarray, np.ndarray] | None:
    """Forward-only pass of the current weights over every row of one split: on the last stage,
    ([rows, 2] summed log-probs, [rows, 2] trained-token counts) gathered over data parallel."""
    import torch.distributed as dist

    source = None
    n = None
    if role.has_data:
        source = PairMicroBatches(shards, None, micro_batch=t.micro_batch_size, dp_rank=role.dp_rank,
                                  dp_size=role.dp_size, seed=t.seed, shuffle=False, need_inputs=role.first,
                                  need_labels=role.last, device=role.device)
        n, it = source.in_order()
    n = gather_value(n)
    if role.last:
        loss.collect = []
    batches = StepBatches(it if source is not None else None, loss if role.last else None, micro_batches=n,
                          dp_size=role.dp_size, dp_group=engine.grid.get_data_parallel_group(), device=role.device)
    engine.eval_batch(batches.next_step(), num_micro_batches=n)
    if not role.last:
        return None
    recorded, loss.collect = loss.collect, None
    rows = torch.cat([r for r, _, _ in recorded]).numpy()
    logps = torch.cat([p for _, p, _ in recorded]).double().numpy()
    counts = torch.cat([c for _, _, c in recorded]).numpy()
    parts = [(rows, logps, counts)]
    if role.dp_size > 1:
        parts = [None] * role.dp_size
        dist.all_gather_object(parts, (rows, logps, counts), group=engine.grid.get_data_parallel_group())
    out, cnt = np.full((shards.num_rows, 2), np.nan), np.zeros((shards.num_rows, 2), dtype=np.int64)
    for r, p, c in parts:
        out[r], cnt[r] = p, c
    return out, cnt


def _write_table(path: Path, shards, values: np.ndarray, counts: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files, rows = [], []
    for f, n in zip(shards.files, shards.rows, strict=True):
        files += [f.name] * n
        rows += list(range(n))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"file": files, "row": pa.array(rows, pa.int32()),
                             "chosen": values[:, 0], "rejected": values[:, 1],
                             "chosen_tokens": pa.array(counts[:, 0], pa.int32()),
                             "rejected_tokens": pa.array(counts[:, 1], pa.int32())}), path)


def ensure_reference(trainer, shard_sets: dict[str, Any], resumed: bool) -> dict[str, np.ndarray]:
    """{split: [rows, 2] reference log-probs}, on every rank: fetched from the committed reference
    artifact, or computed now with the engine's (still untrained) weights and committed. Every rank
    takes part (the pass is a pipeline forward). ``shard_sets``: the splits' ShardSets on ranks
    that hold data (rank 0 always does)."""
    import time

    import torch.distributed as dist


    plan, role, engine = trainer.plan, trainer.role, trainer.engine
    uri = committed = model_sha = None
    if role.is_rank0:
        data_manifest = read_manifest(plan.input_uri, trainer.storage)
        model_sha = model_hash(trainer.model_dir)
        uri = reference_uri(trainer.cfg.pipeline.store_uri, model_sha, data_manifest.sha256)
        committed = read_manifest(uri, trainer.storage) is not None
    uri, committed = broadcast((uri, committed), group=trainer.io_group)
    local = plan.staging / "reference"
    if committed:
        tables = None
        if role.is_rank0:
            fetch_artifact(uri, local, trainer.storage)  # verified against the manifest
            tables = {s: _read_table(local / "data" / f"{s}.parquet", sh) for s, sh in shard_sets.items()}
        tables = broadcast(tables, group=trainer.io_group)
        log.info("reference log-probs reused from %s", uri)
        trainer.reference_summary = {"reference_uri": uri, "reference_reused": True}
        return tables
    if resumed:  # the weights are no longer the reference model's
        raise RuntimeError(f"resuming a DPO run whose reference log-probs are not committed at {uri}; they are "
                           "committed before the first step, so the store lost them: start the run again")
    n_splits = gather_value(len(shard_sets) if role.is_rank0 else None)
    splits = [s for s in SPLITS if s in shard_sets] if role.has_data else [None] * n_splits
    splits = gather_value(splits if role.is_rank0 else None)
    dist.barrier()
    t0 = time.time()
    results = {s: sequence_logps(engine, role, trainer.loss, shard_sets.get(s), trainer.t) for s in splits}
    elapsed = time.time() - t0
    rows = sum(v[0].shape[0] for v in results.values()) if role.last else None
    rows = gather_value(rows)
    tokens = rows * trainer.t.seq_len
    log.info("reference pass: %d rows in %.1f s (%.0f tokens/s, forward only)", rows, elapsed, tokens / max(elapsed, 1e-9))
    results = gather_value(results if role.last and role.dp_rank == 0 else None)
    if role.is_rank0:
        for split, (values, counts) in results.items():
            _write_table(local / "data" / f"{split}.parquet", shard_sets[split], values, counts)
        if trainer.lease is not None:  # a trainer that lost its run's lease commits nothing
            trainer.lease.check()
        publish_artifact(local, uri, kind=REFERENCE_KIND, inputs=[plan.input_uri],
                         counts=RowsPerSplit(rows={s: int(v[0].shape[0]) for s, v in results.items()}),
                         extra={"model_sha256": model_sha, "seq_len": trainer.t.seq_len,
                                "columns": {"chosen": "summed log-prob of the chosen side's trained tokens",
                                            "rejected": "the same, rejected side"}},
                         storage=trainer.storage)
    trainer.reference_summary = {"reference_uri": uri, "reference_reused": False, "reference_time_s": elapsed,
                                 "reference_tokens_per_s": tokens / max(elapsed, 1e-9)}
    return {s: v[0] for s, v in results.items()}


def step_metrics(loss: DPOLoss | None, role, engine) -> DPOMetrics | None:
    """The DPO metrics of the pairs since the last call (last stage; None elsewhere)."""
    if not role.last:
        return None
    return loss.take_metrics(engine.grid.get_data_parallel_group(), role.device)
