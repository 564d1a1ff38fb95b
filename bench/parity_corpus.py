"""A real-text train-ready corpus for loss-parity runs (FP8 vs bf16), built with the pipeline's own
render, length-limit and packing code and the real Mistral tokenizer, without a download.

Text: the docstrings of the Python files installed on this machine (the standard library, PSF
licence, and the project's virtual environment: open-source packages, mostly Apache-2.0 / BSD /
MIT), each docstring of at least ``--min-chars`` characters once (deduplicated by content), in path
order. Each becomes one conversation: the user asks what the documented object does, the
assistant answers with the docstring, i.e. English technical prose as the trained tokens. The
corpus is built where it runs and is not committed.

Two steps, so the large part travels small:

    python bench/parity_corpus.py render --out docs.npz --tokens 7000000     # here: tokenize + render
    python bench/parity_corpus.py pack --docs docs.npz --out DIR --seq-len 4096  # anywhere: pack

``render`` runs the filter stage's ``render_partitions`` (chat template, ``train_on``, length limits;
rejects counted) and stores the documents compactly (token ids as uint16, the loss mask as bits).
``pack`` runs the product's train-ready writer (spark_jobs/filter/train_ready.py: the filter stage's
packing, best-fit decreasing in buffers of ``pack_buffer_docs``, positions restarting per document)
and writes ``DIR/data/{train,val}/part-00000.parquet`` in the train-ready columns plus
``DIR/train_ready.json`` (the manifest's counts and ``extra``, a ``TrainReadyInfo``, as it describes them);
``bench/train_throughput.py --data DIR`` publishes it as a committed artifact and trains on it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VAL_EVERY = 100  # one document in VAL_EVERY (by content hash) goes to the val split


def default_roots() -> list[Path]:
    """The standard library, then the running interpreter's site-packages (the project's venv)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    return [stdlib, site] if site != stdlib else [stdlib]


def docstrings(roots: list[Path], min_chars: int) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of every module/class/function docstring of >= ``min_chars``
    characters under ``roots``, each text once, in path order (deterministic)."""
    seen: set[bytes] = set()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if root.name.startswith("python") and "site-packages" in rel.parts:
                continue  # the stdlib root also holds site-packages: walked as its own root
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            module = ".".join(rel.with_suffix("").parts)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                text = ast.get_docstring(node)
                if not text or len(text) < min_chars:
                    continue
                digest = hashlib.sha1(text.encode()).digest()
                if digest in seen:
                    continue
                seen.add(digest)
                yield (module if isinstance(node, ast.Module) else f"{module}.{node.name}"), text


def records(items: Iterator[tuple[str, str]]):
    """The filter's render input (RENDER_COLUMNS) for each docstring: one user/assistant exchange."""
    import pandas as pd

    rows = []
    for i, (name, text) in enumerate(items):
        split = "val" if int(hashlib.sha256(text.encode()).hexdigest(), 16) % VAL_EVERY == 0 else "train"
        messages = [{"role": "user", "content": f"What does `{name}` do? Explain it as its documentation would."},
                    {"role": "assistant", "content": text}]
        rows.append({"id": f"doc-{i:07d}", "category": "docs", "key": i, "split": split, "reason": None, "raw": None,
                     "messages_json": json.dumps(messages, ensure_ascii=False), "metadata": None, "reasoning": None,
                     "context_sentences": None, "context_turns": None, "context_question_scores": None})
        if len(rows) == 2048:
            yield pd.DataFrame(rows)
            rows = []
    if rows:
        yield pd.DataFrame(rows)


