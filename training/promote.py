"""Evaluation-gated, forward-only promotion of a trained model to `models/LATEST`.

    python -m training.promote --model URI --val URI --models URI --order-key KEY [--config FILE]

1. The new model's files are downloaded and every one is checked against its manifest's sha256
   (a same-size corrupt `model.safetensors` stops here, before any pointer moves).
2. The new model and the current LATEST are evaluated with `val_loss` on the same rows of the
   new model's val split (token-weighted: Σ loss / Σ target tokens).
3. LATEST moves when new <= current + `release.promote_tolerance`, when there is no current
   model, or when `release.force_promote` is set; and then only forward (`pointers.advance`:
   a run with an older order key never replaces a newer one) and only from the record it was
   compared with: when another publish moved LATEST between the evaluation and the move (a
   backfill promoted meanwhile), the move is refused and the candidate is evaluated again against
   the new LATEST (up to `pointer_gate.REEVALUATIONS` times; the loop is `training.pointer_gate`'s,
   shared with the DPO gate). Order keys more than
   `release.max_order_key_ahead_s` ahead of now are refused.
The decision, with both numbers, is returned; the caller (`plugins/mft_airflow/summary.py`)
writes it into the run's `pipeline_summary.json` (`promotion`) and the publish task's XCom.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pipeline_core import uris
from pipeline_core.artifacts import ArtifactError, fetch_artifact, require_manifest
from pipeline_core.config import (
    Config,
    PromoteMetric,
    ReleaseSection,
    StorageSection,
    TrackingSection,
    load_config,
)
from pipeline_core.handoffs import BenchmarkResults
from pipeline_core.names import Split, data_prefix
from pipeline_core.pointers import check_order_key, read_pointer
from pipeline_core.run_records import MetricComparison, Promotion
from training.base_model import fetch_model
from training.pointer_gate import move_pointer, promote_gated
from training.tracking import Tracker

log = logging.getLogger("training.promote")

VAL_FILES = data_prefix(Split.VAL)


def compare_metrics(rules: list[PromoteMetric], candidate: BenchmarkResults,
                    current: BenchmarkResults | None) -> tuple[MetricComparison, ...]:
    """Each rule's comparison: a metric is ok when the candidate is not worse than the current model
    by more than its min_delta (no current model: ok; a candidate without the score: not ok)."""
    out = []
    for r in rules:
        c = candidate.score(r.task, r.metric)
        cur = current.score(r.task, r.metric) if current is not None else None
        cv, cur_v = (c.value if c else None), (cur.value if cur else None)
        if cv is None:
            out.append(MetricComparison(task=r.task, metric=r.metric, candidate=None, current=cur_v, min_delta=r.min_delta,
                                        higher_is_better=r.higher_is_better, worse_by=None, ok=False))
            continue
        if current is None:
            out.append(MetricComparison(task=r.task, metric=r.metric, candidate=cv, current=None, min_delta=r.min_delta,
                                        higher_is_better=r.higher_is_better, worse_by=None, ok=True))
            continue
        if cur_v is None:
            out.append(MetricComparison(task=r.task, metric=r.metric, candidate=cv, current=None, min_delta=r.min_delta,
                                        higher_is_better=r.higher_is_better, worse_by=None, ok=False))
            continue
        worse = (cur_v - cv) if r.higher_is_better else (cv - cur_v)
        out.append(MetricComparison(task=r.task, metric=r.metric, candidate=cv, current=cur_v, min_delta=r.min_delta,
                                    higher_is_better=r.higher_is_better, worse_by=worse, ok=worse <= r.min_delta + 1e-12))
    return tuple(out)


def decide_metrics(compared: tuple[MetricComparison, ...], has_current: bool, forced: bool) -> tuple[bool, str]:
    """The benchmark rule: promote when no compared metric is worse than the current model's by more than its min_delta."""
    def fmt(m: MetricComparison) -> str:
        cur = "n/a" if m.current is None else f"{m.current:.4f}"
        cand = "n/a" if m.candidate is None else f"{m.candidate:.4f}"
        return f"{m.task}/{m.metric} {cand} vs {cur} (min_delta {m.min_delta:g})"

    listed = "; ".join(fmt(m) for m in compared)
    bad = [m for m in compared if not m.ok]
    if not has_current and not [m for m in bad if m.candidate is None]:
        return True, f"no model is published yet; scores: {listed}"
    if not bad:
        return True, f"no metric worse than the current LATEST's by more than its min_delta: {listed}"
    why = "; ".join(
        f"{fmt(m)}: " + ("the candidate has no such score" if m.candidate is None else
                         "the current LATEST has no such score" if m.current is None else f"worse by {m.worse_by:.4f}")
        for m in bad)
    if forced:
        return True, f"forced (release.force_promote): {why}"
    return False, f"{why}; set release.force_promote to publish it anyway"


