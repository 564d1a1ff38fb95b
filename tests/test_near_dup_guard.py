"""Near duplicates are the same example, not the same template (issue 27): the guard and keep-first.

The filter stage end to end (real Spark local[2], real MiniLM, the real Mistral tokenizer) on math
templates with varied numbers, rewordings, Unicode-only copies and hard negatives
(bench/neardup_corpus.py); the chain case and the no-guard baseline on the dedup entry point."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench.neardup_corpus import corpus
from pipeline_core import uris
from pipeline_core.artifacts import fetch_artifact
from pipeline_core.config import ConfigError, load_config
from samples.enriched import Rec, embed, enriched_table, publish_enriched
from spark_jobs.near_dups.near_dup_guard import guard_features, guard_key, normalise_number
from tests.filter_helpers import FILTER_SETTINGS

THRESHOLD = 0.9


def items():
    return corpus(variants=8, reworded=3, copies=2, negatives=1)


# ---- the guard's features (pure Python) ----

def test_numbers_are_normalised():
    assert [normalise_number(x) for x in ("1,000", "3.50", "007", ".5", "1,234,567.80", "٣")] == \
        ["1000", "3.5", "7", "0.5", "1234567.8", "3"]
    f = guard_features("Tom has 1,000 apples and ３.50 dollars; 1000 more", "So \\boxed{ 1,000 }")
    assert f.numbers == ("1000", "1000", "3.5") and f.final_answer == "boxed:1000"


def test_the_guard_separates_variants_and_joins_rewordings():
    by_id = {i.id: i for i in items()}
    key = {i.id: guard_key(i.question, i.answer) for i in by_id.values()}
    for i in by_id.values():
        if i.kind in ("rewording", "unicode_copy"):
            assert key[i.id] == key[i.of], i.id
    inst = [i for i in by_id.values() if i.kind == "instance"]
    for a in inst:
        for b in inst:
            if a.id < b.id and a.template == b.template:
                assert key[a.id] != key[b.id], (a.id, b.id)
    # code: other identifiers or constants differ; comments and layout do not
    q = "Write `f`."
    base = guard_key(q, "```python\ndef f(x):\n    return x + 10\n```")
    assert guard_key(q, "```python\ndef f(x):  # add ten\n  return x+10\n```") == base
    assert guard_key(q, "```python\ndef f(x):\n    return x + 11\n```") != base
    assert guard_key(q, "```python\ndef g(x):\n    return x + 10\n```") != base
    assert guard_key(q, "anything", "none") == guard_key("other", "text", "none")


def test_the_guard_setting_is_validated_and_content_hashed():
    from pipeline_core.layout import train_ready_id

    with pytest.raises(ConfigError, match="near_dup_guard"):
        load_config(env={}, overrides={"filter": {"near_dup_guard": "digits"}})
    a = load_config(env={}, overrides={})
    b = load_config(env={}, overrides={"filter": {"near_dup_guard": "none"}})
    assert a.filter.near_dup_guard == "numbers" and train_ready_id(a) != train_ready_id(b)


# ---- the filter stage end to end ----

@pytest.fixture(scope="module")
def filtered(spark, tmp_path_factory):
    from spark_jobs.filter.job import run

    root = tmp_path_factory.mktemp("guard")
    cfg = load_config(env={}, overrides={
        "filter": {**FILTER_SETTINGS, "seq_len": 256, "max_tokens": 250, "near_dup_threshold": THRESHOLD,
                   "val_fraction": 0.3},
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")}})
    its = items()
    table = enriched_table([Rec(i.id, i.question, i.answer, category=i.category) for i in its])
    in_uri = uris.join(cfg.pipeline.store_uri, "datasets", "t", "enriched", "e1")
    publish_enriched(table, root / "enriched", in_uri)
    out_uri = uris.join(cfg.pipeline.store_uri, "datasets", "t", "train", "f1")
    manifest = run(in_uri, out_uri, cfg, spark=spark)
    fetch_artifact(out_uri, root / "fetched")
    rejects = pq.read_table(root / "fetched" / "rejects").to_pylist()
    return SimpleNamespace(manifest=manifest, items={i.id: i for i in its}, table=table,
                           rejects={r["id"]: r for r in rejects}, root=root, in_uri=in_uri, out_uri=out_uri)


def _cos(table, a: str, b: str) -> float:
    rows = {r["id"]: r for r in table.select(["id", "question_embedding", "answer_embedding"]).to_pylist()}
    v = lambda i: np.concatenate([rows[i]["question_embedding"], rows[i]["answer_embedding"]])  # noqa: E731
    return float(v(a) @ v(b)) / 2


def _example(i) -> str:
    """An instance, its rewording and its Unicode copy are one example; a hard negative is its own."""
    return i.of if i.kind in ("rewording", "unicode_copy") else i.id


def test_numbers_only_variants_are_all_kept(filtered):
    """Every example survives (an instance may go for its own rewording or copy, never for another
    instance of its template), and no near duplicate is dropped for a row of another example."""
    items = filtered.items
    survivors: dict[str, int] = {}
    for i in items.values():
        survivors[_example(i)] = survivors.get(_example(i), 0) + (i.id not in filtered.rejects)
    assert all(n >= 1 for n in survivors.values()), {k: n for k, n in survivors.items() if n < 1}
    for rid, r in filtered.rejects.items():
        if r["reason"] == "near_duplicate":
            rep = json.loads(r["raw"])["detail"].split("near duplicate of ")[1].split(" ")[0]
            assert _example(items[rid]) == _example(items[rep]), (rid, rep)
    # the data is hard: similarity alone pairs many instances (the guard counted the pairs it kept apart)
    nd = filtered.manifest.extra["near_duplicates"]
    assert nd["guard"] == "numbers" and nd["guard_saved_pairs"] >= 10
    assert sum(nd["guard_saved_by_split"].values()) == nd["guard_saved_pairs"]
    ex = nd["guard_saved_examples"]
    assert ex and all(e["similarity"] >= THRESHOLD for e in ex)
    for e in ex:
        assert items[e["id"]].template == items[e["other_id"]].template
        assert _example(items[e["id"]]) != _example(items[e["other_id"]])


def test_rewordings_go_and_unicode_copies_are_exact_duplicates(filtered):
    """A copy and its instance: exactly one is an exact duplicate. An example whose rewording is
    within the threshold keeps exactly one of its rows."""
    items = filtered.items
    for i in items.values():
        if i.kind == "unicode_copy":
            assert [filtered.rejects.get(x, {}).get("reason") for x in (i.id, i.of)].count("exact_duplicate") == 1, i.id
        rows = [x for x in items.values() if _example(x) == i.of]
        if i.kind == "rewording" and all(_cos(filtered.table, i.id, x.id) >= THRESHOLD for x in rows if x.id != i.id):
            assert sum(x.id not in filtered.rejects for x in rows) == 1, [x.id for x in rows]
            assert any(filtered.rejects.get(x.id, {}).get("reason") == "near_duplicate" for x in rows)


def test_every_near_duplicate_names_a_kept_row_and_counts_add_up(filtered):
    m = filtered.manifest
    assert m.counts["in"] == len(filtered.items) == m.counts["out"] + len(filtered.rejects)
    assert sum(m.counts["rejected"].values()) == len(filtered.rejects)
    near = [r for r in filtered.rejects.values() if r["reason"] == "near_duplicate"]
    assert near
    for r in near:
        detail = json.loads(r["raw"])["detail"]
        rep, sim = detail.split("near duplicate of ")[1].split(" (similarity ")
        assert rep not in filtered.rejects, (r["id"], rep)  # the representative is in the output
        assert abs(float(sim.rstrip(")")) - _cos(filtered.table, r["id"], rep)) < 1e-3
        assert float(sim.rstrip(")")) >= THRESHOLD


def test_data_report_shows_saved_and_dropped_pairs_per_split(filtered, tmp_path):
    from reports.data_report import collect, render_page

    facts = collect(filtered.out_uri, filtered.in_uri, None, tmp_path)
    nd = filtered.manifest.extra["near_duplicates"]
    assert facts.near_dup_guard == "numbers"
    assert {g.split: g.saved_pairs for g in facts.guard_by_split if g.saved_pairs} == nd["guard_saved_by_split"]
    assert sum(g.dropped for g in facts.guard_by_split) == filtered.manifest.counts["rejected"]["near_duplicate"]
    saved = [e for g in facts.guard_by_split for e in g.saved_examples]
    dropped = [e for g in facts.guard_by_split for e in g.dropped_examples]
    assert saved and dropped
    for e in saved:  # a saved pair differs in its numbers; a dropped one is the same example
        assert e.question and e.duplicate_question and guard_key(e.question, "") != guard_key(e.duplicate_question, "")
    for e in dropped:
        assert e.duplicate_of not in filtered.rejects
    page = render_page(facts, {})
    assert "pairs saved by the guard" in page and saved[0].id in page and dropped[0].id in page


# ---- the entry point: chains, and what the guard saves ----

def _frame(spark, keys, vecs, guards=None):
    import pandas as pd

    pdf = pd.DataFrame({"id": [f"r{k}" for k in keys], "_key": np.asarray(keys, np.int64),
                        "_vec": [np.asarray(v, np.float32).tolist() for v in vecs],
                        "_guard": np.asarray(guards if guards is not None else [0] * len(keys), np.int64)})
    return spark.createDataFrame(pdf, "id string, _key long, _vec array<float>, _guard long").persist()


def _unit(v):
    return v / np.linalg.norm(v)


def test_chain_keeps_both_ends(spark):
    """A~B (0.95), B~C (0.95), A !~ C (0.805): keep-first keeps A and C and drops B for A. The old
    rule dropped B and C (C named B, which was itself dropped)."""
    from spark_jobs.near_dups.dedup import near_duplicates
    from spark_jobs.near_dups.dedup_types import ClusterSettings, NearDupSettings

    rng = np.random.default_rng(0)
    e = np.linalg.qr(rng.normal(size=(384, 3)))[0].T  # orthonormal
    t = np.arccos(0.95)
    half = [_unit(e[0]), _unit(np.cos(t) * e[0] + np.sin(t) * e[1]), _unit(np.cos(2 * t) * e[0] + np.sin(2 * t) * e[1])]
    vecs = [np.concatenate([h, h]) for h in half] + [np.concatenate([_unit(e[2]), _unit(e[2])])]
    df = _frame(spark, [1, 2, 3, 4], vecs)
    s = NearDupSettings(threshold=0.9, method="cluster", recall_sample=10, cluster=ClusterSettings(cluster_size=16))
    got = near_duplicates(df, key="_key", vec="_vec", settings=s, rows=4)
    found = {r["_key"]: (r["_near_rep"], round(r["_near_sim"], 3)) for r in got.frame.collect()}
    assert found == {2: ("r1", 0.95)}
    assert got.report.measured.recall == 1.0


def test_keep_first_is_the_greedy_rule_on_chains_cliques_and_stars(spark):
    """keep_first against the sequential definition (rows in key order; drop a row that neighbours
    a kept one) on a long chain, a clique and a star whose centre has the largest key."""
    from spark_jobs.near_dups.keep_first import keep_first

    edges = [(k + 1, k, 0.95) for k in range(1, 9)]  # chain 1-2-...-9
    edges += [(b, a, 0.99 - (b - a) / 1000) for a in range(20, 25) for b in range(a + 1, 25)]  # clique 20..24
    edges += [(40, leaf, 0.91 + leaf / 1000) for leaf in (31, 32, 33)]  # star: centre 40, leaves 31..33
    kept: set[int] = set()
    expect = {}
    for k in sorted({x for e in edges for x in e[:2]}):
        near = [(s, lk) for (j, lk, s) in edges if j == k and lk in kept]
        if near:
            s, lk = max(near, key=lambda t: (t[0], -t[1]))
            expect[k] = (f"r{lk}", s)
        else:
            kept.add(k)
    df = spark.createDataFrame([(j, lk, f"r{lk}", s) for j, lk, s in edges], "_key long, _lkey long, _lid string, _sim double")
    got = {r["k"]: (r["_near_rep"], r["_near_sim"]) for r in keep_first(df, key="k").collect()}
    assert got == expect
    assert set(got) == {2, 4, 6, 8, 21, 22, 23, 24, 40} and got[40][0] == "r33"


def test_without_the_guard_numbers_only_variants_are_dropped(spark):
    """The same MiniLM vectors through the entry point: guard keys equal (guard none) drop variants
    of the same template; the guard's keys keep every one and count the pairs it saved."""
    from spark_jobs.near_dups.dedup import near_duplicates
    from spark_jobs.near_dups.dedup_types import NearDupSettings

    its = [i for i in items() if i.kind == "instance"]
    v = np.concatenate([embed([i.question for i in its]), embed([i.answer for i in its])], axis=1)
    keys = list(range(1, len(its) + 1))
    df = _frame(spark, keys, v, [guard_key(i.question, i.answer) for i in its])
    s = NearDupSettings(threshold=THRESHOLD, recall_sample=len(its))
    plain = near_duplicates(df, key="_key", vec="_vec", settings=s, rows=len(its))
    guarded = near_duplicates(df, key="_key", vec="_vec", settings=s, rows=len(its), guard="_guard")
    assert plain.frame.count() >= 5 and plain.report.guard_saved_pairs == 0
    assert guarded.frame.count() == 0 and guarded.report.guard_saved_pairs >= 10
    assert plain.report.measured.recall == 1.0 and guarded.report.measured.with_duplicate == 0


def test_docs_explain_the_guard():
    text = (Path(__file__).resolve().parents[1] / "docs" / "filter.md").read_text()
    assert "near_dup_guard" in text and "keep-first" in text
