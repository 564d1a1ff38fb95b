"""Does the exported tokenizer reproduce the filter's training documents? Counts per kind of conversation.

    python bench/render_parity.py --run-sample DIR      # enrich -> filter the bundled sample (embedded
                                                        # defaults, Spark local[2]) into DIR, then measure
    python bench/render_parity.py --artifact URI        # a committed train-ready artifact

The documents are the artifact's render sample (`pipeline_core.render_sample`: with the default
`filter.render_sample_documents` every kept document of the bundled sample). Each is rendered with
`apply_chat_template` of two tokenizers, as `training.render_check.compare` does at export:
  - `export`: what the trainer publishes (`training.export_tokenizer` for the artifact's tokenizer spec);
  - `base-converted`: transformers' conversion of the same model file (what a base model ships, the tiny
    model's too) with the training chat template: what the export copied before issue 27.
A document matches when its whole conversation and its final answer's generation prompt are the
trained ids token for token. Prints one JSON object (counts per kind, the first mismatches).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def kinds(doc) -> list[str]:
    roles = [m["role"] for m in doc.messages]
    text = "\n".join(str(m.get("content") or "") for m in doc.messages)
    out = ["all"]
    if "system" in roles:
        out.append("system prompt")
    if doc.tools or "tool" in roles:
        out.append("tools")
    if roles.count("assistant") > 1:
        out.append("multi-turn")
    if "```" in text or "\n    " in text or "\t" in text:
        out.append("code / indentation")
    if "  " in text:
        out.append("runs of spaces")
    return out


def run_sample(root: Path) -> str:
    """enrich -> filter of the bundled sample with the embedded defaults (what `make demo` renders)."""
    from pipeline_core import uris
    from pipeline_core.config import load_config
    from spark_jobs.enrich import job as enrich
    from spark_jobs.filter.job import run

    cfg = load_config(env={}, overrides={
        "pipeline": {"store_uri": uris.qualify(root / "store"), "staging_uri": uris.qualify(root / "staging")},
        "enrich": {"spark_master": "local[2]", "shuffle_partitions": 2},
        "filter": {"spark_master": "local[2]", "shuffle_partitions": 2},
    })
    enriched, out = uris.join(cfg.pipeline.store_uri, "enriched"), uris.join(cfg.pipeline.store_uri, "train")
    enrich.run(uris.qualify(REPO / "sample_data" / "nemotron_v1"), enriched, cfg)
    manifest = run(enriched, out, cfg)
    print(json.dumps({"filter_counts": manifest.counts}), file=sys.stderr)
    return out


def converted(name: str, out: Path) -> None:
    """transformers' own conversion of the mistral-common model (as a base model ships it; training.tiny's)."""
    import shutil

    from transformers import LlamaTokenizer

    from pipeline_core.hf_tokenizer import mistral_common_file

    with tempfile.TemporaryDirectory() as src:
        shutil.copy(mistral_common_file(name), Path(src) / "tokenizer.model")
        LlamaTokenizer.from_pretrained(src, add_bos_token=True, add_eos_token=False).save_pretrained(str(out))


def measure(uri: str) -> dict:
    from transformers import AutoTokenizer

    from pipeline_core.artifacts import fetch_artifact
    from pipeline_core.handoffs import TrainReadyInfo
    from pipeline_core.render_sample import SAMPLE_DIR, read_sample
    from training.export_tokenizer import copy_tokenizer, export_tokenizer, set_chat_template
    from training.render_check import compare

    with tempfile.TemporaryDirectory() as tmp:
        spec = TrainReadyInfo.from_manifest(fetch_artifact(uri, Path(tmp) / "artifact", prefix=SAMPLE_DIR)).tokenizer
        docs = list(read_sample(Path(tmp) / "artifact"))
        base, exported, old = Path(tmp) / "base", Path(tmp) / "export", Path(tmp) / "base-converted"
        for d in (base, exported, old):
            d.mkdir()
        converted(spec.name, base)
        export_tokenizer(exported, base, spec)
        copy_tokenizer(base, old)
        set_chat_template(old, spec.chat_template)
        toks = {"export": AutoTokenizer.from_pretrained(str(exported)),
                "base-converted": AutoTokenizer.from_pretrained(str(old))}
        result: dict = {"tokenizer": spec.name, "documents": len(docs)}
        for name, tok in toks.items():
            counts: dict[str, list[int]] = {}
            first = []
            for doc in docs:
                diff, _ = compare(tok, doc)
                for k in kinds(doc):
                    c = counts.setdefault(k, [0, 0])
                    c[0] += diff is None
                    c[1] += 1
                if diff is not None and len(first) < 3:
                    a = diff.at
                    first.append({"id": doc.id, "what": diff.what, "at": a,
                                  "trained": tok.convert_ids_to_tokens(diff.want[max(0, a - 2):a + 3]),
                                  "rendered": tok.convert_ids_to_tokens(diff.got[max(0, a - 2):a + 3])})
            result[name] = {"match": {k: f"{v[0]}/{v[1]}" for k, v in counts.items()}, "first_mismatches": first}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--artifact", help="a committed train-ready artifact URI")
    g.add_argument("--run-sample", type=Path, help="work directory for enrich -> filter of the bundled sample")
    args = p.parse_args(argv)
    artifact = args.artifact or run_sample(args.run_sample)
    print(json.dumps(measure(artifact), indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