def decide(candidate: float, current: float | None, tolerance: float, forced: bool) -> tuple[bool, str]:
    """The rule alone: (promote?, why)."""
    if current is None:
        return True, "no model is published yet"
    margin = candidate - current
    if margin <= tolerance:
        return True, f"val loss {candidate:.4f} <= current {current:.4f} + tolerance {tolerance:g}"
    if forced:
        return True, f"forced (release.force_promote): val loss {candidate:.4f} is worse than current {current:.4f} by {margin:.4f}"
    return False, (f"val loss {candidate:.4f} is worse than the current LATEST's {current:.4f} by {margin:.4f} > "
                   f"release.promote_tolerance={tolerance:g}; set release.force_promote to publish it anyway")


def evaluate(model_uri: str, val_uri: str, models_uri: str, order_key: str, release: ReleaseSection,
             storage: StorageSection | None = None) -> Promotion:
    """Steps 1-2 and the rule: verify, evaluate both models, decide. Moves nothing."""
    from training.val_loss import val_loss

    model_uri, val_uri = model_uri.rstrip("/"), val_uri.rstrip("/")
    current = read_pointer(models_uri, storage)
    with tempfile.TemporaryDirectory(prefix="promote-") as tmp:
        root = Path(tmp)
        new_dir = fetch_model(model_uri, root / "candidate", storage)  # raises before any pointer moves
        fetch_artifact(val_uri, root / "val", storage, prefix=VAL_FILES)
        val_files = sorted((root / "val" / VAL_FILES).glob("*.parquet"))
        kw = {"max_rows": release.eval_max_rows, "device": release.eval_device}
        cand = val_loss(new_dir, val_files, **kw)
        log.info("candidate %s: val loss %.4f over %d target tokens", model_uri, cand.loss, cand.target_tokens)
        cur_loss, incomparable = None, None
        if current is not None and current.target != model_uri:
            current_dir = fetch_model(current.target, root / "current", storage)  # a corrupt LATEST fails loudly
            try:
                cur_loss = val_loss(current_dir, val_files, **kw).loss
                log.info("current LATEST %s: val loss %.4f on the same rows", current.target, cur_loss)
            except (IndexError, RuntimeError, ValueError) as e:  # e.g. another vocabulary than this split's
                incomparable = f"the current LATEST {current.target} cannot be scored on {val_uri}: {e}"
        elif current is not None:
            cur_loss = cand.loss  # a retried publish: LATEST already is this model
    if incomparable:
        ok = release.force_promote
        reason = (f"forced (release.force_promote); {incomparable}" if ok else
                  f"{incomparable}; set release.force_promote to publish without a comparison")
    else:
        ok, reason = decide(cand.loss, cur_loss, release.promote_tolerance, release.force_promote)
    compared: tuple[MetricComparison, ...] = ()
    if isinstance(release.promote_on, list):
        cand_scores, cur_scores = benchmark_scores(model_uri, current.target if current else None, release, storage)
        compared = compare_metrics(release.promote_on, cand_scores, cur_scores)
        ok, reason = decide_metrics(compared, current is not None, release.force_promote)
    return Promotion(
        promoted=ok, reason=reason, candidate_uri=model_uri, candidate_val_loss=cand.loss,
        current_uri=current.target if current else None, current_val_loss=cur_loss,
        tolerance=release.promote_tolerance, forced=release.force_promote, val_uri=val_uri, val_rows=cand.rows,
        val_target_tokens=cand.target_tokens, order_key=order_key,
        latest_uri=current.target if current else None, current_order_key=current.order_key if current else None,
        promote_on="val_loss" if not compared else "metrics", compared=compared,
    )


def benchmark_scores(model_uri: str, current_uri: str | None, release: ReleaseSection,
                     storage: StorageSection | None) -> tuple[BenchmarkResults, BenchmarkResults | None]:
    """Both models' scores, each from its own run's committed eval artifact (runs/<run>/eval). The
    candidate's must exist (the DAG's eval task commits it). The current LATEST's is re-scored here,
    uncommitted, only when its artifact lacks a compared task or was run with other task settings."""
    from pipeline_core.layout import eval_uri
    from training.benchmarks import read_results, score_model

    cand = read_results(eval_uri(uris.parent(model_uri)), storage)
    if cand is None or cand.model_uri.rstrip("/") != model_uri:
        raise ArtifactError(f"release.promote_on compares benchmark scores, but {eval_uri(uris.parent(model_uri))} "
                            f"holds none for {model_uri}: run the eval task (training.benchmarks) first")
    if current_uri is None:
        return cand, None
    if current_uri.rstrip("/") == model_uri:
        return cand, cand  # a retried publish: LATEST already is this model
    cur = read_results(eval_uri(uris.parent(current_uri)), storage)
    wanted = {t.task: t for t in release.eval_tasks}
    have = {t.task: t for t in cur.tasks} if cur is not None else {}
    same = all(m.task in have and have[m.task].num_fewshot == wanted[m.task].num_fewshot
               and have[m.task].limit == wanted[m.task].limit for m in release.promote_on)  # type: ignore[union-attr]
    if cur is not None and cur.model_uri.rstrip("/") == current_uri.rstrip("/") and same:
        return cand, cur
    log.info("the current LATEST %s has no committed scores for this task set: scoring it now", current_uri)
    with tempfile.TemporaryDirectory(prefix="promote-bench-") as tmp:
        return cand, score_model(require_manifest(current_uri, storage, kind="model"), release, storage, Path(tmp))


