"""The DAG's Params (JSON schema, validated by the trigger form and the API) and their mapping onto
`pipeline_core.config` overrides.

A param left at null means "whatever the configuration says" (defaults < config file < env), so a
deployment's config file is not silently overridden by form defaults. Content settings the form does
not name can be set through `config_overrides` (`{"section.field": value}`), limited to
`OVERRIDABLE`: a trigger may change what a run computes, never where it reads or writes, which
credentials or endpoints it uses, or what code runs (store, staging, connections, endpoints, Spark
conf, ds_config, model/tokenizer paths, launcher and image stay deployment configuration). The
named params that choose a source or a model, or touch a release gate, are bounded by the
deployment's policy in `plan.check_deployment_policy` (allowlists, a required approval, who may force).
"""

from __future__ import annotations

from typing import Any

from pipeline_core.config import NEMOTRON_SPLITS, NEMOTRON_V2_SPLITS, SPLIT_ALIASES, trigger_overridable
from pipeline_core.names import Stage

STAGES = tuple(s.value for s in Stage)  # plain strings: the form's JSON schema
COMPONENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# The split names the form offers (a multi-select): v1's, v2's and the hub's aliases, in that order.
# A dataset with other split names sets them through config_overrides["enrich.splits"] (checked
# against config.SPLIT_NAME there); a typo in the form is refused before the run starts.
FORM_SPLITS: tuple[str, ...] = tuple(dict.fromkeys((*NEMOTRON_SPLITS, *NEMOTRON_V2_SPLITS, *SPLIT_ALIASES)))

# param name -> config keys it sets (seq_len drives both the packer and the trainer)
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "dataset_version": ("pipeline.dataset_version",),
    "source_uri": ("pipeline.source_uri",),
    "run_id": ("pipeline.run_id",),
    "base_model": ("train.base_model",),
    "splits": ("enrich.splits",),
    "relevance_threshold": ("enrich.relevance_threshold",),
    "min_qa_similarity": ("filter.min_qa_similarity",),
    "near_dup_threshold": ("filter.near_dup_threshold",),
    "seq_len": ("filter.seq_len", "train.seq_len"),
    "steps": ("train.steps",),
    "learning_rate": ("train.learning_rate",),
    "require_approval": ("release.require_approval",),
    "promote_tolerance": ("release.promote_tolerance",),
    "force_promote": ("release.force_promote",),
    # preference optimisation (docs/dpo.md): one objective for every stage
    "objective": ("enrich.objective", "filter.objective", "train.objective"),
}

# `config_overrides` keys a trigger may set: what a run computes (thresholds, sizes, steps, rates,
# seeds), declared on each config field (`trigger=True` in pipeline_core/config.py). A field added to
# the config is not overridable until its declaration says so.
OVERRIDABLE: frozenset[str] = trigger_overridable()


def _nullable(kind: str, description: str, **schema: Any) -> dict[str, Any]:
    return {"default": None, "type": ["null", kind], "description": description, **schema}


def param_specs() -> dict[str, dict[str, Any]]:
    """name -> keyword arguments of `airflow.sdk.Param` (kept as plain dicts so tests and docs can
    read the schema without Airflow)."""
    return {
        "dataset_version": _nullable(
            "string", "Dataset version (artifacts under datasets/<version>/). Empty: the run's logical date, YYYYMMDD.",
            pattern=COMPONENT_PATTERN, title="Dataset version",
        ),
        "source_uri": _nullable(
            "string", "Raw Nemotron records: file:///…, s3://bucket/prefix or hf://datasets/<repo>, under the "
            "deployment's allowed source prefixes. Empty: config.",
            pattern=r"^(file|s3|s3a|hdfs|hf)://[^\s?#]+$", title="Source URI",
        ),
        "run_id": _nullable(
            "string", "Training run id (runs/<run_id>/). Empty: <dataset version>-<Airflow run id>; "
            "a retry of the same Airflow run resumes the same training run.",
            pattern=COMPONENT_PATTERN, title="Run id",
        ),
        "base_model": _nullable("string", "'tiny', a Hugging Face model directory or hub id among the deployment's "
                                "allowed base models, or 'latest': the model models/LATEST points to (e.g. DPO from last "
                                "night's SFT model). Empty: config.",
                                minLength=1, title="Base model"),
        "objective": {"default": None, "type": ["null", "string"], "enum": [None, "sft", "dpo"], "title": "Objective",
                      "description": "sft: supervised fine-tuning on conversations; dpo: preference pairs "
                                     "(docs/dpo.md). Empty: config (sft)."},
        "splits": _nullable(
            "array", "Nemotron splits to process (v1 or v2 names; each must have files in the source). "
            "Empty: config.",
            items={"type": "string", "enum": list(FORM_SPLITS)}, minItems=1, uniqueItems=True, title="Splits",
        ),
        "relevance_threshold": _nullable("number", "Min sentence relevance kept as context.", minimum=-1, maximum=1),
        "min_qa_similarity": _nullable("number", "Drop pairs with question-answer cosine below this.",
                                       minimum=-1, maximum=1),
        "near_dup_threshold": _nullable("number", "Cosine at or above which two records are near-duplicates.",
                                        minimum=0.5, maximum=1),
        "seq_len": _nullable("integer", "Packed sequence length (tokens), for packing and training.",
                             minimum=32, maximum=131072),
        "steps": _nullable("integer", "Optimizer steps.", minimum=1, maximum=10_000_000),
        "learning_rate": _nullable("number", "Peak learning rate.", exclusiveMinimum=0, maximum=1),
        "require_approval": _nullable(
            "boolean", "Wait for Approve/Reject (with the data report) before training. Empty: config (off). "
            "Cannot turn off an approval the deployment requires.",
            title="Require approval"),
        "promote_tolerance": _nullable(
            "number", "models/LATEST moves if the new val loss <= current LATEST's + this. Empty: config (0).",
            minimum=0, maximum=10, title="Promotion tolerance"),
        "force_promote": _nullable("boolean", "Publish to models/LATEST even if it evaluates worse (only users "
                                   "the deployment lists in MFT_DEPLOY__FORCE_PROMOTE_USERS).",
                                   title="Force promotion"),
        "stages": {
            "default": list(STAGES), "type": "array", "items": {"type": "string", "enum": list(STAGES)},
            "minItems": 1, "uniqueItems": True, "title": "Stages",
            "description": "Stages to run; a stage left out reuses its committed artifact (it must exist).",
        },
        "config_overrides": {
            "default": {}, "type": "object", "title": "Other config fields",
            "description": 'Other content settings, e.g. {"train.micro_batch_size": 2, "filter.val_fraction": 0.1}; '
                           "deployment settings (store, connections, Spark conf, ds_config, image) are refused.",
            "propertyNames": {"pattern": r"^[a-z_]+\.[a-z_0-9]+$"},
        },
    }


def to_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """Params -> `load_config(overrides=...)`. Named params win over `config_overrides`."""
    overrides: dict[str, Any] = dict(params.get("config_overrides") or {})
    for name, keys in CONFIG_KEYS.items():
        value = params.get(name)
        if value is None:
            continue
        for key in keys:
            overrides[key] = value
    return overrides
