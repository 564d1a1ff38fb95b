"""The data report of the bundled sample: real enrich + filter (Spark local[2]), then the report
stage; its pictures load in a real headless Chromium and its figures match the manifests."""

from __future__ import annotations

import json

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest, verify_artifact
from pipeline_core.handoffs import TrainReadyInfo
from reports.data_report import KIND, PAGE, build, report_page_uri, report_uri
from reports.facts import mask_spans, near_duplicate_of
from tests.browser import browser_page, keep_screenshot
from tests.report_helpers import build_sample

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    art = build_sample(uris.qualify(root / "store"), root / "staging")
    manifest = build(art.train_ready_uri)
    return art, manifest


def test_report_artifact_has_its_pictures_and_numbers(sample):
    art, m = sample
    assert m.kind == KIND and m.uri == report_uri(art.train_ready_uri)
    assert m.uri.endswith(f"/datasets/sample/report/{uris.name(art.train_ready_uri)}")
    verify_artifact(m.uri)
    charts = [f for f in m.file_paths("data/charts/") if f.endswith(".png")]
    assert sorted(charts) == [f"data/charts/{n}.png" for n in
                              sorted(("rejects", "similarity", "near_duplicates", "document_lengths", "tokens"))]
    root = uris.to_local_path(m.uri)
    pngs = [root / m.object_path(c) for c in charts]  # under the writing attempt's payload prefix
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5000 for p in pngs)
    assert report_page_uri(m) == uris.join(m.uri, m.payload, PAGE) and m.extra["page"] == PAGE
    tr, en = read_manifest(art.train_ready_uri), read_manifest(art.enriched_uri)
    h = m.extra["headline"]
    assert h["records_in"] == en.counts["in"] == 300 and h["enriched"] == en.counts["out"]
    assert h["kept"] == tr.counts["out"]
    assert h["tokens"] == tr.extra["tokens"] and h["packing_efficiency"] == tr.extra["packing_efficiency"]
    rejected = {f"enrich:{k}": v for k, v in en.counts["rejected"].items()}
    rejected |= {f"filter:{k}": v for k, v in tr.counts["rejected"].items()}
    assert h["rejected"] == rejected
    assert {i["uri"] for i in m.inputs} == {art.train_ready_uri, art.enriched_uri}
    assert build(art.train_ready_uri).sha256 == m.sha256  # committed: a rerun is a no-op
    # issue 29: the per-split fit at the configured seq_len, as the manifest counts it
    page = (root / m.object_path(PAGE)).read_text()
    fit = tr.extra["length_fit"]
    assert fit["splits"] and f"= {fit['seq_len']} per source split" in page
    for name, v in fit["splits"].items():
        assert f'data-metric="fit-{name}">{v["fit"]}</td>' in page
    # per input split: rows in as enrich counted them, and the seq_len fit with / without reasoning (issue 28)
    ss = m.extra["source_splits"]
    assert {s: v["in"] for s, v in ss.items()} == {s: v["in"] for s, v in en.extra["splits"].items()}
    assert all(v["fit_with"] <= v["fit_without"] <= v["measured"] and v["measured"] >= v["kept"] for v in ss.values()), ss
    assert m.extra["withheld_without_key"] == en.counts["rejected"]["prompt_withheld"] == 4
    # reasoning costs: the /no_think marker alone puts 3 tool_calling rows of the v1 sample over 256
    assert sum(v["fit_with"] for v in ss.values()) < sum(v["fit_without"] for v in ss.values()), ss


