"""Resolving a run: Params + deployment config -> one validated config file and a `RunPlan`.

`resolve_plan` is what the DAG's `resolve` task does: it applies the trigger policy (named params
and `OVERRIDABLE` content settings only; the deployment's policy wins over params, see
`check_deployment_policy`), loads the config (defaults < file < env < Params), fails
before any compute with a message naming the field, writes the resolved config file each stage
command gets, and returns the typed `RunPlan` the other tasks read from XCom. Pure Python (no
Airflow import), so it is tested directly.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pipeline_core import layout, uris
from pipeline_core.artifacts import read_manifest
from pipeline_core.config import Config, ConfigError, FilterSection, load_config
from pipeline_core.names import Stage
from plugins.mft_airflow.params import OVERRIDABLE, STAGES, param_specs, to_overrides
from plugins.mft_airflow.run_plan import RunPlan, resource_name
from plugins.mft_airflow.settings import DeploySettings, load_settings

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
    # settings of a retired method: say what replaced them rather than "cannot be set by a trigger"
    retired = FilterSection.retired({k.removeprefix("filter."): v for k, v in overrides.items()
                                     if k.startswith("filter.")}, old_dump_ok=False)
    if retired:
        raise PlanError("config_overrides: " + "; ".join(retired))
    refused = sorted(k for k in overrides if k not in OVERRIDABLE)
    if refused:
        raise PlanError(
            f"config_overrides: {refused} cannot be set by a trigger; these are deployment settings (store, "
            "staging, connections, endpoints, Spark conf, ds_config, model and tokenizer paths) set in the "
            "deployment's config file or MFT__<SECTION>__<FIELD> environment. A trigger may set: "
            f"{', '.join(sorted(OVERRIDABLE))}")


def _allowed(value: str, allowed: tuple[str, ...]) -> bool:
    """`value` is one of `allowed`, or below one of them by whole path components (`file:///data/raw`
    allows `file:///data/raw/v2`, not `file:///data/raw-other`, nor anything with a `..` component)."""
    if any(part in ("..", ".") for part in value.split("/")):
        return False
    return any(value == a or value.startswith(a if a.endswith("/") else a + "/") for a in allowed)


def _base_model_config(base_model: str) -> dict[str, Any] | None:
    """The base model's config.json fields when they can be read without a download: the embedded
    tiny model and local directories (a hub id is checked by the trainer)."""
    from training.tiny import TINY_CONFIG

    if base_model == "tiny":
        return {"model_type": "mistral", **TINY_CONFIG}
    path = uris.to_local_path(base_model) if base_model.startswith("file://") else Path(base_model)
    try:
        return json.loads((path / "config.json").read_text()) if path.is_absolute() else None
    except (OSError, ValueError):
        return None  # not a readable local model: the trainer names the problem


def check_cross_fields(cfg: Config, stages: list[str]) -> None:
    """The rules between fields that later stages enforce, checked before any compute (issue 26.6):
    the trainer's (sequence length of the data, the model's positions and layers) and the publish
    task's (a val split to evaluate on). Each message names the fields to change."""
    if Stage.TRAIN not in stages:
        return
    f, t = cfg.filter, cfg.train
    errors = []
    if t.seq_len != f.seq_len:
        errors.append(f"train.seq_len={t.seq_len} != filter.seq_len={f.seq_len}: the trainer needs the rows packed to "
                      "its own length (set both, e.g. with the seq_len param)")
    if f.val_fraction == 0:
        errors.append("filter.val_fraction=0: the publish task scores the model on the val split, so a run that "
                      "trains needs val rows; set filter.val_fraction > 0 (e.g. 0.05)")
    model = _base_model_config(t.base_model)
    if model is not None:
        where = f"train.base_model={t.base_model!r}"
        if model.get("model_type") not in (None, "mistral"):
            errors.append(f"{where} is a {model.get('model_type')!r} model; the pipeline trains Mistral models")
        if model.get("tie_word_embeddings"):
            errors.append(f"{where} ties its input and output embeddings, which the pipeline model does not support")
        positions = model.get("max_position_embeddings")
        if positions is not None and t.seq_len > positions:
            errors.append(f"train.seq_len={t.seq_len} exceeds {where}'s max_position_embeddings={positions}")
        layers = model.get("num_hidden_layers")
        if layers is not None and t.pipeline_stages > layers + 3:  # + embedding, final norm, head (training/train.py)
            errors.append(f"train.pipeline_stages={t.pipeline_stages} exceeds {where}'s {layers + 3} pipe layers")
    if errors:
        raise PlanError("invalid combination of settings:\n  " + "\n  ".join(errors))


