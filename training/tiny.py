"""The embedded base model (`train.base_model: tiny`): a small random Mistral-architecture model
with the real Mistral-7B-v0.1 tokenizer (shipped in mistral-common), built deterministically on
first use. Same code path as a real checkpoint: config.json + safetensors shards + tokenizer."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

TINY_CONFIG = dict(
    vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, sliding_window=None, tie_word_embeddings=False,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)


def mistral_v1_tokenizer_file() -> Path:
    import mistral_common

    return Path(os.path.dirname(mistral_common.__file__)) / "data" / "tokenizer.model.v1"


def save_mistral_tokenizer(out_dir: Path) -> None:
    """The real Mistral v1 sentencepiece model as an HF tokenizer (tokenizer.json + the .model)."""
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as src:
        shutil.copy(mistral_v1_tokenizer_file(), Path(src) / "tokenizer.model")
        LlamaTokenizer.from_pretrained(src, add_bos_token=True, add_eos_token=False).save_pretrained(str(out_dir))
    shutil.copy(mistral_v1_tokenizer_file(), out_dir / "tokenizer.model")


def make_tiny_model(out_dir: Path, seed: int = 0, max_shard_size: str | None = "600KB", **overrides) -> Path:
    """save_pretrained of a seeded random MistralForCausalLM (fp32), sharded so the index path is used."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = MistralForCausalLM(MistralConfig(**{**TINY_CONFIG, **overrides})).float()
    finally:
        torch.random.set_rng_state(gen_state)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), safe_serialization=True, **kwargs)
    save_mistral_tokenizer(out_dir)
    return out_dir


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Build once into cache_dir/tiny-mistral (atomic rename: concurrent ranks are safe)."""
    final = cache_dir / "tiny-mistral"
    if (final / "config.json").exists():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir))
    make_tiny_model(tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another rank won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return final
