"""Benchmarks after training: EleutherAI's lm-evaluation-harness on the exported model.

    python -m training.benchmarks --input MODEL_URI --output EVAL_URI [--config FILE]

1. The model artifact is fetched with every file checked against its manifest (`base_model.fetch_model`).
2. Each `release.eval_tasks` entry runs through `lm_eval.simple_evaluate` with the HF backend on
   `release.eval_device` (a GPU in the trainer's container): a harness task by name, or a local
   YAML task (`yaml:` a file:// or s3:// URI; plain YAML, its `dataset_kwargs.data_files` resolved
   next to it and fetched), with its own `num_fewshot` and `limit`.
3. The scores (per task and metric, with stderr and the number of documents) and every scored
   sample are committed as the run's `eval/` artifact: `data/results.json`, `data/samples/<task>.jsonl`,
   the manifest's `extra` a `pipeline_core.handoffs.BenchmarkResults`. Same model + same tasks =
   the committed artifact is reused (a retried task re-runs nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline_core import uris
from pipeline_core.artifacts import (
    ArtifactConflict,
    Manifest,
    publish_artifact,
    read_manifest,
    require_manifest,
)
from pipeline_core.config import (
    Config,
    EvalTaskSpec,
    ReleaseSection,
    StorageSection,
    load_config,
    stable_hash,
)
from pipeline_core.handoffs import BenchmarkResults, MetricScore, TaskScores
from pipeline_core.store import open_store
from pipeline_core.uris import safe_relpath

log = logging.getLogger("training.benchmarks")

KIND = "eval"
RESULTS = "data/results.json"


def stage_config(model: Manifest, release: ReleaseSection) -> dict[str, Any]:
    """What determines the eval artifact: the model's content and the tasks (recorded and hashed)."""
    return {"stage": "eval", "model": model.uri, "model_manifest_sha256": model.sha256,
            "eval_tasks": [t.model_dump(mode="json") for t in release.eval_tasks]}


def task_config(spec: EvalTaskSpec, work: Path, storage: StorageSection | None) -> tuple[str | dict, str | None]:
    """(what `simple_evaluate` gets for this task, the YAML's sha256). A local YAML task is read as
    plain YAML (no `!function` tags: nothing from the store is executed), its name must be `task`,
    and relative `data_files` are fetched from beside it into `work`."""
    if spec.yaml is None:
        return spec.task, None
    store, key = open_store(spec.yaml, storage)
    raw = store.get_bytes(key)
    try:
        cfg = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"release.eval_tasks: {spec.yaml} is not plain YAML (tags such as !function are not "
                         f"supported for local tasks): {e}") from None
    if not isinstance(cfg, dict) or cfg.get("task") != spec.task:
        raise ValueError(f"release.eval_tasks: {spec.yaml} must be a task mapping with task: {spec.task}")
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is not None:
        base = uris.parent(spec.yaml)

        def local(rel: Any) -> str:
            rel = safe_relpath(rel, f"{spec.yaml} data_files")  # never a path outside the task's directory
            dest = work / spec.task / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            s, k = open_store(uris.join(base, rel), storage)
            s.get_file(k, dest)
            return str(dest)

        if isinstance(files, str):
            kwargs["data_files"] = local(files)
        elif isinstance(files, list):
            kwargs["data_files"] = [local(f) for f in files]
        elif isinstance(files, dict):
            kwargs["data_files"] = {split: ([local(f) for f in v] if isinstance(v, list) else local(v))
                                    for split, v in files.items()}
        cfg["dataset_kwargs"] = kwargs
    return cfg, hashlib.sha256(raw).hexdigest()


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f else None  # NaN -> None


def scores_of(out: dict[str, Any], spec: EvalTaskSpec, yaml_sha: str | None) -> TaskScores:
    """The harness's result dict for one task -> `TaskScores` (metric keys are '<metric>,<filter>')."""
    res = out["results"][spec.task]
    metrics = {}
    for k, v in res.items():
        if "," not in k or "_stderr," in k or k.startswith("alias"):
            continue
        name, flt = k.split(",", 1)
        metrics[k] = MetricScore(value=_num(v), stderr=_num(res.get(f"{name}_stderr,{flt}")))
    n = out.get("n-samples", {}).get(spec.task, {})
    return TaskScores(task=spec.task, num_fewshot=spec.num_fewshot, limit=spec.limit,
                      samples=int(n.get("effective", len(out.get("samples", {}).get(spec.task, [])))),
                      metrics=metrics, higher_is_better=dict(out.get("higher_is_better", {}).get(spec.task, {})),
                      yaml_sha256=yaml_sha)


