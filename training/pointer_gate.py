"""The one promotion loop behind every forward-only model pointer (`models/LATEST`, `models/dpo/LATEST`).

A gate (the SFT val-loss/benchmark rule in `training.promote`, the DPO reward rule in
`training.dpo_promote`) evaluates a candidate against the record the pointer names and returns a
decision that keeps that record (`current_uri`, `current_order_key`). `promote_gated` then moves
the pointer only from that record (`pointers.advance(compared_with=...)`, a compare-and-swap on the
record's successor slot): when another publish moved the pointer in between, nothing is written and
the gate runs again against the new record, up to `REEVALUATIONS` times. Whatever the decision, the
plain `LATEST` mirror is re-synced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from pipeline_core.pointers import PointerMoved, PointerRecord, advance, check_order_key, sync_mirror
from pipeline_core.run_records import Decision

if TYPE_CHECKING:
    from pipeline_core.config import StorageSection

log = logging.getLogger("training.promote")

REEVALUATIONS = 3  # lost compare-and-swap races before a publish gives up (the pointer is left as it is)


D = TypeVar("D", bound=Decision)


def compared_record(decision: Decision) -> PointerRecord | None:
    """The record the decision was made against, as `advance(compared_with=...)` identifies it."""
    if decision.current_uri is None:
        return None
    return PointerRecord(target=decision.current_uri, manifest_sha256="", order_key=decision.current_order_key or "")


def move_pointer(decision: D, pointer_uri: str, storage: StorageSection | None, *, run_id: str | None,
                 max_ahead_s: float | None) -> D:
    """Move the pointer forward if the decision says so and the pointer still names the record the
    decision was made against (else `PointerMoved`: evaluate again); the result says where it points."""
    if not decision.promoted:
        pointer = sync_mirror(pointer_uri, storage)  # a publisher killed before its mirror write is repaired here too
        return decision.model_copy(update={"latest_uri": pointer.target if pointer else None})
    moved = advance(pointer_uri, decision.candidate_uri, decision.order_key, storage, run_id=run_id,
                    extra=decision.pointer_extra(), compared_with=compared_record(decision), max_ahead_s=max_ahead_s)
    latest = moved.current.target if moved.current else decision.latest_uri
    if moved.moved:
        return decision.model_copy(update={"latest_uri": latest})
    return decision.model_copy(update={"promoted": False, "latest_uri": latest,
                                       "reason": f"{decision.reason}; not moved: {moved.reason}"})


def promote_gated(evaluate: Callable[[], D], pointer_uri: str, order_key: str, storage: StorageSection | None, *,
                  run_id: str | None = None, max_ahead_s: float | None = None,
                  on_decision: Callable[[D], None] | None = None,
                  on_result: Callable[[D], None] | None = None) -> D:
    """Evaluate (the gate reads the pointer itself) and move; a lost race evaluates again against the
    new record. `on_decision` sees each decision before the pointer can move (the publish task stores
    the run's summary there); `on_result` the final one when the move was attempted."""
    check_order_key(order_key, max_ahead_s)  # before any download or evaluation
    for _ in range(REEVALUATIONS):
        decision = evaluate()
        if on_decision is not None:
            on_decision(decision)
        try:
            result = move_pointer(decision, pointer_uri, storage, run_id=run_id, max_ahead_s=max_ahead_s)
        except PointerMoved as e:
            log.warning("%s; evaluating %s again against the new %s/LATEST", e, decision.candidate_uri, pointer_uri)
            lost = e
            continue
        if on_result is not None:
            on_result(result)
        return result
    return decision.model_copy(update={
        "promoted": False, "latest_uri": lost.current.target if lost.current else None,
        "reason": f"{decision.reason}; not moved: LATEST moved {REEVALUATIONS} times while this run was "
                  f"evaluated ({lost}); publish again to compare with it"})
