"""Where each artifact lives in the store (DESIGN.md "The flow").

The `<cfg>` part of a dataset path hashes everything that determines its content: the stage's
config section and what it was computed from. Same inputs + same config = same URI, which is
what makes re-running a stage a no-op.
"""

from __future__ import annotations

from pydantic import BaseModel

from pipeline_core import uris
from pipeline_core.config import Config, SparkStageSection, stable_hash

# How a stage runs, not what it computes: moving a job to a cluster or retuning its partitions
# must find the artifact it already committed, not a new path.
EXECUTION_ONLY = frozenset(SparkStageSection.model_fields) | {
    "embedding_threads", "arrow_batch_rows", "embedding_device", "embedding_batch_tokens", "embedding_tokenizer_threads",
    # a permission, not a content setting: rows it lets go are recorded in the manifest's counts
    "accept_corrupt_file_loss"}


# Train settings a resume may change: how the run executes, not what its weights and data position mean.
# Every other train field (model, seq_len, lr, batch shape, seed, precision, ds_config, ...) must match
# the checkpoint's, or the resume is refused (training/checkpoints.py ResumeContract). `steps` may grow:
# "continue this run to N steps" is a normal request.
TRAIN_EXECUTION_ONLY = frozenset({
    "steps", "checkpoint_every", "keep_last", "eval_batches", "verify_parity", "parity_tolerance", "peak_tflops",
    "attention_backend", "fast_kernels", "activation_checkpoint_interval", "max_failed_pushes",
    "max_pending_pushes", "push_backoff_s", "lease_ttl_s", "resume_across_changes",
    "compile_layers", "sync_free_attention", "causal_rows_sdpa", "fused_grad_accumulation", "pin_memory",
    "async_checkpoint",
})


def train_content_settings(train: dict) -> dict:
    return {k: v for k, v in train.items() if k not in TRAIN_EXECUTION_ONLY}


def content_settings(section: BaseModel) -> dict:
    return section.model_dump(mode="json", exclude=set(EXECUTION_ONLY) & set(type(section).model_fields))


def enriched_id(cfg: Config) -> str:
    return stable_hash({"source": cfg.pipeline.source_uri, "enrich": content_settings(cfg.enrich)})[:12]


def train_ready_id(cfg: Config) -> str:
    return stable_hash({"enriched": enriched_id(cfg), "filter": content_settings(cfg.filter)})[:12]


def dataset_uri(cfg: Config) -> str:
    return uris.join(cfg.pipeline.store_uri, "datasets", uris.safe_component(cfg.pipeline.dataset_version, "dataset_version"))


def enriched_uri(cfg: Config) -> str:
    return uris.join(dataset_uri(cfg), "enriched", enriched_id(cfg))


def train_ready_uri(cfg: Config) -> str:
    return uris.join(dataset_uri(cfg), "train", train_ready_id(cfg))


def run_uri(cfg: Config, run_id: str | None = None) -> str:
    rid = run_id or cfg.pipeline.run_id
    if rid is None:
        raise ValueError("pipeline.run_id: a training run needs a run id (set pipeline.run_id or pass run_id)")
    return uris.join(cfg.pipeline.store_uri, "runs", uris.safe_component(rid, "run_id"))


def checkpoints_uri(run: str) -> str:
    return uris.join(run, "checkpoints")


def checkpoint_uri(run: str, step: int) -> str:
    return uris.join(run, "checkpoints", f"step-{step}")


def model_uri(run: str) -> str:
    return uris.join(run, "model")


def report_uri(run: str) -> str:
    return uris.join(run, "report")


def staging_dir(cfg: Config, *parts: str) -> str:
    """A file:// (or shared FS) directory for a stage's local output before it is published."""
    return uris.join(cfg.pipeline.staging_uri, *parts)
