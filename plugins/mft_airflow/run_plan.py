"""`RunPlan`: what the `resolve` task decides once and every later task reads from XCom.

A typed, frozen pydantic model (Airflow's XCom serde round-trips pydantic models; the operators
module registers the class for deserialization). No Airflow import here, so the plan is built
and tested without a scheduler.
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline_core.names import Stage

STAGES: tuple[Stage, ...] = tuple(Stage)
_NOT_DNS = re.compile(r"[^a-z0-9-]+")


def resource_name(run_id: str, prefix: str = "mft-train") -> str:
    """Deterministic container / Job name of a run's trainer (DNS-1123, <= 52 characters so the
    Job's pod names fit): a retry finds its predecessor by name instead of starting a second one."""
    base = _NOT_DNS.sub("-", f"{prefix}-{run_id}".lower()).strip("-")
    if len(base) <= 52:
        return base
    return f"{base[:43].rstrip('-')}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


class RunPlan(BaseModel):
    """Every URI a DAG run touches, and the one resolved config file every stage command gets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config_file: str = Field(description="Resolved config (YAML) on the shared staging file system")
    dataset_version: str
    run_id: str
    source_uri: str
    store_uri: str
    enriched_uri: str
    train_ready_uri: str
    run_uri: str
    model_uri: str
    models_uri: str
    eval_uri: str = Field("", description="The run's benchmark scores (runs/<run>/eval), committed by the eval task")
    trainer_name: str = Field(description="Deterministic name of the run's trainer container / Kubernetes Job")
    stages: tuple[Stage, ...] = STAGES
    world_size: int | None = Field(None, ge=1, description="Training ranks (nodes x processes per node), if known")
    objective: Literal["sft", "dpo"] = Field("sft", description="dpo: promotion gated on val reward metrics, "
                                             "pointer under models/dpo/ (docs/dpo.md)")

    def runs(self, stage: Stage) -> bool:
        return stage in self.stages
