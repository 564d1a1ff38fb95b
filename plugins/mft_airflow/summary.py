"""Publishing the model and saying what a run did, read back from the committed manifests.

`publish_model` is the evaluation-gated promotion (`training.promote`): every model file is
checked against its manifest's sha256, the model and the current `models/LATEST` are scored on
the same val rows, the run's summary (with that decision and both numbers) is stored next to the
model, and only then does `models/LATEST` move, forward only (`pipeline_core.pointers`). `python -m plugins.mft_airflow.summary --store URI` prints the summary of the
latest published model (what `make demo` ends with).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline_core import layout, uris
from pipeline_core.artifacts import (
    ArtifactError,
    read_artifact_file,
    read_latest,
    read_manifest,
    require_manifest,
)
from pipeline_core.config import DPOSettings, ReleaseSection, StorageSection, TrackingSection, load_config
from pipeline_core.handoffs import (
    DecontamInfo,
    EnrichedInfo,
    FileEntry,
    SourcesSummary,
    StageCounts,
    TrainReadyInfo,
)
from pipeline_core.pointers import read_pointer
from pipeline_core.run_records import (
    DPOCurves,
    DPOPoint,
    DPOPromotion,
    EvalMetrics,
    EvalSummary,
    FilterSummary,
    M,
    ModelSummary,
    Promotion,
    RunReportInfo,
    RunSummary,
    StageSummary,
    StepMetrics,
    TrainSummary,
    read_rows,
)
from pipeline_core.store import open_store
from plugins.mft_airflow.run_plan import RunPlan

SUMMARY = "pipeline_summary.json"


def _losses(report_uri: str, storage: StorageSection | None) -> dict[str, Any]:
    """Loss at start/end from the run's report (metrics.csv), plus the report's own figures
    (`TrainSummary`'s fields, less `run_uri`)."""
    report = read_manifest(report_uri, storage)
    if report is None:
        return {}
    out: dict[str, Any] = dict(RunReportInfo.from_manifest(report))

    def table(name: str, model: type[M]) -> list[M]:
        path = next((p for p in report.file_paths() if p.endswith(name)), None)
        return [] if path is None else read_rows(model, read_artifact_file(report, path, storage).decode())

    steps = table("metrics.csv", StepMetrics)
    if losses := [r for r in steps if r.loss is not None]:
        out.update(loss_start=losses[0].loss, loss_end=losses[-1].loss, first_step=losses[0].step,
                   last_step=losses[-1].step)
    if pairs := [r for r in steps if r.reward_accuracy is not None]:  # objective dpo: the per-step pair metrics
        evals = [r for r in table("eval.csv", EvalMetrics) if r.eval_reward_accuracy is not None]
        out["dpo"] = _dpo_curves(pairs, evals)
    return out


def _dpo_curves(steps: list[StepMetrics], evals: list[EvalMetrics]) -> DPOCurves:
    """objective dpo: the train metrics at the first step, at each validation step and at the last step
    (each over that step's pairs), and every validation (over the val pairs); `pairs` per row."""
    at = {r.step for r in evals} | {steps[0].step, steps[-1].step}
    return DPOCurves(
        train=tuple(DPOPoint(step=r.step, pairs=r.pairs, loss=r.dpo_loss, reward_accuracy=r.reward_accuracy,
                             chosen_reward=r.chosen_reward, rejected_reward=r.rejected_reward,
                             reward_margin=r.reward_margin) for r in steps if r.step in at),
        val=tuple(DPOPoint(step=r.step, pairs=r.eval_pairs, loss=r.eval_dpo_loss, reward_accuracy=r.eval_reward_accuracy,
                           chosen_reward=r.eval_chosen_reward, rejected_reward=r.eval_rejected_reward,
                           reward_margin=r.eval_reward_margin) for r in evals))


def _stage(uri: str, storage: StorageSection | None, model: type[StageSummary] = StageSummary,
           **more: Any) -> StageSummary:
    m = read_manifest(uri, storage)
    return model(uri=uri, committed=m is not None, counts=m.counts if m else None,
                 timings=m.timings if m else None, **more)


def _sources(plan: RunPlan, storage: StorageSection | None) -> SourcesSummary | None:
    """Per input split (rows in, rejects, conversations that fit seq_len with/without reasoning) and the
    withheld prompts restored / unrestorable per seed source (docs/data-sources.md)."""
    from reports.facts import source_split_rows

    en, tr = read_manifest(plan.enriched_uri, storage), read_manifest(plan.train_ready_uri, storage)
    if en is None or tr is None:
        return None
    return SourcesSummary(splits=source_split_rows(en, tr),
                          prompt_sources=EnrichedInfo.from_manifest(en).prompt_sources)


def _fmt_sources(s: SourcesSummary | None) -> list[str]:
    if s is None:
        return []
    lines = []
    for name, c in sorted(s.prompt_sources.items()):
        where = c.uri or f"not configured ({c.config_key})"
        lines.append(f"  prompts {name}: {c.restored} restored, {c.unrestorable} unrestorable <- {where}")
    for split, r in s.splits.items():
        fit = (f"fit seq_len {r.fit_with} with reasoning / {r.fit_without} without, of {r.measured}"
               if r.measured is not None else "not measured")
        rejected = ", ".join(f"{k}={n}" for k, n in sorted(r.rejected.items())) or "none"
        lines.append(f"  split   {split}: in {r.rows_in}, kept {r.kept}; {fit}; rejected: {rejected}")
    return lines


def _decontamination(train_ready_uri: str, storage: StorageSection | None) -> DecontamInfo | None:
    m = read_manifest(train_ready_uri, storage)
    info = TrainReadyInfo.of(m) if m is not None else None
    return None if info is None else info.decontamination


def _benchmarks(run_uri: str, storage: StorageSection | None) -> EvalSummary | None:
    """The run's committed benchmark scores (runs/<run>/eval), if it has any."""
    from training.benchmarks import read_results

    res = read_results(layout.eval_uri(run_uri), storage)
    return None if res is None else EvalSummary(uri=layout.eval_uri(run_uri), **dict(res))


def publish_model(plan: RunPlan, storage: StorageSection | None, order_key: str,
                  release: ReleaseSection | None = None, tracking: TrackingSection | None = None,
                  dpo: DPOSettings | None = None) -> RunSummary:
    """Verify, evaluate, write the summary, then move `models/LATEST` (DPO: `models/dpo/LATEST`) if the
    gate allows it. With `tracking.mlflow_uri`, the run's MLflow run gets the manifests, the eval
    scores and the decision, and a promoted model is registered (training/tracking.py; failures
    there are logged, never raised)."""
    from training.tracking import Tracker

    tracker = Tracker.create(tracking, plan.run_id)
    try:
        return _publish_model(plan, storage, order_key, release or ReleaseSection(), tracker, dpo)
    finally:
        if tracker is not None:
            tracker.close()


def _publish_model(plan: RunPlan, storage: StorageSection | None, order_key: str, release: ReleaseSection,
                   tracker: Any, dpo: DPOSettings | None) -> RunSummary:
    from training.benchmarks import read_results

    model = require_manifest(plan.model_uri, storage)
    if model.kind != "model":
        raise ArtifactError(f"{plan.model_uri} is a {model.kind!r} artifact, not a model")
    model_files = FileEntry.all_of(model)
    summary = RunSummary(
        dataset_version=plan.dataset_version,
        run_id=plan.run_id,
        objective=plan.objective,
        source_uri=plan.source_uri,
        enrich=_stage(plan.enriched_uri, storage),
        filter=_stage(plan.train_ready_uri, storage, FilterSummary,
                      decontamination=_decontamination(plan.train_ready_uri, storage)),
        data_report=data_report_link(plan, storage),
        sources=_sources(plan, storage),
        train=TrainSummary(run_uri=plan.run_uri, **_losses(layout.report_uri(plan.run_uri), storage)),
        model=ModelSummary(uri=plan.model_uri, files=len(model_files), bytes=sum(f.size for f in model_files),
                           manifest_sha256=model.sha256),
        eval=_benchmarks(plan.run_uri, storage),
    )
    if tracker is not None:
        for role, uri in (("enriched", plan.enriched_uri), ("train_ready", plan.train_ready_uri)):
            if (m := read_manifest(uri, storage)) is not None:
                tracker.log_manifest(role, m)
        if (scores := read_results(layout.eval_uri(plan.run_uri), storage)) is not None:
            tracker.log_benchmarks(scores)

    def store_decision(decision: Promotion | DPOPromotion) -> None:  # before LATEST can name this run (again after a lost race)
        nonlocal summary
        summary = summary.model_copy(update={"promotion": decision})
        _write_summary(plan.run_uri, summary, storage)

    if plan.objective == "dpo":  # gated on the run's val reward accuracy and margin (training/dpo_promote.py)
        from training.dpo_promote import promote as promote_dpo

        final = promote_dpo(plan.model_uri, plan.run_uri, plan.train_ready_uri, plan.models_uri, order_key, release,
                            dpo or DPOSettings(), storage, run_id=plan.run_id, on_decision=store_decision)
    else:
        from training.promote import promote

        final = promote(plan.model_uri, plan.train_ready_uri, plan.models_uri, order_key, release, storage,
                        run_id=plan.run_id, on_decision=store_decision, tracker=tracker)
    if final != summary.promotion:
        store_decision(final)
    return summary.model_copy(update={"latest": uris.join(plan.models_uri, "LATEST")})


def _write_summary(run_uri: str, summary: RunSummary, storage: StorageSection | None) -> None:
    store, key = open_store(run_uri, storage)
    store.put_bytes(f"{key.rstrip('/')}/{SUMMARY}", json.dumps(summary.to_json_dict(), indent=2, sort_keys=True).encode())


def data_report_link(plan: RunPlan, storage: StorageSection | None) -> str | None:
    """The committed data report's page for this run's train-ready artifact, if there is one."""
    from reports.data_report import report_page_uri, report_uri

    m = read_manifest(report_uri(plan.train_ready_uri), storage)
    return report_page_uri(m) if m is not None else None


def latest_summary(store_uri: str, storage: StorageSection | None, objective: str = "sft") -> RunSummary:
    models = uris.join(store_uri, "models", *(["dpo"] if objective == "dpo" else []))
    pointer = read_pointer(models, storage)
    target = pointer.target if pointer else read_latest(models, storage)  # stores from before LATEST.d
    if target is None:
        raise ArtifactError(f"no published model: {models}/LATEST does not exist")
    store, key = open_store(uris.parent(target), storage)
    summary = RunSummary.read(json.loads(store.get_bytes(f"{key.rstrip('/')}/{SUMMARY}")))
    return summary.model_copy(update={"latest": uris.join(models, "LATEST")})


def newest_summary(store_uri: str, storage: StorageSection | None, objective: str = "sft") -> RunSummary:
    """The newest published run of an objective, promoted or not (its promotion order key decides)."""
    store, key = open_store(uris.join(store_uri, "runs"), storage)
    found = []
    for info in store.list(key.rstrip("/") + "/"):
        if info.key.endswith(f"/{SUMMARY}"):
            s = RunSummary.read(json.loads(store.get_bytes(info.key)))
            if s.objective == objective and s.promotion is not None:
                found.append((s.promotion.order_key, s))
    if not found:
        raise ArtifactError(f"no published {objective} run under {store_uri}/runs")
    summary = max(found, key=lambda f: f[0])[1]
    return summary.model_copy(update={
        "latest": uris.join(store_uri, "models", *(["dpo"] if objective == "dpo" else []), "LATEST")})


def _fmt_counts(c: StageCounts | None) -> str:
    if c is None:
        return "(no counts)"
    rej = ", ".join(f"{k}={v}" for k, v in sorted(c.rejected.items())) or "none"
    return f"rows in={c.rows_in} out={c.rows_out}  rejected: {rej}"


def _fmt_promotion(p: Promotion | DPOPromotion | None) -> list[str]:
    if p is None:
        return []
    verdict = "PROMOTED" if p.promoted else "NOT promoted"
    if isinstance(p, DPOPromotion):
        return [f"  promote {verdict} to models/dpo/LATEST: {p.reason}"]
    cur = "none" if p.current_val_loss is None else f"{p.current_val_loss:.4f}"
    if p.promote_on == "metrics":
        return [f"  promote {verdict} on benchmark scores (val loss {p.candidate_val_loss:.4f} vs {cur}); {p.reason}"]
    return [f"  promote {verdict}: val loss {p.candidate_val_loss:.4f} vs current LATEST {cur} "
            f"({p.val_rows} val rows, {p.val_target_tokens} target tokens); {p.reason}"]


def _fmt_decontamination(d: DecontamInfo | None) -> list[str]:
    if d is None:
        return []
    sets = ", ".join(f"{e.name} ({e.documents} docs, sha256 {e.sha256[:12]}): {e.rows_removed} removed"
                     for e in d.eval_sets)
    return [f"          decontaminated ({d.ngram}-grams) against {sets}"]


def _fmt_dpo(d: DPOCurves | None) -> list[str]:
    """objective dpo: train and val pair metrics side by side at each validation step (docs/dpo.md, "Metrics")."""
    if d is None:
        return []

    def cols(r: DPOPoint | None) -> str:
        if r is None:
            return " " * 42
        return (f"{r.loss:>7.4f} {r.reward_accuracy:>5.2f} {r.chosen_reward:>8.4f} {r.rejected_reward:>8.4f} "
                f"{r.reward_margin:>8.4f}")

    train, val = {r.step: r for r in d.train}, {r.step: r for r in d.val}
    head = "   loss   acc   chosen rejected   margin"
    lines = [f"  dpo      step | train (the step's pairs){' ' * 17}| val (every val pair)",
             f"                | {head} | {head}",
             *(f"          {step:>5} | {cols(train.get(step))} | {cols(val.get(step))}".rstrip()
               for step in sorted(train.keys() | val.keys()))]
    if d.val:
        first, last = d.val[0], d.val[-1]
        lines.append(f"          val reward accuracy: 0 before training (the policy is the reference: every reward 0, "
                     f"loss log 2 = 0.6931), {first.reward_accuracy:.3f} at step {first.step}, "
                     f"{last.reward_accuracy:.3f} at step {last.step} ({last.pairs} pairs); "
                     f"margin {first.reward_margin:.4f} -> {last.reward_margin:.4f}, "
                     f"loss {first.loss:.4f} -> {last.loss:.4f}")
    else:
        lines.append("          (no validation: train.eval_batches 0 or no val split)")
    return lines


def _fmt_eval(e: EvalSummary | None) -> list[str]:
    if e is None:
        return ["  eval    (no benchmarks: release.eval_tasks is empty)"]
    lines = []
    for t in e.tasks:
        ms = ", ".join(f"{k.split(',')[0]} {v.value:.4f}" + (f" ± {v.stderr:.4f}" if v.stderr is not None else "")
                       for k, v in sorted(t.metrics.items()) if v.value is not None)
        lines.append(f"  eval    {t.task} ({t.num_fewshot}-shot, {t.samples} samples): {ms}")
    return [*lines, f"          -> {e.uri}"]


def format_summary(s: RunSummary) -> str:
    t = s.train

    def num(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = [
        f"dataset version {s.dataset_version}  run {s.run_id}",
        f"  source  {s.source_uri}",
        f"  enrich  {_fmt_counts(s.enrich.stage_counts)}",
        f"          -> {s.enrich.uri}",
        f"  filter  {_fmt_counts(s.filter.stage_counts)}",
        *_fmt_decontamination(s.filter.decontamination),
        f"          -> {s.filter.uri}",
        *_fmt_sources(s.sources),
        f"  train   loss start {num(t.loss_start)} (step {t.first_step}) -> end {num(t.loss_end)}"
        f" (step {t.last_step}); val loss {num(t.eval_loss)}, perplexity {num(t.eval_perplexity)}",
        *_fmt_dpo(t.dpo),
        f"          -> {t.run_uri}",
        f"  model   {s.model.uri}  ({s.model.files} files, {s.model.bytes / 1e6:.1f} MB)",
        *_fmt_eval(s.eval),
        *_fmt_promotion(s.promotion),
        f"  latest  {s.latest}",
        f"  report  {s.data_report or '(no data report)'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print what the latest published pipeline run did.")
    p.add_argument("--store", default=None, help="store root URI (default: the config's pipeline.store_uri)")
    p.add_argument("--config", default=None, help="config file (for storage settings)")
    p.add_argument("--objective", choices=("sft", "dpo"), default="sft",
                   help="whose promoted run: models/LATEST (sft) or models/dpo/LATEST (dpo)")
    p.add_argument("--newest", action="store_true",
                   help="the newest published run of the objective, promoted or not (default: the promoted one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    store_uri = uris.qualify(args.store) if args.store else cfg.pipeline.store_uri
    try:
        s = (newest_summary if args.newest else latest_summary)(store_uri, cfg.storage, args.objective)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(s.to_json_dict(), indent=2) if args.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
