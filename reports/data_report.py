"""Data report stage: a committed train-ready artifact -> a `data-report` artifact (HTML + PNGs).

    python -m reports.data_report --input <train-ready URI> [--enriched URI] [--output URI] [--config FILE]

Reads committed artifacts only (the train-ready and enriched manifests, their rejects and data,
every file sha256-checked on the way in) and commits `datasets/<version>/report/<id>/`:
`data/index.html` (self-contained: the charts are inlined, no network resource), `data/charts/*.png`
and a manifest whose `extra.headline` holds the numbers the approval gate shows. Like every stage
it is idempotent: a committed report for the same inputs is returned as is.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

from pipeline_core import uris
from pipeline_core.artifacts import (
    Manifest,
    fetch_artifact,
    file_uri,
    publish_artifact,
    read_manifest,
    require_manifest,
)
from pipeline_core.config import StorageSection, load_config
from pipeline_core.handoffs import (
    DataReportInfo,
    EnrichedInfo,
    FilterReports,
    Headline,
    ReportRef,
    StageCounts,
    TrainReadyBasics,
    TrainReadyInfo,
    TrainReadySplits,
)
from pipeline_core.names import Split, data_prefix
from reports import charts
from reports.facts import (
    NEAR_DUPLICATE,
    NO_SPLIT,
    SIM_COLUMNS,
    NearDuplicate,
    ReportFacts,
    document_lengths,
    guard_by_split,
    mask_spans,
    near_duplicate_of,
    read_table,
    reject_rows,
    richest_document,
    source_split_rows,
    split_of_id,
    split_tokens,
)

log = logging.getLogger("reports.data_report")

KIND = "data-report"
PAGE = "data/index.html"
TEMPLATE = "data_report.html.j2"
NEAR_DUP_SAMPLE = 12
GUARD_EXAMPLES = 3  # saved and dropped pairs shown per split
LENGTH_SAMPLE_ROWS = 4000  # packed rows per split read for the length histogram and the example


def report_uri(train_ready_uri: str) -> str:
    """datasets/<version>/train/<id> -> datasets/<version>/report/<id>: one report per train-ready artifact."""
    train_ready_uri = train_ready_uri.rstrip("/")
    return uris.join(uris.parent(uris.parent(train_ready_uri)), "report", uris.name(train_ready_uri))


def report_page_uri(manifest: Manifest) -> str:
    """The committed page's URI: the payload lies under the writing attempt's prefix (manifest v2)."""
    return file_uri(manifest.uri, manifest, PAGE)


def _local(uri: str, tmp: Path, name: str, storage: StorageSection | None, prefix: str) -> Path:
    """A verified local copy of the artifact's files under `prefix`."""
    dest = tmp / name
    fetch_artifact(uri, dest, storage, prefix=prefix)
    return dest


def _parquet(root: Path, manifest: Manifest, prefix: str) -> list[Path]:
    return [root / p for p in manifest.file_paths(prefix) if p.endswith(".parquet")]


