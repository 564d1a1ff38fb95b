"""Where each artifact lives in the store (DESIGN.md "The flow").

The `<cfg>` part of a dataset path hashes everything that determines its content: the stage's
config section and what it was computed from. Same inputs + same config = same URI, which is
what makes re-running a stage a no-op.
"""

from __future__ import annotations

from pipeline_core import uris
from pipeline_core.config import Config, Role, TrainSection, stable_hash

# What a stage or run computes, not how it runs, comes from each field's declared role
# (config.content / config.execution): moving a job to a cluster or retuning its partitions finds the
# artifact it already committed; a resume may change execution settings, every content setting must
# match the checkpoint's (training/checkpoints.py ResumeContract). `steps` is execution: "continue
# this run to N steps" is a normal request.


def train_content_settings(train: dict) -> dict:
    """A train section (as stored in a manifest) without its execution-only fields."""
    execution_only = TrainSection.fields_of(Role.EXECUTION)
    return {k: v for k, v in train.items() if k not in execution_only}


def enriched_id(cfg: Config) -> str:
    return stable_hash({"source": cfg.pipeline.source_uri, "enrich": cfg.enrich.content_settings()})[:12]


def train_ready_id(cfg: Config) -> str:
    return stable_hash({"enriched": enriched_id(cfg), "filter": cfg.filter.content_settings()})[:12]


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


def eval_uri(run: str) -> str:
    """The run's benchmark scores (training/benchmarks.py)."""
    return uris.join(run, "eval")
