"""The typed hand-offs read manifests as the current code writes them, and fail loudly on a renamed key."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pipeline_core import uris
from pipeline_core.artifacts import Manifest, read_manifest
from pipeline_core.handoffs import (
    DataReportInfo,
    EnrichedInfo,
    FileEntry,
    FilterReports,
    FilterSourceSplits,
    ReportRef,
    RowsPerSplit,
    SourcesSummary,
    StageCounts,
    TrainReadyBasics,
    TrainReadySplits,
    UnbalancedCounts,
)
from pipeline_core.names import SPLITS, Split, Stage, data_prefix
from pipeline_core.run_records import (
    DPO_COLUMNS,
    EVAL_COLUMNS,
    STEP_COLUMNS,
    DPOPointerNumbers,
    DPOPromotion,
    EvalMetrics,
    MetricComparison,
    Promotion,
    StepMetrics,
    read_decision,
    read_rows,
)

SHA = "ab" * 32

# A filtered-stage manifest exactly as pipeline_core.artifacts.Manifest.to_json writes it today.
MANIFEST_JSON = json.dumps({
    "uri": "s3://bucket/runs/r1/filtered", "kind": "filtered", "manifest_version": 2, "payload": "_attempts/a1",
    "files": [{"path": "data/part-0.parquet", "size": 1234, "sha256": SHA}],
    "counts": {"in": 10, "out": 7, "rejected": {"too_long": 2, "contaminated": 1}},
    "config": {}, "config_hash": "h", "inputs": [], "code_version": "abc", "content_sha256": SHA,
    "created_at": 1.0, "timings": {}, "extra": {},
}, indent=2, sort_keys=True).encode()


def test_counts_and_files_round_trip_a_written_manifest():
    m = Manifest.from_json(MANIFEST_JSON)
    c = StageCounts.from_manifest(m)
    assert (c.rows_in, c.rows_out, c.rejected_total, c.balanced) == (10, 7, 3, True)
    assert c.to_counts() == json.loads(MANIFEST_JSON)["counts"]
    files = FileEntry.all_of(m)
    assert [f.to_entry() for f in files] == json.loads(MANIFEST_JSON)["files"]


def test_a_renamed_count_key_fails_loudly():
    d = json.loads(MANIFEST_JSON)
    d["counts"]["rows_in"] = d["counts"].pop("in")
    with pytest.raises(ValidationError, match="in"):
        StageCounts.from_manifest(Manifest.from_json(json.dumps(d).encode()))


def test_a_count_less_artifact_has_no_counts():
    d = json.loads(MANIFEST_JSON)
    d["counts"] = {}
    assert StageCounts.of(Manifest.from_json(json.dumps(d).encode())) is None


def test_a_file_entry_without_its_hash_fails_loudly():
    d = json.loads(MANIFEST_JSON)
    del d["files"][0]["sha256"]
    with pytest.raises(ValidationError, match="sha256"):
        FileEntry.all_of(Manifest.from_json(json.dumps(d).encode()))


def test_a_manifest_reads_and_writes_back_byte_for_byte():
    m = Manifest.from_json(MANIFEST_JSON)
    assert m.to_json() == MANIFEST_JSON


def test_an_unbalanced_count_is_refused_where_rows_are_committed(tmp_path):
    from pipeline_core.artifacts import ArtifactError, publish_artifact
    from spark_jobs.common import check_counts

    lost = StageCounts(rows_in=10, rows_out=7, rejected={"too_long": 2})
    assert not lost.balanced
    with pytest.raises(UnbalancedCounts, match="in=10 != out=7 \\+ rejected=2"):
        lost.require_balanced()
    with pytest.raises(RuntimeError, match=r"\[filter\] row counts do not add up"):
        check_counts(lost, 1.0, "filter")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x").write_text("x")
    with pytest.raises(ArtifactError, match="do not add up"):
        publish_artifact(tmp_path / "p", uris.qualify(tmp_path / "store" / "a"), kind="enriched", counts=lost)
    assert read_manifest(uris.qualify(tmp_path / "store" / "a")) is None  # nothing committed


def test_counts_are_written_as_the_model_dumps_them(tmp_path):
    from pipeline_core.artifacts import publish_artifact

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x").write_text("x")
    c = StageCounts(rows_in=3, rows_out=2, rejected={"b": 1}).plus_rejected("corrupt_input_file", 4)
    m = publish_artifact(tmp_path / "p", uris.qualify(tmp_path / "a"), kind="enriched", counts=c)
    on_disk = json.loads((tmp_path / "a" / "_manifest.json").read_bytes())
    assert on_disk["counts"] == {"in": 7, "out": 2, "rejected": {"b": 1, "corrupt_input_file": 4}}
    assert StageCounts.from_manifest(read_manifest(m.uri)) == c
    assert [f.path for f in FileEntry.all_of(m)] == ["x"] and FileEntry.named(m, "x").size == 1
    ref = publish_artifact(tmp_path / "p", uris.qualify(tmp_path / "r"), kind="dpo-reference",
                           counts=RowsPerSplit(rows={"train": 3}))
    assert ref.counts == {"rows": {"train": 3}} and StageCounts.of(ref) is None


# The stage extras as the stages wrote them before the typed hand-offs (enrich: per-split counts and
# prompt sources, one configured, one not; filter: packed splits and the per-input-split fit).
ENRICHED_EXTRA = {
    "schema": "enriched", "objective": "sft",
    "splits": {"": {"in": 1, "out": 0, "rejected": {"x": 1}}, "chat": {"in": 7, "out": 5, "rejected": {"bad": 2}}},
    "prompt_sources": {
        "a/b": {"uri": "s3://x", "config_key": "enrich.prompt_sources['a/b']", "recipes": ["index"], "rows": 4,
                "files": [{"path": "s3://x/f", "size": 3, "sha256": SHA}], "downloaded_to": None,
                "restored": 3, "unrestorable": 1, "outcomes": {"missing": 1, "restored": 3}},
        "c/d": {"uri": None, "config_key": "enrich.prompt_sources['c/d']", "restored": 0, "unrestorable": 2,
                "outcomes": {"not_found": 2}}},
}
TRAIN_READY_EXTRA = {
    "splits": {"train": {"records": 11, "documents": 10, "rows": 4, "files": 1, "doc_tokens": 900, "answer_tokens": 400,
                         "truncated": 1, "slots": 1024, "packing_efficiency": 0.8789}},
    "source_splits": {"chat": {"in": 7, "out": 5, "rejected": {"too_long": 2}, "measured": 7,
                               "fit_seq_len_with_reasoning": 6, "fit_seq_len_without_reasoning": 7}},
}


def _manifest(extra: dict, counts: dict | None = None) -> Manifest:
    d = json.loads(MANIFEST_JSON)
    d["extra"] = extra
    if counts is not None:
        d["counts"] = counts
    return Manifest.from_json(json.dumps(d).encode())


def test_stage_extras_round_trip_to_the_same_json():
    en = EnrichedInfo.from_manifest(_manifest(ENRICHED_EXTRA))
    assert en.to_extra() == {k: v for k, v in ENRICHED_EXTRA.items() if k != "schema"}
    assert en.splits["chat"].rejected_total == 2 and en.prompt_sources["c/d"].recipes is None
    tr = _manifest(TRAIN_READY_EXTRA)
    assert TrainReadySplits.from_manifest(tr).to_extra() == {"splits": TRAIN_READY_EXTRA["splits"]}
    fs = FilterSourceSplits.from_manifest(tr)
    assert fs.to_extra() == {"source_splits": TRAIN_READY_EXTRA["source_splits"]}
    assert fs.source_splits["chat"].rows_out == 5


def test_old_manifests_read_with_defaults():
    old = _manifest({"schema": "enriched"}, counts={"in": 3, "out": 3})  # before objective, splits, rejected
    assert EnrichedInfo.from_manifest(old).objective == "sft" and EnrichedInfo.from_manifest(old).splits == {}
    assert StageCounts.from_manifest(old).rejected == {}
    assert TrainReadySplits.from_manifest(old).splits == {} and FilterSourceSplits.from_manifest(old).source_splits == {}
    assert DataReportInfo.from_manifest(old).headline is None
    # a packed split written before `records` (and `slots`) were recorded
    pre = _manifest({"splits": {"val": {"documents": 2, "rows": 1, "doc_tokens": 100}}})
    assert TrainReadySplits.from_manifest(pre).splits["val"].records == 0


def test_python_field_names_are_no_keys_on_disk():
    with pytest.raises(ValidationError, match="in"):
        EnrichedInfo.from_manifest(_manifest({"splits": {"chat": {"rows_in": 1, "rows_out": 1}}}))
    with pytest.raises(ValidationError):
        ReportRef.read({"uri": "u", "page": "p", "headline": {"records_in": 1, "enriched": 1}})  # no `kept`


def test_metrics_columns_are_the_header_the_trainer_writes(tmp_path):
    from training.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.csv", None)
    log.add({"step": 1, "loss": 2.5, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 10.0, "step_time_s": 0.1,
             "target_tokens": 7, "skipped": 0})
    log.add_eval({"step": 1, "eval_loss": 2.0, "eval_pairs": 4, "eval_reward_accuracy": 0.5})
    text = (tmp_path / "metrics.csv").read_text()
    assert text.splitlines()[0] == ",".join(STEP_COLUMNS)
    assert (tmp_path / "eval.csv").read_text().splitlines()[0] == ",".join(EVAL_COLUMNS)
    assert EVAL_COLUMNS[-len(DPO_COLUMNS):] == tuple(f"eval_{c}" for c in DPO_COLUMNS)
    (row,) = read_rows(StepMetrics, text)
    assert (row.step, row.loss, row.target_tokens, row.mfu, row.reward_accuracy) == (1, 2.5, 7, None, None)
    (ev,) = read_rows(EvalMetrics, (tmp_path / "eval.csv").read_text())
    assert (ev.eval_pairs, ev.eval_reward_accuracy, ev.eval_perplexity) == (4, 0.5, None)


def test_a_stored_decision_reads_back_as_its_gate_s_model():
    sft = Promotion(promoted=True, reason="r", candidate_uri="c", current_uri=None, val_uri="v", order_key="k",
                    forced=False, candidate_val_loss=1.0, current_val_loss=None, tolerance=0.0, val_rows=3,
                    val_target_tokens=9, compared=(MetricComparison(task="t", metric="acc", candidate=0.5, current=None,
                                                                   min_delta=0.0, higher_is_better=True, worse_by=None,
                                                                   ok=True),))
    stored = json.loads(json.dumps(sft.to_dict()))
    assert read_decision(stored) == sft and stored["compared"][0]["metric"] == "acc"
    dpo = DPOPromotion(promoted=False, reason="r", candidate_uri="c", current_uri="p", val_uri="v", order_key="k",
                       forced=False, reward_accuracy=0.6, reward_margin=0.1, current_reward_accuracy=None,
                       current_reward_margin=None, reference_uri="ref")
    assert read_decision(json.loads(json.dumps(dpo.to_dict()))) == dpo
    assert DPOPointerNumbers.read(dpo.pointer_extra()).reward_accuracy == 0.6
    assert sft.pointer_extra() == {"val_uri": "v", "val_loss": 1.0, "previous": None}


def test_stage_and_split_names_are_their_strings():
    assert json.dumps([Stage.TRAIN, Split.VAL]) == '["train", "val"]'
    assert f"{Split.VAL}" == "val" and data_prefix(Split.TRAIN) == "data/train/"
    assert tuple(SPLITS) == ("train", "val")


def test_the_run_summary_s_sources_are_stored_as_json_and_read_back(tmp_path):
    """plugins/mft_airflow/summary.py: what `_sources` stores is plain JSON, and `_fmt_sources` reads it back."""
    from types import SimpleNamespace

    from pipeline_core.artifacts import publish_artifact
    from plugins.mft_airflow.summary import _fmt_sources, _sources

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x").write_text("x")
    en = publish_artifact(tmp_path / "p", uris.qualify(tmp_path / "en"), kind="enriched", extra=ENRICHED_EXTRA,
                          counts=StageCounts(rows_in=8, rows_out=5, rejected={"bad": 2, "x": 1}))
    tr = publish_artifact(tmp_path / "p", uris.qualify(tmp_path / "tr"), kind="train-ready", extra=TRAIN_READY_EXTRA,
                          counts=StageCounts(rows_in=5, rows_out=3, rejected={"too_long": 2}))
    stored = json.loads(json.dumps(_sources(SimpleNamespace(enriched_uri=en.uri, train_ready_uri=tr.uri), None).to_summary()))
    assert stored["prompt_sources"] == ENRICHED_EXTRA["prompt_sources"]
    assert stored["splits"]["chat"] == {"in": 7, "rejected": {"enrich:bad": 2, "filter:too_long": 2}, "kept": 5,
                                        "measured": 7, "fit_with": 6, "fit_without": 7}
    lines = _fmt_sources(SourcesSummary.read(stored))
    assert "  prompts c/d: 0 restored, 2 unrestorable <- not configured (enrich.prompt_sources['c/d'])" in lines
    assert any(line.startswith("  split   chat: in 7, kept 5; fit seq_len 6 with reasoning") for line in lines)


def _summary(promotion) -> dict:
    return {"dataset_version": "v", "run_id": "r", "objective": "dpo", "source_uri": "file:///s",
            "enrich": {"uri": "file:///e", "counts": {"in": 3, "out": 2, "rejected": {"x": 1}}},
            "filter": {"uri": "file:///f", "committed": False, "counts": None},
            "model": {"uri": "file:///m", "files": 2, "bytes": 10}, "promotion": promotion}


def test_the_run_summary_reads_its_decision_as_the_gate_s_model():
    """pipeline_summary.json / the publish XCom: the promotion comes back typed (DPO or SFT), the stage
    counts as StageCounts, and the model writes the same JSON back."""
    from pipeline_core.run_records import RunSummary

    dpo = DPOPromotion(promoted=True, reason="r", candidate_uri="c", current_uri=None, val_uri="v", order_key="k",
                       forced=False, reward_accuracy=0.6, reward_margin=0.1, current_reward_accuracy=None,
                       current_reward_margin=None, reference_uri=None)
    s = RunSummary.read(json.loads(json.dumps(_summary(dpo.to_dict()))))
    assert isinstance(s.promotion, DPOPromotion) and s.promotion == dpo and s.promotion.promoted
    assert s.enrich.stage_counts == StageCounts(rows_in=3, rows_out=2, rejected={"x": 1}) and s.filter.counts is None
    assert RunSummary.read(json.loads(json.dumps(s.to_json_dict()))) == s
    assert s.to_json_dict()["enrich"]["counts"] == {"in": 3, "out": 2, "rejected": {"x": 1}}  # the manifest's keys
    assert RunSummary.read(_summary(None)).promotion is None
    sources = {"prompt_sources": {"c/d": {"config_key": "k", "restored": 1}}}  # stored as counted: no empty keys
    assert RunSummary.read({**_summary(None), "sources": sources}).to_json_dict()["sources"] == sources
    with pytest.raises(ValidationError):  # a partial decision is refused, not half-read
        RunSummary.read(_summary({"promoted": True, "reason": "r"}))


def _near_dup_report():
    from spark_jobs.near_dups.dedup_types import NearDupReport, RecallEstimate, SavedPair

    return NearDupReport(method="cluster", rows=40, threshold=0.95, parameters={"cluster_size": 2000, "probes": 2},
                         measured=RecallEstimate(20, 5, 5, 1.0, 0.5655, 1.0), clusters=1, largest_cluster=40,
                         mean_cluster=40.0, split_clusters=0, assignment_agreement=1, warnings=("w",),
                         guard_saved_pairs=1, guard_saved_rows=1, guard_saved_by_split={"train": 1},
                         guard_saved_examples=(SavedPair("train", "b", "a", 0.97),), dropped_by_split={"val": 2})


def test_the_near_duplicate_report_is_written_as_the_dataclass_was():
    """extra.near_duplicates through FilterReports: the same JSON as the dataclass's own (asdict) form,
    an int stays an int; the data report reads the guard's numbers back typed."""
    from dataclasses import asdict

    r = _near_dup_report()
    before = {**asdict(r), "warnings": list(r.warnings), "guard_saved_examples": [asdict(p) for p in r.guard_saved_examples]}
    extra = FilterReports(near_duplicates=r.as_manifest()).to_extra()
    assert list(extra) == ["near_duplicates"]  # only what the writer set
    assert json.dumps(extra["near_duplicates"], sort_keys=True) == json.dumps(before, sort_keys=True)
    back = FilterReports.from_manifest(_manifest(json.loads(json.dumps(extra)))).near_duplicates
    assert back.guard_saved_examples[0].other_id == "a" and back.measured.low_95 == 0.5655
    assert FilterReports.from_manifest(_manifest({"near_duplicates": None})).near_duplicates is None


def test_length_fit_and_the_pre_train_ready_info_keys_read_through_models():
    lf = {"seq_len": 64, "overflow": "reject", "with_reasoning": False,
          "splits": {"math": {"rendered": 5, "fit": 4, "fit_without_reasoning": 5, "reasoning_dropped": 0, "kept": 4}}}
    m = _manifest({"length_fit": lf, "seq_len": 64, "tokenizer": {"spec": "mistral-v1"}, "packing_efficiency": 0.5})
    fit = FilterReports.from_manifest(m).length_fit
    assert fit.splits["math"].fit == 4 and FilterReports(length_fit=fit).to_extra() == {"length_fit": lf}
    old = TrainReadyBasics.from_manifest(m)
    assert (old.seq_len, old.tokenizer.spec, old.packing_efficiency) == (64, "mistral-v1", 0.5)
    assert TrainReadyBasics.from_manifest(_manifest({})).tokenizer is None
