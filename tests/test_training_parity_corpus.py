"""bench/parity_corpus.py: docstrings -> the filter stage's own render (real Mistral v1 tokenizer,
chat template, length limits) -> compact documents -> its own packing -> a train-ready directory
the trainer's loader reads. Every document is accounted for (kept or rejected with its reason), the
rows keep the train-ready contract, and packing loses no token."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pyarrow.parquet as pq

from bench import parity_corpus

SEQ = 256


def _source(tmp_path):
    long = "word " * 400  # > SEQ tokens: rejected by the length limit (overflow: reject)
    text = textwrap.dedent(f'''
        """Module docstring that explains what this small module is for, in plain English words."""

        def alpha():
            """Return the first letter of the Greek alphabet as a string; used by the tests only."""

        def beta():
            """Return the second letter of the Greek alphabet as a string; used by the tests only."""

        def gamma():
            """{long}"""

        def delta():
            """Return the second letter of the Greek alphabet as a string; used by the tests only."""
    ''')
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(text)
    return root


def test_docstrings_render_and_pack_into_train_ready_rows(tmp_path):
    root = _source(tmp_path)
    docs = tmp_path / "docs.npz"
    assert parity_corpus.main(["render", "--out", str(docs), "--tokens", "100000", "--seq-len", str(SEQ),
                               "--min-chars", "50", "--roots", str(root)]) == 0
    meta, documents = parity_corpus.load_documents(docs)
    # 5 docstrings, one a duplicate (delta = beta) read once, one too long: 3 kept + 1 rejected
    assert len(documents) == 3 and meta["rejected"] == {"too_long": 1}
    out = tmp_path / "ready"
    assert parity_corpus.main(["pack", "--docs", str(docs), "--out", str(out), "--seq-len", str(SEQ)]) == 0
    ready = json.loads((out / "train_ready.json").read_text())
    assert ready["counts"] == {"in": 4, "out": 3, "rejected": {"too_long": 1}}  # in = out + rejected
    info = ready["info"]
    assert info["seq_len"] == SEQ and info["tokenizer"]["name"] == "mistral-v1" and info["tokenizer"]["vocab_size"] == 32000
    total = {"train": 0, "val": 0}
    for split in total:
        path = out / "data" / split / "part-00000.parquet"
        if info["documents"].get(split, 0) == 0:
            continue
        table = pq.read_table(path).to_pylist()
        assert len(table) == info["sequences"][split]
        for row in table:
            ids, labels, pos = (np.asarray(row[c]) for c in ("input_ids", "labels", "position_ids"))
            assert len(ids) == len(labels) == len(pos) == SEQ
            assert np.all((labels == -100) | (labels == ids))  # trained tokens are the tokens themselves
            assert pos[0] == 0 and np.all((np.diff(pos) == 1) | (pos[1:] == 0))  # positions restart per document
            total[split] += int((labels != -100).sum())
    assert total == {s: info["target_tokens"].get(s, 0) for s in total}  # packing lost no trained token
    by_doc = [int((lab != -100).sum()) for _, lab, _ in documents]
    assert sum(total.values()) == sum(by_doc)
    # the prompt (user turn) carries no loss, the answer does
    ids, lab, _ = documents[0]
    assert lab[0] == -100 and (lab != -100).sum() > 10