def check_deployment_policy(params: dict[str, Any], cfg: Config, deployed: Config, settings: DeploySettings,
                            triggered_by: str | None, run_date: datetime | None, now: datetime) -> None:
    """The deployment wins over a trigger (issue 26.5, 26.8b). `deployed` is the config without the
    trigger's params: a gate it requires stays on, and what a trigger reads comes from its allowlists."""
    if deployed.release.require_approval and not cfg.release.require_approval:
        raise PlanError("require_approval: this deployment requires an approval before training "
                        "(release.require_approval in its config); a trigger may turn the gate on, never off")
    if params.get("force_promote") and not deployed.release.force_promote \
            and triggered_by not in settings.force_promote_users:
        raise PlanError(f"force_promote: user {triggered_by!r} may not force a promotion; only the users in the "
                        "deployment's MFT_DEPLOY__FORCE_PROMOTE_USERS may (or set release.force_promote in its config)")
    ahead = deployed.release.max_order_key_ahead_s
    if run_date is not None and run_date > now + timedelta(seconds=ahead):
        raise PlanError(f"logical_date: {run_date.isoformat()} is more than release.max_order_key_ahead_s={ahead:g} s "
                        "ahead of now; it would order this run's model after every model published until then")
    source = cfg.pipeline.source_uri
    if source != deployed.pipeline.source_uri and not _allowed(source, settings.allowed_source_prefixes):
        raise PlanError(f"source_uri: {source!r} is not under the deployment's allowed sources "
                        f"{list(settings.allowed_source_prefixes)} (MFT_DEPLOY__ALLOWED_SOURCE_PREFIXES)")
    model = cfg.train.base_model
    # 'latest' resolves to the model this deployment's own models/LATEST names (a verified store artifact)
    pinned_latest = params.get("base_model") == LATEST_MODEL
    if model != deployed.train.base_model and not pinned_latest and not _allowed(model, settings.allowed_base_models):
        raise PlanError(f"base_model: {model!r} is not among the deployment's allowed base models "
                        f"{list(settings.allowed_base_models)} (MFT_DEPLOY__ALLOWED_BASE_MODELS)")


def resolve_plan(
    params: dict[str, Any],
    *,
    dag_id: str,
    airflow_run_id: str,
    run_date: datetime | None,
    config_file: str | None = None,
    env: dict[str, str] | None = None,
    world_size: int | None = None,
    settings: DeploySettings | None = None,
    triggered_by: str | None = None,
    now: datetime | None = None,
) -> RunPlan:
    """Validate everything and write the resolved config; see the module docstring.

    `run_date` is the run's logical date (scheduled runs, backfills) or, for a manual run without
    one, when it was triggered: it names the dataset version unless a param does. `world_size` is
    the deployment's training ranks (`DeploySettings.world_size`), so a global batch or a pipeline
    degree that does not divide is refused here; None (unknown) leaves that check to the trainer.
    `settings` (default: read from `env`'s `MFT_DEPLOY__*`) holds the trigger allowlists;
    `triggered_by` is the Airflow user who triggered the run (None: the scheduler).
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
    settings = settings or load_settings(os.environ if env is None else env)
    try:
        cfg = load_config(config_file, overrides=overrides, env=env)
        deployed = load_config(config_file, env=env)
        if cfg.train.base_model == LATEST_MODEL:  # the promoted model, pinned for this run (retries train the same)
            overrides["train.base_model"] = latest_model(cfg)
            cfg = load_config(config_file, overrides=overrides, env=env)
        if Stage.TRAIN in stages and world_size is not None:
            cfg.train.accumulation_steps(world_size)  # a global batch that does not divide: refused now
    except ConfigError as e:
        raise PlanError(str(e)) from None
    check_cross_fields(cfg, stages)
    check_deployment_policy(params, cfg, deployed, settings, triggered_by, run_date, now or datetime.now(UTC))

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
        eval_uri=layout.eval_uri(run),
        trainer_name=resource_name(cfg.pipeline.run_id),
        stages=tuple(stages),
        world_size=world_size,
    )


def _check_reused_inputs(cfg: Config, plan: RunPlan) -> None:
    """A selected stage whose producer is left out needs the producer's committed artifact now,
    not after hours of upstream work."""
    needs = {Stage.FILTER: (Stage.ENRICH, plan.enriched_uri), Stage.TRAIN: (Stage.FILTER, plan.train_ready_uri)}
    for stage, (producer, uri) in needs.items():
        if plan.runs(stage) and not plan.runs(producer) and read_manifest(uri, cfg.storage) is None:
            raise PlanError(
                f"stages: {stage!r} is selected without {producer!r}, but no committed {producer} artifact "
                f"exists at {uri}; add {producer!r} to stages"
            )


def load_plan_config(plan: RunPlan) -> Config:
    """The exact config the plan was resolved with (the environment is not applied twice)."""
    return load_config(plan.config_file, env={})
