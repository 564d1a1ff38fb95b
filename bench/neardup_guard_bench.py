"""Issue 27's measurement: what near-duplicate removal does to template problems that differ only in
their numbers, to rewordings, Unicode copies and hard negatives, through the real filter stage.

    .venv/bin/python bench/neardup_guard_bench.py --work /tmp/ndg \\
        --run after:.venv/bin/python:.:numbers --run none:.venv/bin/python:.:none \\
        --run before:/work/main/.venv/bin/python:/work/main: [--json OUT]

The corpus (bench/neardup_corpus.py: 10 math templates x `--variants` instances, rewordings,
Unicode copies, hard negatives, a code template) is embedded with the real all-MiniLM-L6-v2 and
published once as an enriched artifact; each `--run LABEL:PYTHON:CODE_ROOT:GUARD` runs
`python -m spark_jobs.filter.job` of that checkout on it (GUARD empty: the checkout has no
`near_dup_guard` setting, i.e. the code before issue 27) and reads its rejects:
- variants dropped: instances and hard negatives rejected as near duplicates (each is its own problem);
- recall on rewordings: rewording pairs with one side rejected as a near duplicate, over all pairs
  and over the pairs at cosine >= the threshold (the ones similarity can find at all);
- Unicode copies rejected as exact duplicates;
- chain rejects: near-duplicate rejects whose named representative is itself rejected.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

THRESHOLD = 0.9


def build_input(work: Path, variants: int) -> tuple[str, list, dict]:
    import pyarrow.parquet as pq

    from bench.neardup_corpus import corpus
    from pipeline_core import uris
    from pipeline_core.artifacts import read_manifest
    from samples.enriched import Rec, enriched_table, publish_enriched

    items = corpus(variants=variants, reworded=variants // 4, copies=variants // 8, negatives=variants // 12)
    cache = work / f"enriched-{variants}.parquet"  # the embedding is the slow part: once per work dir
    if cache.exists():
        table = pq.read_table(cache)
    else:
        table = enriched_table([Rec(i.id, i.question, i.answer, category=i.category) for i in items])
        pq.write_table(table, cache)
    uri = uris.qualify(work / "store" / "datasets" / "g" / "enriched" / f"e{variants}")
    if read_manifest(uri) is None:
        publish_enriched(table, work / f"enriched-{variants}", uri)
    rows = {r["id"]: np.concatenate([r["question_embedding"], r["answer_embedding"]])
            for r in table.select(["id", "question_embedding", "answer_embedding"]).to_pylist()}
    return uri, items, rows


def run_filter(label: str, python: str, root: str, guard: str, in_uri: str, work: Path) -> tuple[str, float]:
    from pipeline_core import uris

    out_uri = uris.qualify(work / "store" / "datasets" / "g" / "train" / label)
    cfg = {"filter": {"near_dup_threshold": THRESHOLD, "seq_len": 512, "max_tokens": 500, "min_answer_tokens": 1,
                      "val_fraction": 0.1, "spark_master": "local[2]"},
           "pipeline": {"store_uri": uris.qualify(work / "store"), "staging_uri": uris.qualify(work / "staging"),
                        "max_reject_ratio": 0.9}}
    if guard:
        cfg["filter"]["near_dup_guard"] = guard
    path = work / f"config-{label}.json"
    path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFT__")}
    t0 = time.perf_counter()
    subprocess.run([python, "-m", "spark_jobs.filter.job", "--input", in_uri, "--output", out_uri,
                    "--config", str(path)], cwd=root, env=env, check=True)
    return out_uri, time.perf_counter() - t0


def analyse(out_uri: str, items: list, vecs: dict, work: Path, label: str) -> dict:
    """An instance, its rewording and its Unicode copy are one example; a hard negative is its own.
    A row dropped as a near duplicate of a row of *another* example is a wrong drop (issue 27's
    "numbers-only variant dropped"); an example with a rewording within the threshold is found when
    exactly one of its rows survives (`..._removed`: at most one, the issue's recall, which does not
    count an example lost altogether)."""
    import pyarrow.parquet as pq

    from pipeline_core.artifacts import fetch_artifact, read_manifest

    local = work / f"fetched-{label}"
    if not local.exists():
        fetch_artifact(out_uri, local)
    rej = {r["id"]: (r["reason"], json.loads(r["raw"] or "{}").get("detail") or "")
           for r in pq.read_table(local / "rejects").to_pylist()}
    by_id = {i.id: i for i in items}
    example = lambda i: i.of if i.kind in ("rewording", "unicode_copy") else i.id  # noqa: E731
    members: dict[str, list] = {}
    for i in items:
        members.setdefault(example(i), []).append(i)
    near = {i: d.split("near duplicate of ")[1].split(" (")[0] for i, (r, d) in rej.items() if r == "near_duplicate"}
    wrong = {i: rep for i, rep in near.items() if example(by_id[i]) != example(by_id[rep])}
    cos = lambda a, b: float(vecs[a] @ vecs[b]) / 2  # noqa: E731
    inst = [i for i in items if i.kind == "instance"]
    math_inst = [i for i in inst if i.category == "math"]
    alive = lambda ex: sum(m.id not in rej for m in members[ex])  # noqa: E731
    rw = [i for i in items if i.kind == "rewording"]
    reach = [i for i in rw if all(cos(i.id, m.id) >= THRESHOLD for m in members[i.of] if m.id != i.id)]
    lost_by_template: dict[str, int] = {}
    for i in math_inst:
        if i.id in wrong:
            lost_by_template[i.template] = lost_by_template.get(i.template, 0) + 1
    negs = [i for i in items if i.kind == "negative"]
    uc = [i for i in items if i.kind == "unicode_copy"]
    m = read_manifest(out_uri)
    from pipeline_core.handoffs import FilterReports

    nd = FilterReports.from_manifest(m).near_duplicates
    return {
        "math_variants": len(math_inst), "math_variants_dropped_for_another": sum(i.id in wrong for i in math_inst),
        "code_variants": len(inst) - len(math_inst),
        "code_variants_dropped_for_another": sum(i.id in wrong for i in inst if i.category == "code"),
        "variants_dropped_by_template": lost_by_template,
        "wrong_drops": len(wrong), "examples": len(members), "examples_lost": sum(alive(e) == 0 for e in members),
        "hard_negatives": len(negs), "hard_negatives_dropped": sum(i.id in near for i in negs),
        "rewordings": len(rw), "rewordings_found": sum(alive(i.of) == 1 for i in rw),
        "rewording_recall": round(sum(alive(i.of) == 1 for i in rw) / len(rw), 4),
        "rewordings_within_threshold": len(reach), "rewordings_within_threshold_found": sum(alive(i.of) == 1 for i in reach),
        "rewording_recall_within_threshold": round(sum(alive(i.of) == 1 for i in reach) / max(1, len(reach)), 4),
        # the recall: the duplicate went (at most one row of the example left, none is over-removal)
        "rewordings_within_threshold_removed": sum(alive(i.of) <= 1 for i in reach),
        "unicode_copies": len(uc),
        "unicode_copies_exact": sum("exact_duplicate" in (rej.get(i.id, ("",))[0], rej.get(i.of, ("",))[0]) for i in uc),
        "near_rejects": len(near), "chain_rejects": sum(1 for r in near.values() if r in rej),
        "counts": m.counts, "guard_saved_pairs": nd.guard_saved_pairs if nd else None,
        "guard_saved_by_split": nd.guard_saved_by_split if nd else None,
        "measured_recall": nd.measured.recall if nd and nd.measured else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--variants", type=int, default=48, help="instances per math template (10 templates)")
    ap.add_argument("--run", action="append", required=True, help="LABEL:PYTHON:CODE_ROOT:GUARD (GUARD empty = none set)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reuse", action="store_true", help="a run whose output is committed is analysed, not re-run")
    a = ap.parse_args(argv)
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                 "machine": f"{platform.node()} {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}",
                 "command": "bench/neardup_guard_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "runs": {}}
    in_uri, items, vecs = build_input(work, a.variants)
    res["records"] = len(items)
    for spec in a.run:
        label, python, root, guard = spec.split(":")
        from pipeline_core import uris
        from pipeline_core.artifacts import read_manifest

        done = uris.qualify(work / "store" / "datasets" / "g" / "train" / label)
        if a.reuse and read_manifest(done) is not None:  # analyse a committed run again
            out_uri, secs = done, float("nan")
        else:
            out_uri, secs = run_filter(label, os.path.abspath(python), os.path.abspath(root), guard, in_uri, work)
        r = {"seconds": round(secs, 1), **analyse(out_uri, items, vecs, work, label)}
        res["runs"][label] = r
        print(json.dumps({label: r}), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