def collect(train_ready_uri: str, enriched_uri: str | None, storage: StorageSection | None,
            tmp: Path) -> ReportFacts:
    from spark_jobs.conversations.chat_format import load_tokenizer

    tr = require_manifest(train_ready_uri, storage, kind="train-ready")
    named = tr.input_of_kind("enriched")
    enriched_uri = enriched_uri or (named.uri if named else None)
    if enriched_uri is None:
        raise ValueError(f"--enriched: {train_ready_uri}'s manifest names no enriched input; pass --enriched URI")
    en = require_manifest(enriched_uri, storage, kind="enriched")
    fcfg, ecfg = tr.config.get("filter", {}), en.config.get("enrich", {})
    seed, val_fraction = int(fcfg.get("seed", 0)), float(fcfg.get("val_fraction", 0.0))

    tr_dir = _local(train_ready_uri, tmp, "train-ready", storage, "")
    en_dir = _local(enriched_uri, tmp, "enriched", storage, "")

    # rejects of both stages, by split (a record's split is a function of its id alone)
    rejects_by_split: dict[str, dict[str, int]] = {}
    near: list[dict] = []
    near_split: dict[str, str] = {}
    filter_rejected: set[str] = set()
    for stage_dir, m in ((en_dir, en), (tr_dir, tr)):
        for row in reject_rows(_parquet(stage_dir, m, "rejects/")):
            split = split_of_id(row["id"], seed, val_fraction) if row["id"] else NO_SPLIT
            key = f"{row['stage']}:{row['reason']}"
            rejects_by_split.setdefault(key, {}).setdefault(split, 0)
            rejects_by_split[key][split] += 1
            if m is tr and row["id"]:
                filter_rejected.add(row["id"])
            if m is tr and row["reason"] == NEAR_DUPLICATE:
                near.append(row)
                near_split[row["id"]] = split

    # similarity distributions of the enriched rows, and of the rows the filter kept
    table = read_table(_parquet(en_dir, en, "data/"), ["id", "question", *SIM_COLUMNS])
    kept_mask = np.array([i not in filter_rejected for i in table["id"]], dtype=bool)
    sims, sims_kept = {}, {}
    for col in SIM_COLUMNS:
        v = np.array([np.nan if x is None else x for x in table[col]], dtype=float)
        ok = ~np.isnan(v)
        sims[col], sims_kept[col] = v[ok], v[ok & kept_mask]
    question_of = dict(zip(table["id"], table["question"], strict=True))

    pairs = []
    for row in near:
        of, score = near_duplicate_of(row)
        pairs.append(NearDuplicate(id=row["id"], question=question_of.get(row["id"]) or "", duplicate_of=of,
                                   duplicate_question=question_of.get(of) if of else None, score=score))
    scores = np.array([p.score for p in pairs if p.score is not None], dtype=float)
    pairs.sort(key=lambda p: -(p.score or 0.0))

    # packed documents: length histogram and the example with its loss mask
    info = TrainReadyInfo.of(tr)
    basics = TrainReadyBasics.from_manifest(tr)  # manifests from before TrainReadyInfo
    seq_len = info.seq_len if info else basics.seq_len
    tokens, targets, docs = split_tokens(tr, info)
    lengths, sampled, example, example_split = {}, {}, [], None
    tok_spec = info.tokenizer.name if info else (basics.tokenizer and basics.tokenizer.spec) or fcfg.get("tokenizer")
    best: tuple[list[int], list[int]] | None = None
    for split in (Split.VAL, Split.TRAIN):
        t = read_table(_parquet(tr_dir, tr, data_prefix(split)), ["input_ids", "labels", "position_ids"])
        rows = {c: v[:LENGTH_SAMPLE_ROWS] for c, v in t.items()}
        sampled[split] = len(rows["labels"])
        lengths[split] = document_lengths(rows["position_ids"], rows["labels"])
        if best is None:
            best = richest_document(rows["input_ids"], rows["labels"], rows["position_ids"])
            example_split = split if best else None
    if best is not None and tok_spec:
        tok = load_tokenizer(tok_spec)
        example = mask_spans(best[0], best[1], tok.decode)

    splits = TrainReadySplits.from_manifest(tr).splits
    filter_reports = FilterReports.from_manifest(tr)
    en_counts, tr_counts = StageCounts.from_manifest(en), StageCounts.from_manifest(tr)
    headline = Headline(
        records_in=en_counts.rows_in, enriched=en_counts.rows_out, kept=tr_counts.rows_out,
        rejected={k: sum(v.values()) for k, v in sorted(rejects_by_split.items())},
        tokens=tokens, target_tokens=targets, documents=docs, val_documents=int(docs.get(Split.VAL, 0)),
        packing_efficiency=(info.packing_efficiency if info and info.packing_efficiency is not None
                            else basics.packing_efficiency),
        seq_len=seq_len,
    )
    return ReportFacts(
        dataset_version=_version_of(train_ready_uri), train_ready_uri=train_ready_uri, enriched_uri=enriched_uri,
        headline=headline, rejects_by_split=rejects_by_split, similarities=sims, similarity_kept=sims_kept,
        thresholds={"sim_question_answer": fcfg.get("min_qa_similarity"),
                    "sim_context_question": ecfg.get("relevance_threshold"),
                    "sim_context_answer": ecfg.get("relevance_threshold"),
                    "near_dup_threshold": fcfg.get("near_dup_threshold")},
        near_duplicates=pairs[:NEAR_DUP_SAMPLE], near_duplicate_scores=scores, doc_lengths=lengths,
        doc_lengths_sampled_rows=sampled,
        packing_by_split={s: v.packing_efficiency for s, v in splits.items()},
        example=example, example_split=example_split,
        decontamination=info.decontamination if info else None,
        near_dup_guard=filter_reports.near_duplicates.guard if filter_reports.near_duplicates else None,
        guard_by_split=guard_by_split(filter_reports.near_duplicates, pairs, near_split, question_of, GUARD_EXAMPLES),
        length_fit=filter_reports.length_fit,
        source_splits=source_split_rows(en, tr), prompt_sources=EnrichedInfo.from_manifest(en).prompt_sources,
        withheld_without_key=en_counts.rejected.get("prompt_withheld", 0),
    )


