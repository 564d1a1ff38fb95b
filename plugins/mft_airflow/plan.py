"""Resolving a run: Params + deployment config -> one validated config file and a `RunPlan`.

`resolve_plan` is what the DAG's `resolve` task does: it applies the trigger policy (named params
and `OVERRIDABLE` content settings only), loads the config (defaults < file < env < Params), fails
before any compute with a message naming the field, writes the resolved config file each stage
command gets, and returns the typed `RunPlan` the other tasks read from XCom. Pure Python (no
Airflow import), so it is tested directly.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

from pipeline_core import layout, uris
from pipeline_core.artifacts import read_manifest
from pipeline_core.config import Config, ConfigError, load_config
from plugins.mft_airflow.params import OVERRIDABLE, STAGES, param_specs, to_overrides
from plugins.mft_airflow.run_plan import RunPlan, resource_name

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class PlanError(ValueError):
    """A parameter combination that cannot run; the message names the field."""


def safe_run_name(airflow_run_id: str) -> str:
    """An Airflow run id (`manual__2026-01-01T02:00:00+00:00`) as a safe path component."""
    s = _UNSAFE.sub("-", airflow_run_id).strip("-.")
    while ".." in s:
        s = s.replace("..", ".")
    return s[:100] or "run"


def version_from_date(date: datetime) -> str:
    return date.strftime("%Y%m%d")


def check_trigger_policy(params: dict[str, Any]) -> None:
    """Refuse params a trigger may not set: unknown names, and `config_overrides` outside the
    content allowlist (deployment settings come only from the deployment's config)."""
    unknown_params = sorted(set(params) - set(param_specs()))
    if unknown_params:
        raise PlanError(f"unknown param(s) {unknown_params}; known: {sorted(param_specs())} "
                        "(other content settings go in config_overrides as {'section.field': value})")
    overrides = params.get("config_overrides") or {}
    if not isinstance(overrides, dict):
        raise PlanError("config_overrides: expected an object {'section.field': value}")
    refused = sorted(k for k in overrides if k not in OVERRIDABLE)
    if refused:
        raise PlanError(
            f"config_overrides: {refused} cannot be set by a trigger; these are deployment settings (store, "
            "staging, connections, endpoints, Spark conf, ds_config, model and tokenizer paths) set in the "
            "deployment's config file or MFT__<SECTION>__<FIELD> environment. A trigger may set: "
            f"{', '.join(sorted(OVERRIDABLE))}")


def resolve_plan(
    params: dict[str, Any],
    *,
    dag_id: str,
    airflow_run_id: str,
    run_date: datetime | None,
    config_file: str | None = None,
    env: dict[str, str] | None = None,
    world_size: int | None = None,
) -> RunPlan:
    """Validate everything and write the resolved config; see the module docstring.

    `run_date` is the run's logical date (scheduled runs, backfills) or, for a manual run without
    one, when it was triggered: it names the dataset version unless a param does. `world_size` is
    the deployment's training ranks (`DeploySettings.world_size`), so a global batch or a pipeline
    degree that does not divide is refused here; None (unknown) leaves that check to the trainer.
    """
    check_trigger_policy(params)
    stages = list(params.get("stages") or STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise PlanError(f"stages: {unknown or stages!r} invalid; choose a non-empty subset of {list(STAGES)}")

    overrides = to_overrides(params)
    if "pipeline.dataset_version" not in overrides:
        if run_date is None:
            raise PlanError("dataset_version: the run has no logical date; pass dataset_version")
        overrides["pipeline.dataset_version"] = version_from_date(run_date)
    run_name = safe_run_name(airflow_run_id)
    version = overrides["pipeline.dataset_version"]
    if isinstance(version, str) and "pipeline.run_id" not in overrides:
        overrides["pipeline.run_id"] = f"{version}-{run_name}"[:128].rstrip("-.")
    try:
        cfg = load_config(config_file, overrides=overrides, env=env)
        if cfg.train.base_model == LATEST_MODEL:  # the promoted model, pinned for this run (retries train the same)
            overrides["train.base_model"] = latest_model(cfg)
            cfg = load_config(config_file, overrides=overrides, env=env)
        if "train" in stages and world_size is not None:
            cfg.train.accumulation_steps(world_size)  # a global batch that does not divide: refused now
    except ConfigError as e:
        raise PlanError(str(e)) from None

    staging = cfg.pipeline.staging_uri
    if not uris.is_local(staging):
        raise PlanError(f"pipeline.staging_uri: {staging!r} must be a file:// URI on a shared file system "
                        "(stages read their config file and write before publishing there)")
    config_path = uris.to_local_path(layout.staging_dir(cfg, "airflow", dag_id, run_name, "config.yaml"))
    plan = build_plan(cfg, config_path, stages=stages, world_size=world_size)
    _check_reused_inputs(cfg, plan)
    cfg.dump(config_path)
    return plan


LATEST_MODEL = "latest"


def latest_model(cfg: Config) -> str:
    """The model artifact `models/LATEST` points to (the promoted SFT model), for `base_model: latest`."""
    from pipeline_core.pointers import read_pointer

    models = uris.join(cfg.pipeline.store_uri, "models")
    pointer = read_pointer(models, cfg.storage)
    if pointer is None:
        raise PlanError(f"base_model: 'latest' but no model was promoted yet ({models}/LATEST does not exist); "
                        "run SFT first or name a base model")
    return pointer.target


def build_plan(cfg: Config, config_path: Path, *, stages: list[str], world_size: int | None = None) -> RunPlan:
    run = layout.run_uri(cfg)
    return RunPlan(
        config_file=str(config_path),
        dataset_version=cfg.pipeline.dataset_version,
        run_id=cfg.pipeline.run_id,
        source_uri=cfg.pipeline.source_uri,
        store_uri=cfg.pipeline.store_uri,
        enriched_uri=layout.enriched_uri(cfg),
        train_ready_uri=layout.train_ready_uri(cfg),
        run_uri=run,
        model_uri=layout.model_uri(run),
        # DPO models have their own forward-only pointer (docs/dpo.md)
        models_uri=uris.join(cfg.pipeline.store_uri, "models", *(("dpo",) if cfg.train.objective == "dpo" else ())),
        objective=cfg.train.objective,
        trainer_name=resource_name(cfg.pipeline.run_id),
        stages=tuple(stages),
        world_size=world_size,
    )


def _check_reused_inputs(cfg: Config, plan: RunPlan) -> None:
    """A selected stage whose producer is left out needs the producer's committed artifact now,
    not after hours of upstream work."""
    needs = {"filter": ("enrich", plan.enriched_uri), "train": ("filter", plan.train_ready_uri)}
    for stage, (producer, uri) in needs.items():
        if plan.runs(stage) and not plan.runs(producer) and read_manifest(uri, cfg.storage) is None:
            raise PlanError(
                f"stages: {stage!r} is selected without {producer!r}, but no committed {producer} artifact "
                f"exists at {uri}; add {producer!r} to stages"
            )


def load_plan_config(plan: RunPlan) -> Config:
    """The exact config the plan was resolved with (the environment is not applied twice)."""
    return load_config(plan.config_file, env={})
