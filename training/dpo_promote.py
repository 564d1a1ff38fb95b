"""Promotion of a DPO run's model to `models/dpo/LATEST`: the DPO gate on the same promotion loop
as `training.promote` (`training.pointer_gate`: forward only, compare-and-swap against the record
the gate evaluated, a lost race evaluates again).

Gate (docs/dpo.md): the run's validation reward accuracy and margin, from its committed report
(computed by the trainer on the val pairs against the committed reference log-probs):
  - reward accuracy >= `train.dpo.min_val_reward_accuracy` and margin > 0;
  - when the promoted DPO model was evaluated on the same val pairs (same train-ready artifact, same
    reference: its pointer record says so), accuracy and margin no worse than its own;
  - `release.force_promote` publishes regardless.
The pointer record keeps the numbers and the pairs they were measured on for the next comparison.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline_core import layout
from pipeline_core.artifacts import ArtifactError, require_manifest
from pipeline_core.config import DPOSettings, ReleaseSection, StorageSection
from pipeline_core.pointers import read_pointer
from pipeline_core.run_records import DPOPointerNumbers, DPOPromotion, RunReportInfo
from training.pointer_gate import move_pointer, promote_gated


def decide(acc: float | None, margin: float | None, current: DPOPointerNumbers | None, min_acc: float,
           forced: bool) -> tuple[bool, str]:
    """The rule alone; `current`: the promoted model's numbers on the same pairs (None: none to compare)."""
    if acc is None or margin is None:
        return forced, "the run's report has no validation reward metrics (train.eval_batches 0?)"
    problems = []
    if acc < min_acc:
        problems.append(f"val reward accuracy {acc:.4f} < train.dpo.min_val_reward_accuracy={min_acc:g}")
    if margin <= 0:
        problems.append(f"val reward margin {margin:.4f} <= 0")
    if current is not None:
        if acc < current.reward_accuracy:
            problems.append(f"val reward accuracy {acc:.4f} < the promoted DPO model's {current.reward_accuracy:.4f}")
        if margin < current.reward_margin:
            problems.append(f"val reward margin {margin:.4f} < the promoted DPO model's {current.reward_margin:.4f}")
    if not problems:
        return True, f"val reward accuracy {acc:.4f}, margin {margin:.4f}" + (
            " (no worse than the promoted DPO model's on the same pairs)" if current else "")
    if forced:
        return True, "forced (release.force_promote): " + "; ".join(problems)
    return False, "; ".join(problems) + "; set release.force_promote to publish it anyway"


def evaluate(model_uri: str, run_uri: str, val_uri: str, models_uri: str, order_key: str, release: ReleaseSection,
             dpo: DPOSettings, storage: StorageSection | None = None) -> DPOPromotion:
    require_manifest(model_uri, storage, kind="model")
    report = require_manifest(layout.report_uri(run_uri), storage, kind="report")
    info = RunReportInfo.from_manifest(report)
    if "eval_reward_accuracy" not in info.model_fields_set:
        raise ArtifactError(f"{layout.report_uri(run_uri)} is not a DPO run's report (no eval_reward_accuracy)")
    acc, margin, ref = info.eval_reward_accuracy, info.eval_reward_margin, info.reference_uri
    pointer = read_pointer(models_uri, storage)
    same = None
    kept = DPOPointerNumbers.of(pointer) if pointer is not None and pointer.target != model_uri else None
    if kept is not None and kept.val_uri == val_uri and kept.reference_uri == ref:
        same = kept
    ok, reason = decide(acc, margin, same, dpo.min_val_reward_accuracy, release.force_promote)
    if pointer is not None and same is None and pointer.target != model_uri:
        reason += " (the promoted DPO model was measured on other pairs: not compared)"
    return DPOPromotion(promoted=ok, reason=reason, candidate_uri=model_uri, reward_accuracy=acc, reward_margin=margin,
                        current_uri=pointer.target if pointer else None,
                        current_reward_accuracy=same.reward_accuracy if same else None,
                        current_reward_margin=same.reward_margin if same else None, val_uri=val_uri, reference_uri=ref,
                        order_key=order_key, forced=release.force_promote, latest_uri=pointer.target if pointer else None,
                        current_order_key=pointer.order_key if pointer else None)


def apply(decision: DPOPromotion, models_uri: str, storage: StorageSection | None = None, *,
          run_id: str | None = None, release: ReleaseSection | None = None) -> DPOPromotion:
    """Move `models/dpo/LATEST` if the decision says so and the pointer still names the record it was
    made against (else `PointerMoved`: evaluate again)."""
    return move_pointer(decision, models_uri, storage, run_id=run_id,
                        max_ahead_s=(release or ReleaseSection()).max_order_key_ahead_s)


def promote(model_uri: str, run_uri: str, val_uri: str, models_uri: str, order_key: str, release: ReleaseSection,
            dpo: DPOSettings, storage: StorageSection | None = None, *, run_id: str | None = None,
            on_decision: Callable[[DPOPromotion], None] | None = None) -> DPOPromotion:
    """Evaluate and apply through the shared loop: a lost race (the pointer moved in between)
    evaluates again against the new promoted DPO model."""
    return promote_gated(lambda: evaluate(model_uri, run_uri, val_uri, models_uri, order_key, release, dpo, storage),
                         models_uri, order_key, storage, run_id=run_id, max_ahead_s=release.max_order_key_ahead_s,
                         on_decision=on_decision)