def render(args) -> int:
    from pipeline_core.config import FilterSection
    from spark_jobs.filter.render_docs import render_partitions

    fcfg = FilterSection(seq_len=args.seq_len, max_tokens=args.seq_len, tokenizer=args.tokenizer)
    ids, masks, lengths, splits, rejected = [], [], [], [], {}
    tokens = 0
    for out in render_partitions(records(docstrings(args.roots or default_roots(), args.min_chars)), fcfg):
        for rec in out.itertuples(index=False):
            if rec.reason is not None:
                rejected[rec.reason] = rejected.get(rec.reason, 0) + 1
                continue
            ids.append(np.asarray(rec.input_ids, dtype=np.uint16))
            masks.append(np.asarray(rec.labels) != -100)
            lengths.append(len(rec.input_ids))
            splits.append(rec.split == "val")
            tokens += len(rec.input_ids)
        print(f"rendered {len(lengths)} documents, {tokens:,} tokens", flush=True)
        if tokens >= args.tokens:
            break
    flat_mask = np.concatenate(masks)
    np.savez_compressed(args.out, ids=np.concatenate(ids), mask=np.packbits(flat_mask), n_mask=len(flat_mask),
                        lengths=np.asarray(lengths, dtype=np.int32), val=np.asarray(splits, dtype=bool),
                        meta=json.dumps({"tokenizer": args.tokenizer, "seq_len": args.seq_len, "rejected": rejected,
                                         "min_chars": args.min_chars, "sources": [str(r) for r in (args.roots or default_roots())]}))
    print(json.dumps({"documents": len(lengths), "tokens": tokens, "target_tokens": int(flat_mask.sum()),
                      "rejected": rejected, "out": str(args.out)}))
    return 0


def load_documents(path: Path) -> tuple[dict, list[tuple[np.ndarray, np.ndarray, bool]]]:
    """The rendered documents of ``render``: meta, [(input_ids int32, labels int32, is_val)]."""
    z = np.load(path)
    ids = z["ids"].astype(np.int32)
    mask = np.unpackbits(z["mask"])[: int(z["n_mask"])].astype(bool)
    docs, at = [], 0
    for n, val in zip(z["lengths"].tolist(), z["val"].tolist(), strict=True):
        doc_ids = ids[at:at + n]
        docs.append((doc_ids, np.where(mask[at:at + n], doc_ids, -100).astype(np.int32), bool(val)))
        at += n
    return json.loads(str(z["meta"])), docs


def pack(args) -> int:
    from pipeline_core.config import FilterSection
    from pipeline_core.handoffs import TrainReadyInfo, TrainReadySplits
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.filter.train_ready import document, stage_train_ready

    meta, docs = load_documents(args.docs)
    if args.seq_len != meta["seq_len"]:
        raise SystemExit(f"--seq-len {args.seq_len}: the documents were rendered for seq_len {meta['seq_len']}")
    tok = load_tokenizer(meta["tokenizer"])
    out = Path(args.out)
    fcfg = FilterSection()
    splits = {s: [document(ids, lab) for ids, lab, v in docs if v == (s == "val")] for s in ("train", "val")}
    counts, extra = stage_train_ready(  # the product writer's files and description, committed later
        out, splits, seq_len=args.seq_len, tokenizer=tok.spec_for_manifest(), rejected=meta["rejected"],
        train_on=fcfg.train_on, prompt_context=fcfg.prompt_context, tokenizer_details=tok.identity(),
        split_rule=f"1 in {VAL_EVERY} documents (by content hash) to val", buffers=fcfg.pack_buffer_docs)
    (out / "train_ready.json").write_text(json.dumps({"counts": counts.to_counts(), "info": extra, "source": meta}, indent=1))
    packed = TrainReadySplits.read(extra)
    print(json.dumps({"splits": {s: v.to_json_dict() for s, v in packed.splits.items()},
                      "packing_efficiency": TrainReadyInfo.read(extra).packing_efficiency, "out": str(out)}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="docstrings -> rendered, tokenized documents (.npz)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--tokens", type=int, default=7_000_000, help="stop once this many document tokens are rendered")
    r.add_argument("--seq-len", type=int, default=4096)
    r.add_argument("--tokenizer", default="mistral-v1")
    r.add_argument("--min-chars", type=int, default=300)
    r.add_argument("--roots", type=Path, nargs="*", default=None, help="default: the stdlib and site-packages")
    k = sub.add_parser("pack", help="rendered documents -> a train-ready directory")
    k.add_argument("--docs", type=Path, required=True)
    k.add_argument("--out", type=Path, required=True)
    k.add_argument("--seq-len", type=int, default=4096)
    args = p.parse_args(argv)
    return render(args) if args.cmd == "render" else pack(args)


if __name__ == "__main__":
    raise SystemExit(main())
