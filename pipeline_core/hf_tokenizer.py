"""The mistral-common SentencePiece models the filter renders with, and their exact Hugging Face form.

`MISTRAL_COMMON_FILES` names the model file of each `filter.tokenizer` value that mistral-common
ships (the filter encodes with it; the trainer exports it). `save_sentencepiece_tokenizer` writes
HF tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model) whose ids equal
SentencePiece's for any text.

Why not transformers' conversion as is: it ranks the BPE merges of a SentencePiece model by piece
*id*; SentencePiece merges by piece *score*. Mistral's whitespace-only pieces ('▁▁' … '▁'×16) have
low ids but the lowest score (-1e9), so SentencePiece joins a run of spaces only after its last
space has merged with the word that follows, and the converted tokenizer first: '    total' is
'▁▁▁', '▁total' in training and '▁▁▁▁', 'total' there (every indented line of code). Ranking the same
merges by score (transformers' own `generate_merges(vocab, vocab_scores)`, what its Gemma converter
does) gives SentencePiece's ids; checked here on probe strings at every build. Measured once on
~30k texts (standard-library source, random strings of spaces, tabs, newlines and non-Latin
characters, runs of 1-69 spaces): 0 differences for v1 and v3 (the converted tokenizer: nearly
half of them differ); tests/test_export_tokenizer.py repeats it on ~4.5k.

One difference remains, of the HF pipeline rather than the vocabulary: a plain `encode(text)` of a
text that *starts* with a space gets no extra dummy prefix (HF's Metaspace adds '▁' only to a text
that does not start with one; SentencePiece always adds it). Chat templates write the space
themselves (spark_jobs/conversations/chat_templates.py), so `apply_chat_template` is exact.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

MISTRAL_COMMON_FILES = {
    "mistral-v1": "tokenizer.model.v1",
    "mistral-v3": "mistral_instruct_tokenizer_240323.model.v3",
}

# Runs of spaces before words, digits and line ends, tabs, leading/trailing spaces: the shapes the
# id-ranked conversion got wrong. Checked against SentencePiece every time the files are written.
PROBES = ("def f(x):\n    total = 0\n\tfor i in range(3):\n        total += i   \n    return total",
          "a  b   c    d     1      2" + " " * 17 + "x" + " " * 33 + "3", "trailing  ", "x \n  \n")


def mistral_common_file(name: str) -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / MISTRAL_COMMON_FILES[name]


def save_sentencepiece_tokenizer(name: str, out_dir: Path) -> None:
    """HF tokenizer files of the mistral-common model `name` (a `MISTRAL_COMMON_FILES` key) into
    `out_dir`: its control tokens special, `<s>` added by `encode`, merges ranked by score."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    src = mistral_common_file(name)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(src, Path(tmp) / "tokenizer.model")
        tok = LlamaTokenizer.from_pretrained(tmp, add_bos_token=True, add_eos_token=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    sp = spm.SentencePieceProcessor(model_file=str(src))
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    path = out_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["model"]["merges"] = [list(m) for m in generate_merges(spec["model"]["vocab"], scores)]
    path.write_text(json.dumps(spec, ensure_ascii=False))
    shutil.copy(src, out_dir / "tokenizer.model")
    check_against_sentencepiece(out_dir, name)


def check_against_sentencepiece(tokenizer_dir: Path, name: str, texts=PROBES) -> None:
    """Raise when the HF tokenizer in `tokenizer_dir` encodes a text unlike mistral-common's model."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(mistral_common_file(name)))
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in texts:
        want, got = sp.encode(text), hf.encode(text, add_special_tokens=False)
        at = first_difference(want, got)
        if at is not None:
            raise RuntimeError(
                f"the HF tokenizer written for {name!r} encodes {text!r} unlike SentencePiece from token {at}: "
                f"{[sp.id_to_piece(i) for i in want[at:at + 4]]} != {hf.convert_ids_to_tokens(got[at:at + 4])}")


def first_difference(a, b) -> int | None:
    """Index of the first position where two id sequences differ (a shorter one ends there); None if equal."""
    n = min(len(a), len(b))
    at = next((i for i in range(n) if a[i] != b[i]), n)
    return None if at == n and len(a) == len(b) else at