def run_task(model_dir: Path, spec: EvalTaskSpec, task: str | dict, release: ReleaseSection) -> dict[str, Any]:
    import lm_eval

    return lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(model_dir), "dtype": "float32"}, tasks=[task],
        num_fewshot=spec.num_fewshot, limit=spec.limit, batch_size=release.eval_batch_size,
        device=release.eval_device, log_samples=True, bootstrap_iters=100,
    )


def evaluate(model_uri: str, output_uri: str, release: ReleaseSection, storage: StorageSection | None = None,
             staging: Path | None = None) -> Manifest:
    """Run `release.eval_tasks` on the model at `model_uri`; commit the results at `output_uri`."""
    model_uri, output_uri = model_uri.rstrip("/"), output_uri.rstrip("/")
    model = require_manifest(model_uri, storage, kind="model")
    config = stage_config(model, release)
    existing = read_manifest(output_uri, storage)
    if existing is not None:
        if existing.config_hash != stable_hash(config)[:12]:
            raise ArtifactConflict(f"{output_uri} is already committed for another model or task set "
                                   f"(config {existing.config_hash}); artifacts are immutable")
        log.info("%s is already committed for this model and these tasks; nothing to do", output_uri)
        return existing
    with tempfile.TemporaryDirectory(prefix="bench-", dir=staging) as tmp:
        out_dir = Path(tmp) / "out"
        results = score_model(model, release, storage, Path(tmp), samples_dir=out_dir / "data" / "samples")
        (out_dir / RESULTS).write_text(json.dumps(results.to_extra(), indent=2, sort_keys=True))
        return publish_artifact(out_dir, output_uri, kind=KIND, config=config, inputs=[model_uri],
                                extra=results.to_extra(), storage=storage)


def score_model(model: Manifest, release: ReleaseSection, storage: StorageSection | None, work: Path,
                samples_dir: Path | None = None) -> BenchmarkResults:
    """Run every `release.eval_tasks` entry on the committed model `model` (fetched and verified
    under `work`); with `samples_dir`, every scored sample is written there as `<task>.jsonl`."""
    from importlib.metadata import version

    from training.base_model import fetch_model

    if not release.eval_tasks:
        raise ValueError("release.eval_tasks is empty: nothing to evaluate (add tasks or leave the eval task out)")
    model_dir = fetch_model(model.uri, work / "model", storage)
    tasks = []
    for spec in release.eval_tasks:
        task, yaml_sha = task_config(spec, work / "tasks", storage)
        log.info("lm-eval: %s (num_fewshot=%d, limit=%s) on %s", spec.task, spec.num_fewshot, spec.limit,
                 release.eval_device)
        out = run_task(model_dir, spec, task, release)
        scores = scores_of(out, spec, yaml_sha)
        log.info("lm-eval: %s %s", spec.task, {k: v.value for k, v in scores.metrics.items()})
        tasks.append(scores)
        if samples_dir is not None:
            samples_dir.mkdir(parents=True, exist_ok=True)
            with open(samples_dir / f"{spec.task}.jsonl", "w") as f:
                for s in out.get("samples", {}).get(spec.task, []):
                    f.write(json.dumps(s, default=str, sort_keys=True) + "\n")
    return BenchmarkResults(model_uri=model.uri, model_manifest_sha256=model.sha256,
                            harness_version=version("lm_eval"), tasks=tuple(tasks))


def read_results(eval_uri: str, storage: StorageSection | None = None) -> BenchmarkResults | None:
    """A committed eval artifact's scores (from its manifest), or None when there is none."""
    m = read_manifest(eval_uri, storage)
    return None if m is None else BenchmarkResults.from_manifest(m)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run lm-evaluation-harness tasks on a committed model; commit the scores.")
    p.add_argument("--input", required=True, help="committed model artifact URI (runs/<run>/model)")
    p.add_argument("--output", required=True, help="eval artifact URI to commit (runs/<run>/eval)")
    p.add_argument("--config", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg: Config = load_config(args.config)
    m = evaluate(uris.require_uri(args.input, "--input"), uris.require_uri(args.output, "--output"), cfg.release,
                 cfg.storage)
    print(json.dumps({"uri": m.uri, "tasks": {t["task"]: {k: v["value"] for k, v in t["metrics"].items()}
                                                for t in m.extra.get("tasks", [])}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
