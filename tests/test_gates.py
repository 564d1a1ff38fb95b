"""The approval request's text and the recorded decision, without a scheduler (the full gate runs
under Airflow in tests/test_ui_gate.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline_core.handoffs import ReportRef
from plugins.mft_airflow.approval import approval_record, gate_text
from plugins.mft_airflow.report_task import NOTE_MAX_CHARS, run_note
from plugins.mft_airflow.run_plan import RunPlan

PLAN = RunPlan(config_file="/tmp/cfg.yaml", dataset_version="20260101", run_id="r1", source_uri="s3://b/src",
               store_uri="s3://b", enriched_uri="s3://b/datasets/20260101/enriched/abc",
               train_ready_uri="s3://b/datasets/20260101/train/abc", run_uri="s3://b/runs/r1",
               model_uri="s3://b/runs/r1/model", models_uri="s3://b/models", trainer_name="mft-train-r1")
# the data report task's XCom, as the approval gate reads it back
REPORT = ReportRef.read({"uri": "s3://b/datasets/20260101/report/abc", "page": "s3://b/datasets/20260101/report/abc/data/index.html", "headline": {
    "records_in": 300, "enriched": 286, "kept": 253, "rejected": {"filter:near_duplicate": 21},
    "tokens": {"train": 11937, "val": 2960}, "seq_len": 256, "val_documents": 48, "packing_efficiency": 0.9699}})


def test_request_shows_the_headline_numbers_and_the_report_link():
    subject, body = gate_text(PLAN, REPORT)
    assert subject == "Train r1 on dataset 20260101?"
    for text in (REPORT.page, "300 → 286 → 253", "filter:near_duplicate 21", "train 11,937", "val 2,960",
                 "| val documents | 48 |", "97.0%"):
        assert text in body, text
    assert "No data report" in gate_text(PLAN, None)[1]


def test_decision_record_keeps_who_when_and_why():
    at = datetime(2026, 1, 1, 3, tzinfo=UTC)
    rec = approval_record(PLAN, {"chosen_options": ["Reject"], "params_input": {"reason": "too many dups"},
                                 "responded_by_user": {"id": "u1", "name": "ana"}, "responded_at": at}, approved=False)
    assert rec["decision"] == "rejected" and rec["reason"] == "too many dups"
    assert rec["by"] == {"id": "u1", "name": "ana"} and rec["at"] == at.isoformat()
    assert approval_record(PLAN, {"params_input": {"reason": {"value": "ok"}}}, approved=True)["reason"] == "ok"


def test_run_note_links_the_report_keeps_a_written_note_and_is_not_repeated():
    note = run_note(None, REPORT)
    assert f"[{REPORT.page}]({REPORT.page})" in note and "300 records → 286 enriched → 253 kept" in note
    assert "train 11,937" in note and "packing 97.0%" in note
    kept = run_note("checked by ana", REPORT)
    assert kept.startswith("checked by ana\n\n") and kept.endswith(note)
    assert run_note(kept, REPORT) is None  # a retry of data_report adds nothing
    assert len(run_note("x" * NOTE_MAX_CHARS, REPORT)) <= NOTE_MAX_CHARS  # the API refuses longer notes


def test_links_open_the_api_servers_copy_of_the_report_when_there_is_one():
    """The store's URI stays the text; a browser follows the API server's route for the run's report
    (plugins/mft_airflow/report_views.py) when `[api] base_url` gave one."""
    from plugins.mft_airflow.report_links import report_view_url

    view = report_view_url("http://airflow.example:8080/", "mistral_finetune", "manual__2026-01-01T02:00:00+00:00")
    assert view == ("http://airflow.example:8080/mft-reports/mistral_finetune/"
                    "manual__2026-01-01T02%3A00%3A00%2B00%3A00/data/index.html")
    served = REPORT.model_copy(update={"view": view})
    assert f"[{REPORT.page}]({view})" in run_note(None, served)
    assert f"[{REPORT.page}]({view})" in gate_text(PLAN, served)[1]
    assert f"[{REPORT.page}]({REPORT.page})" in run_note(None, REPORT.model_copy(update={"view": None}))