def _version_of(train_ready_uri: str) -> str:
    return uris.name(uris.parent(uris.parent(train_ready_uri.rstrip("/"))))


def render_page(facts: ReportFacts, chart_files: dict[str, Path]) -> str:
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"),
                      autoescape=select_autoescape(["html", "j2"]))
    img = {name: "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode() for name, p in chart_files.items()}
    splits = sorted({s for v in facts.rejects_by_split.values() for s in v})
    return env.get_template(TEMPLATE).render(f=facts, h=facts.headline, img=img, splits=splits)


def build(train_ready_uri: str, output_uri: str | None = None, enriched_uri: str | None = None,
          storage: StorageSection | None = None) -> Manifest:
    """Collect, draw, render and commit the report; a committed report is returned unchanged."""
    train_ready_uri = uris.require_uri(train_ready_uri, "--input").rstrip("/")
    output_uri = uris.require_uri(output_uri or report_uri(train_ready_uri), "--output").rstrip("/")
    done = read_manifest(output_uri, storage)
    if done is not None:
        log.info("%s is already committed; nothing to do", output_uri)
        return done
    with tempfile.TemporaryDirectory(prefix="data-report-") as tmp:
        root = Path(tmp)
        facts = collect(train_ready_uri, enriched_uri, storage, root / "in")
        out = root / "out"
        files = charts.draw_all(facts, out / "data" / "charts")
        (out / PAGE).write_text(render_page(facts, files), encoding="utf-8")
        (out / "data" / "facts.json").write_text(json.dumps(facts.to_extra(), indent=2, sort_keys=True))
        return publish_artifact(out, output_uri, kind=KIND, inputs=[train_ready_uri, facts.enriched_uri],
                                config={"stage": "data-report", "input": train_ready_uri}, counts={},
                                extra={**facts.to_extra(), "page": PAGE}, storage=storage)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--input", required=True, help="committed train-ready artifact URI")
    p.add_argument("--enriched", default=None, help="its enriched artifact (default: the one its manifest names)")
    p.add_argument("--output", default=None, help="report artifact URI (default: datasets/<version>/report/<id>)")
    p.add_argument("--config", default=None, help="config file (storage settings)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    m = build(args.input, args.output, args.enriched, cfg.storage)
    ref = ReportRef(uri=m.uri, page=report_page_uri(m), headline=DataReportInfo.from_manifest(m).headline)
    print(json.dumps(ref.model_dump(mode="json", exclude={"view"})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