def apply(decision: Promotion, models_uri: str, storage: StorageSection | None = None, *,
          run_id: str | None = None, release: ReleaseSection | None = None, tracker: Tracker | None = None,
          registered_model: str | None = None) -> Promotion:
    """Step 3: move LATEST forward if the decision says so and LATEST still names the model the
    decision was made against (else `PointerMoved`: evaluate again); the result says where it
    points. Whatever the decision, the plain `models/LATEST` mirror is re-synced. With a tracker,
    the decision is logged to the run's MLflow run and a promoted model becomes a version of
    `registered_model` (alias `champion` forward only, by the same order key)."""
    result = move_pointer(decision, models_uri, storage, run_id=run_id,
                          max_ahead_s=(release or ReleaseSection()).max_order_key_ahead_s)
    if tracker is not None:
        track_promotion(tracker, result, registered_model)
    return result


def track_promotion(tracker: Tracker, decision: Promotion, registered_model: str | None) -> None:
    """Queue the decision's tags and numbers; register the model when LATEST now names it."""
    tracker.set_tags({"mft.order_key": decision.order_key, "mft.promotion.promoted": str(decision.promoted).lower(),
                      "mft.promotion.reason": decision.reason, "mft.model_uri": decision.candidate_uri})
    numbers = {"promotion/candidate_val_loss": decision.candidate_val_loss,
               "promotion/current_val_loss": decision.current_val_loss}
    numbers.update({f"promotion/{m.task}/{m.metric.replace(',', '_')}/worse_by": m.worse_by for m in decision.compared})
    tracker.log_values({k: v for k, v in numbers.items() if v is not None})
    if decision.promoted and registered_model and decision.latest_uri == decision.candidate_uri:
        tracker.register(registered_model, decision.candidate_uri, decision.order_key)


def promote(model_uri: str, val_uri: str, models_uri: str, order_key: str, release: ReleaseSection,
            storage: StorageSection | None = None, *, run_id: str | None = None,
            on_decision: Callable[[Promotion], None] | None = None,
            tracking: TrackingSection | None = None, tracker: Tracker | None = None) -> Promotion:
    """Evaluate and apply; a lost race (LATEST moved in between) evaluates again against the new
    LATEST. `on_decision` sees each decision before LATEST can move (the publish task stores the
    run's summary there). The decision goes to the run's MLflow run through `tracker` (the caller's)
    or, with `tracking.mlflow_uri`, one opened here."""
    check_order_key(order_key, release.max_order_key_ahead_s)  # before any download or evaluation
    own = tracker is None
    if own:
        tracker = Tracker.create(tracking, run_id or uris.name(uris.parent(model_uri)))
    try:
        return promote_gated(
            lambda: evaluate(model_uri, val_uri, models_uri, order_key, release, storage), models_uri, order_key,
            storage, run_id=run_id, max_ahead_s=release.max_order_key_ahead_s, on_decision=on_decision,
            on_result=lambda r: track_promotion(tracker, r, release.registered_model) if tracker is not None else None)
    finally:
        if own and tracker is not None:
            tracker.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Evaluate a trained model against models/LATEST and promote it if no worse.")
    p.add_argument("--model", required=True, help="committed model artifact URI (runs/<run>/model)")
    p.add_argument("--val", required=True, help="train-ready artifact URI whose val split both models are scored on")
    p.add_argument("--models", required=True, help="the models/ prefix holding LATEST")
    p.add_argument("--order-key", required=True, help="20-digit order key of this run (pointers.order_key_from_date)")
    p.add_argument("--config", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg: Config = load_config(args.config)
    result = promote(uris.require_uri(args.model, "--model"), uris.require_uri(args.val, "--val"),
                     uris.require_uri(args.models, "--models"), args.order_key, cfg.release, cfg.storage,
                     tracking=cfg.tracking)
    print(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
