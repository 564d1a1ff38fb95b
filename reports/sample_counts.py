"""The bundled sample's counts in the docs, generated from a real run so they cannot drift.

`python -m reports.sample_counts` runs enrich -> filter on `sample_data/nemotron_v1` (Spark
local[2], a temporary local store, the settings below) and rewrites each docs block between
`<!-- sample-counts -->` and `<!-- /sample-counts -->`; `--check` only compares (exit 1 on a
difference). tests/test_filter_conversations.py checks the blocks against its own run of the same
stages on the sample, so a change of the sample or of a stage that moves a count fails there.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline_core.artifacts import Manifest
    from pipeline_core.config import Config

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "nemotron_v1"
DOCS = (REPO / "README.md", REPO / "sample_data" / "README.md", REPO / "docs" / "enrich.md")
BEGIN, END = "<!-- sample-counts -->", "<!-- /sample-counts -->"
BLOCK = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
# the filter settings of the documented run (tests/test_filter_conversations.py uses them too)
FILTER = {"seq_len": 512, "max_tokens": 2048, "val_fraction": 0.2, "overflow": "truncate"}


def _reasons(rejected: dict[str, int]) -> str:
    return ", ".join(f"{n} `{r}`" for r, n in sorted(rejected.items(), key=lambda kv: (-kv[1], kv[0])))


def render(enrich_counts: dict, filter_counts: dict) -> str:
    """One sentence: records in -> enriched -> kept, each rejected count by reason."""
    e, f = enrich_counts, filter_counts
    text = (f"{e['in']} records → enrich keeps {e['out']} ({sum(e['rejected'].values())} rejected: "
            f"{_reasons(e['rejected'])}) → filter (seq_len {FILTER['seq_len']}) keeps {f['out']} "
            f"({sum(f['rejected'].values())} rejected: {_reasons(f['rejected'])})")
    return f"{BEGIN}{text}{END}"


def blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def run_sample(root: Path, spark=None) -> tuple[Config, Manifest, Manifest]:
    """(config, enrich manifest, filter manifest) of a real enrich -> filter run on the sample,
    its store under `root`."""
    from pipeline_core import uris
    from pipeline_core.config import load_config
    from spark_jobs.enrich import job as enrich
    from spark_jobs.filter.job import run

    cfg = load_config(env={}, overrides={
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")},
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2},
        "filter": FILTER,
    })
    enriched = uris.join(cfg.pipeline.store_uri, "enriched")
    em = enrich.run(uris.qualify(SAMPLE), enriched, cfg, spark=spark)
    fm = run(enriched, uris.join(cfg.pipeline.store_uri, "train"), cfg, spark=spark)
    return cfg, em, fm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when a doc differs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        _, em, fm = run_sample(Path(tmp))
        block = render(em.counts, fm.counts)
    stale = [d for d in DOCS if set(blocks(d)) != {block}]
    print(block)
    if args.check:
        for d in stale:
            print(f"stale: {d.relative_to(REPO)}", file=sys.stderr)
        return 1 if stale else 0
    for d in stale:
        if not blocks(d):
            print(f"no {BEGIN} block in {d.relative_to(REPO)}: add one where the counts belong", file=sys.stderr)
            return 1
        d.write_text(BLOCK.sub(lambda _: block, d.read_text()))
        print(f"updated {d.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