def test_page_renders_in_chromium_and_matches_the_manifests(sample, tmp_path):
    art, m = sample
    tr, en = read_manifest(art.train_ready_uri), read_manifest(art.enriched_uri)
    page_uri = report_page_uri(m)
    requests: list[str] = []
    with browser_page() as page:
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_uri)
        images = page.evaluate("[...document.images].map(i => ({alt: i.alt, w: i.naturalWidth, h: i.naturalHeight}))")
        metrics = page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('[data-metric]')].map(e => [e.dataset.metric, e.textContent.trim()]))")
        trained = page.locator("#example .trained").all_inner_texts()
        keep_screenshot(page, "data-report.png", tmp_path)
    assert len(images) == 5 and all(i["w"] > 0 and i["h"] > 0 for i in images), images
    assert all(u.startswith(("file:", "data:")) for u in requests), requests  # nothing from the network
    assert metrics["dataset_version"] == "sample"
    assert int(metrics["records_in"]) == en.counts["in"] and int(metrics["enriched"]) == en.counts["out"]
    assert int(metrics["kept"]) == tr.counts["out"]
    for split, n in tr.extra["tokens"].items():
        assert int(metrics[f"tokens-{split}"]) == n
    info = TrainReadyInfo.of(tr)  # the typed hand-off once the filter writes it, else the older extra
    val_docs = info.documents["val"] if info and info.documents else tr.extra["splits"]["val"]["documents"]
    assert int(metrics["val_documents"]) == val_docs
    assert float(metrics["packing_efficiency"]) == pytest.approx(tr.extra["packing_efficiency"], abs=1e-4)
    for reason, n in tr.counts["rejected"].items():
        assert int(metrics[f"rejected-filter:{reason}"]) == n
    for reason, n in en.counts["rejected"].items():
        assert int(metrics[f"rejected-enrich:{reason}"]) == n
    assert trained and all(t.strip() for t in trained)  # the answer is highlighted as trained text


def test_run_summary_links_the_committed_page(sample):
    """What `make demo`'s summary and the publish task print: the page that exists (payload prefix)."""
    from plugins.mft_airflow.run_plan import RunPlan
    from plugins.mft_airflow.summary import data_report_link

    art, m = sample
    store = art.cfg.pipeline.store_uri
    plan = RunPlan(config_file="/unused.yaml", dataset_version="sample", run_id="r", source_uri=store,
                   store_uri=store, enriched_uri=art.enriched_uri, train_ready_uri=art.train_ready_uri,
                   run_uri=uris.join(store, "runs", "r"), model_uri=uris.join(store, "runs", "r", "model"),
                   models_uri=uris.join(store, "models"), trainer_name="t")
    link = data_report_link(plan, None)
    assert link == report_page_uri(m) and uris.to_local_path(link).is_file()
    other = plan.model_copy(update={"train_ready_uri": uris.join(store, "datasets", "sample", "train", "none")})
    assert data_report_link(other, None) is None


def test_loss_mask_spans_decode_exactly():
    """A two-turn conversation rendered by the filter's own tokenizer: the report's runs alternate
    prompt / answer, decode to exactly the document, and each trained run is an answer."""
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.conversations.conversation import Conversation, Turn

    tok = load_tokenizer("mistral-v1")
    conv = Conversation(None, (Turn("user", "What is 2 + 2?"), Turn("assistant", "It is 4."),
                               Turn("user", "And 3 + 3?"), Turn("assistant", "It is 6.")))
    r = tok.render(conv)
    labels = [i if t else -100 for i, t in zip(r.input_ids, r.targets, strict=True)]
    spans = mask_spans(r.input_ids, labels, tok.decode)
    assert [s.trained for s in spans] == [False, True, False, True]
    assert "".join(s.text for s in spans) == tok.decode(r.input_ids)
    assert [s.text.strip() for s in spans if s.trained] == ["It is 4.", "It is 6."]


def test_near_duplicate_partner_is_read_from_typed_fields_or_the_detail():
    typed = {"raw": json.dumps({"duplicate_of": "a", "score": 0.97, "detail": "near duplicate of b (similarity 0.5)"})}
    assert near_duplicate_of(typed) == ("a", 0.97)
    assert near_duplicate_of({"raw": json.dumps({"detail": "near duplicate of x-1 (similarity 0.9512)"})}) == ("x-1", 0.9512)
    assert near_duplicate_of({"raw": "not json"}) == (None, None)


def test_sample_manifest_still_reads_without_the_typed_handoff(sample):
    art, _ = sample
    tr = read_manifest(art.train_ready_uri)
    info = TrainReadyInfo.of(tr)
    assert info is None or isinstance(info, TrainReadyInfo)
