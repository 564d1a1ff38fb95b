"""The exported model's tokenizer: the one that reproduces the tokens the model was trained on.

The train-ready artifact's `TokenizerSpec` says what the filter rendered with. For `mistral-v1` /
`mistral-v3` the export writes the HF form of that same mistral-common SentencePiece model
(`pipeline_core.hf_tokenizer`: merges ranked by score, so runs of spaces split as in training), not
the base model's converted tokenizer, which splits them differently. For an HF tokenizer spec the
base model's tokenizer files are copied (the filter rendered with an HF tokenizer of the same
vocabulary). Either way the training chat template and the padding token (`TokenizerSpec.pad_id`,
what packing filled rows with) are set, and `training.render_check` verifies the result against the
training documents before anything is published.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline_core.handoffs import TokenizerSpec
from pipeline_core.hf_tokenizer import MISTRAL_COMMON_FILES, save_sentencepiece_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json")


def export_tokenizer(out_dir: Path, base_dir: Path, spec: TokenizerSpec | None) -> None:
    """Tokenizer files into `out_dir` (next to the exported weights)."""
    if spec is not None and spec.name in MISTRAL_COMMON_FILES:
        save_sentencepiece_tokenizer(spec.name, out_dir)
    else:  # an HF tokenizer spec, or an artifact from before the typed hand-off
        copy_tokenizer(base_dir, out_dir)
    if spec is None:
        return
    if spec.chat_template is not None:
        set_chat_template(out_dir, spec.chat_template)
    if spec.pad_id is not None:
        set_pad_token(out_dir, spec.pad_id)


def copy_tokenizer(base_dir: Path, out_dir: Path) -> None:
    """The base model's tokenizer files, verbatim (a missing tokenizer is an error: the export must
    be usable on its own)."""
    copied = [n for n in _TOKENIZER_FILES if (base_dir / n).exists()]
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in base model {base_dir}")
    for name in copied:
        shutil.copy2(base_dir / name, out_dir / name)


def _edit_config(out_dir: Path, **fields) -> None:
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.update(fields)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def set_chat_template(out_dir: Path, chat_template: str) -> None:
    """tokenizer_config.json's ``chat_template`` and chat_template.jinja (which transformers
    prefers when present) both become the training template."""
    _edit_config(out_dir, chat_template=chat_template)
    (out_dir / "chat_template.jinja").write_text(chat_template)
    (out_dir / "chat_template.json").unlink(missing_ok=True)


def set_pad_token(out_dir: Path, pad_id: int) -> None:
    """The token of id `pad_id` becomes the tokenizer's pad token (Mistral's vocabularies have none:
    the filter packs with `<unk>`, id 0, which encoded text never contains)."""
    from transformers import AutoTokenizer

    token = AutoTokenizer.from_pretrained(str(out_dir)).convert_ids_to_tokens(pad_id)
    _edit_config(out_dir, pad_token=token)
    got = AutoTokenizer.from_pretrained(str(out_dir)).pad_token_id
    if got != pad_id:
        raise RuntimeError(f"the exported tokenizer's pad token {token!r} has id {got}, not the packing's {pad_id}")
