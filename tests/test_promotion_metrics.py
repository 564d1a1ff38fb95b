"""Promotion on benchmark scores (issue 31.3): `release.promote_on` metrics compared between the new
model's and the current LATEST's own committed eval artifacts; a worse score blocks promotion and
the decision names every metric compared. Real tiny models, a local store, the real val-loss pass."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pipeline_core import layout, uris
from pipeline_core.artifacts import ArtifactError, publish_artifact
from pipeline_core.config import PROJECT_ROOT, load_config
from pipeline_core.handoffs import BenchmarkResults, MetricScore, TaskScores
from pipeline_core.pointers import order_key_from_date, read_pointer
from tests.report_helpers import tiny_models, val_artifact
from training.promote import promote

TINY_QA = uris.qualify(PROJECT_ROOT / "sample_data" / "eval" / "tiny_qa.yaml")
DAY = datetime(2026, 1, 1, 2, tzinfo=UTC)


def _key(days: int) -> str:
    return order_key_from_date(DAY + timedelta(days=days))


def release(**kw):
    return load_config(env={}, overrides={"release": {
        "eval_tasks": [{"task": "tiny_qa", "yaml": TINY_QA, "limit": 4}],
        "promote_on": [{"task": "tiny_qa", "metric": "acc", "min_delta": 0.05}], **kw}}).release


def scores(model_uri: str, acc: float, work) -> None:
    """Commit runs/<run>/eval for `model_uri` with the given accuracy (a forced score)."""
    from pipeline_core.artifacts import read_manifest

    res = BenchmarkResults(model_uri=model_uri, model_manifest_sha256=read_manifest(model_uri).sha256,
                           harness_version="test", tasks=(TaskScores(
                               task="tiny_qa", num_fewshot=0, limit=4, samples=4,
                               metrics={"acc,none": MetricScore(value=acc, stderr=0.1)},
                               higher_is_better={"acc": True}),))
    d = work / uris.name(uris.parent(model_uri))
    (d / "data").mkdir(parents=True)
    (d / "data" / "results.json").write_text(res.model_dump_json())
    publish_artifact(d, layout.eval_uri(uris.parent(model_uri)), kind="eval", extra=res.to_extra())


@pytest.fixture
def store(tmp_path):
    root = uris.qualify(tmp_path / "store")
    models = tiny_models(tmp_path / "m")
    uri = {}
    for run, src in (("r1", models["good"]), ("r2", models["good"]), ("r3", models["good"])):
        uri[run] = uris.join(root, "runs", run, "model")
        publish_artifact(src, uri[run], kind="model")
    val = val_artifact(tmp_path / "train-ready", uris.join(root, "datasets", "v1", "train", "abc"), None)
    return root, uri, val, tmp_path / "evals"


def test_a_worse_score_blocks_promotion_and_the_decision_names_the_metric(store):
    root, uri, val, work = store
    models = uris.join(root, "models")
    scores(uri["r1"], 0.75, work)
    first = promote(uri["r1"], val, models, _key(0), release())
    assert first.promoted and first.promote_on == "metrics" and "no model is published yet" in first.reason
    assert read_pointer(models).target == uri["r1"]

    scores(uri["r2"], 0.50, work)  # 0.25 worse > min_delta 0.05
    d = promote(uri["r2"], val, models, _key(1), release())
    assert not d.promoted and read_pointer(models).target == uri["r1"]
    (m,) = d.compared
    assert (m.task, m.metric, m.candidate, m.current, m.min_delta, m.ok) == ("tiny_qa", "acc", 0.5, 0.75, 0.05, False)
    assert m.worse_by == pytest.approx(0.25) and "tiny_qa/acc 0.5000 vs 0.7500" in d.reason and "worse by 0.2500" in d.reason
    assert d.to_dict()["compared"][0]["metric"] == "acc"  # in the decision record (pipeline_summary.json)

    scores(uri["r3"], 0.72, work)  # 0.03 worse: within min_delta
    ok = promote(uri["r3"], val, models, _key(2), release())
    assert ok.promoted and read_pointer(models).target == uri["r3"] and ok.compared[0].ok


def test_force_promote_and_missing_scores(store):
    root, uri, val, work = store
    models = uris.join(root, "models")
    with pytest.raises(ArtifactError, match="run the eval task"):
        promote(uri["r1"], val, models, _key(0), release())  # the candidate has no eval artifact
    scores(uri["r1"], 0.75, work)
    scores(uri["r2"], 0.10, work)
    promote(uri["r1"], val, models, _key(0), release())
    forced = promote(uri["r2"], val, models, _key(1), release(force_promote=True))
    assert forced.promoted and forced.reason.startswith("forced") and "tiny_qa/acc" in forced.reason


def test_val_loss_rule_is_unchanged_by_default(store):
    root, uri, val, _ = store
    d = promote(uri["r1"], val, uris.join(root, "models"), _key(0), load_config(env={}).release)
    assert d.promoted and d.promote_on == "val_loss" and d.compared == ()


def test_summary_shows_scores_decontamination_and_the_metric_decision():
    import json

    from pipeline_core.run_records import Promotion, RunSummary
    from plugins.mft_airflow.summary import format_summary

    counts = {"in": 10, "out": 7, "rejected": {"contaminated": 3}}
    s = {"dataset_version": "v", "run_id": "r", "source_uri": "file:///s",
         "enrich": {"uri": "file:///e", "counts": counts},
         "filter": {"uri": "file:///f", "counts": counts, "decontamination": {
             "ngram": 13, "threshold": 0.0, "answers": False, "eval_sets": [
                 {"name": "tiny_qa", "uri": "file:///q.jsonl", "sha256": "ab" * 32, "files": 1, "documents": 16,
                  "documents_too_short": 0, "rows_removed": 3}]}},
         "train": {"run_uri": "file:///r"}, "model": {"uri": "file:///r/model", "files": 3, "bytes": 2e6},
         "eval": {"uri": "file:///r/eval", "model_uri": "file:///r/model", "model_manifest_sha256": "cd" * 32,
                  "harness_version": "0.4", "tasks": [{"task": "tiny_qa", "num_fewshot": 0, "samples": 16, "metrics": {
                      "acc,none": {"value": 0.25, "stderr": 0.11}}}]},
         "promotion": Promotion(
             promoted=False, promote_on="metrics", candidate_val_loss=9.1, current_val_loss=9.0,
             reason="tiny_qa/acc 0.2500 vs 0.7500 (min_delta 0.05): worse by 0.5000", candidate_uri="file:///r/model",
             current_uri="file:///old/model", val_uri="file:///f", order_key="0" * 20, forced=False, tolerance=0.0,
             val_rows=4, val_target_tokens=40).to_dict()}
    text = format_summary(RunSummary.read(json.loads(json.dumps(s))))  # as stored in pipeline_summary.json
    assert "decontaminated (13-grams) against tiny_qa (16 docs, sha256 abababababab): 3 removed" in text
    assert "eval    tiny_qa (0-shot, 16 samples): acc 0.2500 ± 0.1100" in text
    assert "NOT promoted on benchmark scores" in text and "tiny_qa/acc 0.2500 vs 0.7500" in text
