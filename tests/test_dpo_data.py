"""Preference data through enrich and filter (issue 30): every accepted shape becomes the same pair,
ties / weak preferences / empty sides / pairs over seq_len are rejects with reasons, and the bundled
preference sample goes through the real stages (Spark local[2], MiniLM, the Mistral v1 tokenizer)
into one pair per train-ready row, with rows in = rows out + rejects."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import fetch_artifact
from pipeline_core.config import FilterSection, load_config
from spark_jobs.conversations.chat_format import load_tokenizer
from spark_jobs.filter.filter_rows import conversation_options
from spark_jobs.filter.render_docs import render_pair
from spark_jobs.packing import IGNORE_INDEX, split_documents
from spark_jobs.preference import PreferenceReject, parse_pair, preference_columns

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "preference"
Q, GOOD, BAD = "What is the capital of Japan?", "The capital of Japan is Tokyo.", "The capital of Japan is Osaka."
USER = {"role": "user", "content": Q}


def _render(rec: dict, seq_len: int = 256):
    cols = preference_columns(json.dumps(rec), None)
    assert cols["read_error"] is None, cols
    fcfg = FilterSection(objective="dpo", seq_len=seq_len)
    return render_pair(json.loads(cols["messages_json"]), cols["rejected"], SimpleNamespace(metadata=None, reasoning=None),
                       load_tokenizer("mistral-v1"), fcfg, conversation_options(fcfg))


SHAPES = {
    "strings": {"prompt": Q, "chosen": GOOD, "rejected": BAD},
    "messages_prompt": {"messages": [USER], "chosen": GOOD, "rejected": BAD},
    "ultrafeedback": {"prompt": Q, "chosen": [USER, {"role": "assistant", "content": GOOD}],
                      "rejected": [USER, {"role": "assistant", "content": BAD}]},
    "ultrafeedback_no_prompt": {"chosen": [USER, {"role": "assistant", "content": GOOD}],
                                "rejected": [USER, {"role": "assistant", "content": BAD}]},
    "assistant_message_sides": {"prompt": [USER], "chosen": [{"role": "assistant", "content": GOOD}],
                                "rejected": [{"role": "assistant", "content": BAD}]},
    "helpsteer3_first_better": {"context": [USER], "response1": GOOD, "response2": BAD, "overall_preference": -2},
    "helpsteer3_second_better": {"context": [USER], "response1": BAD, "response2": GOOD, "overall_preference": 3},
}


def test_every_shape_renders_to_the_same_pair():
    rendered = {name: _render(rec) for name, rec in SHAPES.items()}
    (doc, cut) = rendered["strings"]
    tok = load_tokenizer("mistral-v1")
    chosen_text = tok.decode([int(t) for t in doc.labels[:cut] if t != IGNORE_INDEX])
    rejected_text = tok.decode([int(t) for t in doc.labels[cut:] if t != IGNORE_INDEX])
    assert GOOD in chosen_text and BAD in rejected_text and Q not in chosen_text + rejected_text
    for name, (d, c) in rendered.items():
        assert c == cut and d.input_ids.tolist() == doc.input_ids.tolist(), name
        assert d.labels.tolist() == doc.labels.tolist(), name


@pytest.mark.parametrize(("rec", "reason"), [
    ({"context": [USER], "response1": GOOD, "response2": BAD, "overall_preference": 0}, "preference_tie"),
    ({"prompt": Q, "chosen": GOOD, "rejected": ""}, "empty_response"),
    ({"prompt": Q, "chosen": "  ", "rejected": BAD}, "empty_response"),
    ({"prompt": Q, "chosen": [USER, {"role": "assistant", "content": ""}], "rejected": BAD}, "empty_response"),
    ({"context": [USER], "response1": GOOD, "response2": None, "overall_preference": -1}, "empty_response"),
    ({"prompt": Q, "chosen": GOOD, "rejected": GOOD}, "identical_responses"),
    ({"prompt": Q, "chosen": [{"role": "user", "content": "Other?"}, {"role": "assistant", "content": GOOD}],
      "rejected": BAD}, "prompt_mismatch"),
    ({"prompt": Q, "answer": GOOD}, "not_a_preference_record"),
])
def test_bad_records_are_rejects_with_reasons(rec, reason):
    with pytest.raises(PreferenceReject) as e:
        parse_pair(rec)
    assert e.value.reason == reason
    assert preference_columns(json.dumps(rec), None)["read_error"].startswith(f"{reason}:")


def test_weak_helpsteer3_preference_is_dropped_below_the_margin():
    rec = {"context": [USER], "response1": GOOD, "response2": BAD, "overall_preference": -1}
    assert parse_pair(rec).strength == 1
    with pytest.raises(PreferenceReject, match="low_preference_margin"):
        parse_pair(rec, min_margin=2)


def test_a_pair_over_seq_len_is_too_long():
    doc, cut = _render(SHAPES["strings"])
    n = len(doc.input_ids)
    assert _render(SHAPES["strings"], seq_len=n)[1] == cut  # exactly fits
    reason, detail = _render(SHAPES["strings"], seq_len=n - 1)
    assert reason == "too_long" and f"seq_len={n - 1}" in detail


# ----------------------------------------------------------------------------- the real stages
@pytest.fixture(scope="module")
def staged(spark, tmp_path_factory):
    from spark_jobs.enrich import job as enrich
    from spark_jobs.filter import job as similarity_filter

    tmp = tmp_path_factory.mktemp("dpo-data")
    cfg = load_config(env={}, overrides={
        "pipeline": {"store_uri": uris.qualify(tmp / "store"), "staging_uri": uris.qualify(tmp / "staging")},
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2, "objective": "dpo"},
        "filter": {"spark_master": "local[2]", "shuffle_partitions": 2, "objective": "dpo", "seq_len": 128,
                   "min_preference_margin": 2, "val_fraction": 0.2, "min_qa_similarity": 0.2},
        "train": {"objective": "dpo"},
    })
    enriched = uris.join(cfg.pipeline.store_uri, "datasets", "pref", "enriched", "e")
    em = enrich.run(uris.qualify(SAMPLE), enriched, cfg, spark=spark)
    ready = uris.join(cfg.pipeline.store_uri, "datasets", "pref", "train", "f")
    fm = similarity_filter.run(enriched, ready, cfg, spark=spark)
    local = tmp / "ready"
    fetch_artifact(ready, local)
    rejects = {r["id"]: r for r in pq.read_table(local / "rejects").to_pylist()}
    root = uris.to_local_path(enriched)
    e_rejects = {r["id"] or json.loads(r["raw"]).get("id"): r for r in
                 pq.read_table(root / em.object_path("rejects")).to_pylist()}
    data = pq.read_table(root / em.object_path("data")).to_pylist()
    return SimpleNamespace(cfg=cfg, em=em, fm=fm, local=local, rejects=rejects, e_rejects=e_rejects, data=data,
                           ready=ready, tmp=tmp)


@pytest.mark.slow
def test_enrich_keeps_pairs_and_rejects_ties_and_empty_sides(staged):
    n_lines = len((SAMPLE / "data" / "preference-00000-of-00001.jsonl").read_text().splitlines())
    c = staged.em.counts
    assert c["in"] == n_lines == c["out"] + sum(c["rejected"].values())
    assert c["rejected"] == {"empty_response": 1, "preference_tie": 1}
    assert staged.em.extra["objective"] == "dpo"
    row = next(r for r in staged.data if r["id"] == "pref-000")
    assert row["answer"] == "7 + 5 = 12." and row["rejected"] == "7 + 5 = 13, I think."
    assert row["sim_question_answer"] is not None and row["sim_question_rejected"] is not None


@pytest.mark.slow
def test_filter_packs_one_pair_per_row_and_counts_every_record(staged):
    c, extra = staged.fm.counts, staged.fm.extra
    assert c["in"] == staged.em.counts["out"] == c["out"] + sum(c["rejected"].values())
    assert c["rejected"].get("low_preference_margin") == 1 and "weak-000" in staged.rejects
    assert extra["objective"] == "dpo" and staged.fm.extra["sequences"]["train"] + extra["sequences"]["val"] == c["out"]
    tok = load_tokenizer("mistral-v1")
    rows = [r for s in ("train", "val") for f in sorted((staged.local / "data" / s).glob("*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    assert len(rows) == c["out"]
    texts = []
    for r in rows:
        pos = np.asarray(r["position_ids"])
        labels = np.asarray(r["labels"])
        docs = split_documents(pos)
        trained = [(a, b) for a, b in docs if (labels[a:b] != IGNORE_INDEX).any()]
        assert len(trained) == 2 and trained == docs[:2]  # chosen, rejected, then padding (if any)
        texts.append(tuple(tok.decode([int(t) for t in labels[a:b] if t != IGNORE_INDEX]) for a, b in trained))
    assert ("7 + 5 = 12.", "7 + 5 = 13, I think.") in [(a.strip(), b.strip()) for a, b in texts]


@pytest.mark.slow
def test_trainer_refuses_an_artifact_of_the_other_objective(staged):
    from training.train import TrainConfigError, make_plan

    sft = load_config(overrides={**staged.cfg.model_dump(), "enrich": {**staged.cfg.enrich.model_dump(), "objective": "sft"},
                                 "filter": {**staged.cfg.filter.model_dump(), "objective": "sft"},
                                 "train": {**staged.cfg.train.model_dump(), "objective": "sft", "seq_len": 128}})
    with pytest.raises(TrainConfigError, match="objective 'dpo' but train.objective='sft'"):
        make_plan(sft, staged.ready, uris.join(staged.cfg.pipeline.store_uri, "runs", "x"), 2, on_gpu=False)
