"""Benchmarks after training (issue 31.2): the real lm-evaluation-harness (HF backend, CPU) on a tiny
exported Mistral with the bundled local YAML task; scores land in the committed eval artifact."""

from __future__ import annotations

import json

import pytest

from pipeline_core import layout, uris
from pipeline_core.artifacts import fetch_artifact, publish_artifact, read_manifest, verify_artifact
from pipeline_core.config import PROJECT_ROOT, load_config
from pipeline_core.handoffs import BenchmarkResults
from tests.report_helpers import tiny_models

TINY_QA = uris.qualify(PROJECT_ROOT / "sample_data" / "eval" / "tiny_qa.yaml")
LIMIT = 6


def release(**kw):
    return load_config(env={}, overrides={"release": {
        "eval_tasks": [{"task": "tiny_qa", "yaml": TINY_QA, "limit": LIMIT}], "eval_batch_size": 4, **kw}}).release


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    store = uris.qualify(root / "store")
    out = {}
    for name, d in tiny_models(root / "models").items():
        out[name] = uris.join(store, "runs", name, "model")
        publish_artifact(d, out[name], kind="model")
    return root, out


def test_lm_eval_scores_land_in_the_eval_artifact(models):
    from training.benchmarks import RESULTS, evaluate

    root, uri = models
    run = uris.parent(uri["good"])
    m = evaluate(uri["good"], layout.eval_uri(run), release())
    assert m.kind == "eval" and m.uri == layout.eval_uri(run) and [i["uri"] for i in m.inputs] == [uri["good"]]
    verify_artifact(m.uri)
    res = BenchmarkResults.from_manifest(m)
    (t,) = res.tasks
    assert t.task == "tiny_qa" and t.samples == LIMIT and t.num_fewshot == 0 and t.yaml_sha256
    acc = res.score("tiny_qa", "acc")
    assert acc is not None and 0.0 <= acc.value <= 1.0 and acc.stderr is not None
    assert res.score("tiny_qa", "acc,none") == acc and res.score("tiny_qa", "acc_norm") is not None
    assert t.higher_is_better["acc"] is True
    assert res.model_manifest_sha256 == read_manifest(uri["good"]).sha256
    local = root / "fetched"
    fetch_artifact(m.uri, local)
    assert json.loads((local / RESULTS).read_text())["tasks"][0]["metrics"]["acc,none"]["value"] == acc.value
    samples = (local / "data" / "samples" / "tiny_qa.jsonl").read_text().splitlines()
    assert len(samples) == LIMIT and {"doc", "acc"} <= json.loads(samples[0]).keys()
    # committed: the same model and tasks are a no-op, another task set is refused (immutable)
    assert evaluate(uri["good"], m.uri, release()).sha256 == m.sha256
    from pipeline_core.artifacts import ArtifactConflict

    with pytest.raises(ArtifactConflict):
        evaluate(uri["good"], m.uri, release(eval_tasks=[{"task": "tiny_qa", "yaml": TINY_QA, "limit": 2}]))


def test_local_yaml_task_cannot_reach_outside_its_directory(tmp_path):
    from training.benchmarks import task_config

    y = tmp_path / "t.yaml"
    y.write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: ../../etc/passwd\n")
    spec = load_config(env={}, overrides={"release.eval_tasks": [{"task": "t", "yaml": uris.qualify(y)}]}).release
    with pytest.raises(Exception, match=r"\.\."):
        task_config(spec.eval_tasks[0], tmp_path / "w", None)
    y.write_text("task: t\nprocess_docs: !function utils.process\n")
    with pytest.raises(ValueError, match="plain YAML"):
        task_config(spec.eval_tasks[0], tmp_path / "w", None)
