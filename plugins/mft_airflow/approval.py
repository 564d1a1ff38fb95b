"""The human approval gate before training: `ApprovalGateOperator`.

Airflow's own `ApprovalOperator` (standard provider, HITL, 3.1+), on only when
`release.require_approval` is set (the `require_approval` param; off by default, so scheduled runs
never wait). It shows the data report's headline numbers and link (`report_task.py`'s XCom) in the
Required Actions UI; "Reject" skips train and publish, and the decision (who, when, the reason typed
in the form) is written to `runs/<run_id>/approval.json` (through `ArtifactStoreHook`) and returned
in XCom. It subclasses the provider's operator (no operator nested inside another: the Task SDK
warns about that in the task log).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk.exceptions import AirflowSkipException

from pipeline_core.handoffs import ReportRef
from pipeline_core.names import Stage
from plugins.mft_airflow.report_links import REPORT_TASK_ID
from plugins.mft_airflow.report_task import report_link
from plugins.mft_airflow.run_plan import RunPlan

APPROVAL_RECORD = "approval.json"
REASON = "reason"


def _plan(context: Any) -> RunPlan:
    from plugins.mft_airflow.stage_base import pull_plan

    return pull_plan(context)


def gate_text(plan: RunPlan, report: ReportRef | None) -> tuple[str, str]:
    """(subject, Markdown body) of the approval request."""
    subject = f"Train {plan.run_id} on dataset {plan.dataset_version}?"
    if report is None:
        return subject, f"No data report was committed for `{plan.train_ready_uri}`."
    h = report.headline
    if h is None:
        return subject, f"**Data report**: {report_link(report)} (no headline figures)"
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(h.rejected.items())) or "none"
    tokens = ", ".join(f"{k} {v:,}" for k, v in sorted(h.tokens.items()))
    eff = h.packing_efficiency
    body = "\n".join([
        f"**Data report**: {report_link(report)}",
        "",
        "| | |", "|---|---|",
        f"| records in → enriched → kept | {h.records_in} → {h.enriched} → {h.kept} |",
        f"| rejected | {rejected} |",
        f"| tokens | {tokens} (seq_len {h.seq_len}) |",
        f"| val documents | {h.val_documents} |",
        f"| packing efficiency | {eff:.1%} |" if eff is not None else "| packing efficiency | n/a |",
        "",
        f"Approve to train `{plan.run_id}` on `{plan.train_ready_uri}`; Reject ends the run without "
        "training (give the reason).",
    ])
    return subject, body


class ApprovalGateOperator(ApprovalOperator):
    """Approve / Reject before training, when `release.require_approval` is set: the provider's own
    operator (its `execute` waits for the human, its `execute_complete` validates the answer and,
    on Reject, skips everything downstream); this subclass only fills in the subject and body from
    the run's data report and records the decision."""

    ui_color = "#fde2e2"

    def __init__(self, **kwargs: Any) -> None:
        from airflow.sdk import Param

        kwargs.setdefault("subject", "Approve training")
        kwargs.pop("params", None)  # the form asks for the reason only (DAG-level params are not the human's input)
        super().__init__(
            ignore_downstream_trigger_rules=True,  # Reject skips train and publish, whatever their trigger rules
            params={REASON: Param("", type="string", title="Reason", description="Why (kept with the decision)")},
            **kwargs)

    def _report(self, context: Any) -> ReportRef | None:
        pulled = context["ti"].xcom_pull(task_ids=REPORT_TASK_ID)
        return ReportRef.read(pulled) if pulled else None

    def execute(self, context: Any) -> Any:
        from plugins.mft_airflow.plan import load_plan_config

        plan = _plan(context)
        if not plan.runs(Stage.TRAIN):
            raise AirflowSkipException("no training in this run; nothing to approve")
        if not load_plan_config(plan).release.require_approval:
            raise AirflowSkipException("release.require_approval is off: training needs no approval")
        self.subject, self.body = gate_text(plan, self._report(context))
        return super().execute(context)  # writes the request, waits for a human

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        from plugins.mft_airflow.plan import load_plan_config

        plan = _plan(context)
        chosen = (event.get("chosen_options") or [None])[0]
        record = approval_record(plan, event, approved=chosen == self.APPROVE)
        write_approval(plan.run_uri, record, load_plan_config(plan).storage)
        self.log.info("approval: %s", json.dumps(record))
        super().execute_complete(context, event)  # validates; on Reject skips the downstream tasks
        return record


def approval_record(plan: RunPlan, event: dict[str, Any], approved: bool) -> dict[str, Any]:
    params = event.get("params_input") or {}
    reason = params.get(REASON)
    if isinstance(reason, dict):  # serialized Param form
        reason = reason.get("value")
    at = event.get("responded_at")
    return {"approved": approved, "decision": "approved" if approved else "rejected", "reason": reason or "",
            "by": event.get("responded_by_user"), "at": at.isoformat() if isinstance(at, datetime) else at,
            "timed_out": bool(event.get("timedout")), "dataset_version": plan.dataset_version,
            "train_ready_uri": plan.train_ready_uri}


def write_approval(run_uri: str, record: dict[str, Any], storage: Any) -> None:
    from plugins.mft_airflow.hooks import ArtifactStoreHook

    ArtifactStoreHook(storage).put(run_uri, APPROVAL_RECORD, json.dumps(record, indent=2, sort_keys=True).encode())
