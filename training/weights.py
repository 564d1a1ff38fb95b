"""Base weights in, Hugging Face model out, one pipeline stage at a time.

Loading reads only the tensors this rank's layers own, straight from the safetensors shards
(via ``model.safetensors.index.json``), so no rank ever materialises the whole model.
Export writes one safetensors shard per stage plus the index, config, generation config and
tokenizer: a directory ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import MistralConfig

from pipeline_core.handoffs import TokenizerSpec
from training.export_tokenizer import export_tokenizer
from training.model import hf_named_tensors

log = logging.getLogger(__name__)

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "tokenizer*"]


def resolve_model_dir(name_or_path: str) -> Path:
    """A local HF directory as is; otherwise a hub id fetched (config, safetensors, tokenizer)
    into the HF cache, which is what ``from_pretrained`` itself does."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if name_or_path.startswith("file://"):
        from pipeline_core.uris import to_local_path

        return to_local_path(name_or_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=_DOWNLOAD_PATTERNS))



def weight_map(model_dir: Path) -> dict[str, str]:
    """HF tensor name -> safetensors file name."""
    index = model_dir / SAFE_INDEX
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = model_dir / SAFE_SINGLE
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {k: SAFE_SINGLE for k in f.keys()}
    raise FileNotFoundError(f"train.base_model: no {SAFE_INDEX} or {SAFE_SINGLE} in {model_dir} (safetensors required)")


@torch.no_grad()
def load_stage_weights(modules, model_dir: Path) -> int:
    """Copy the base weights of ``modules`` (this rank's pipe layers) in place; returns #tensors."""
    wanted = hf_named_tensors(modules)
    files = weight_map(model_dir)
    missing = sorted(k for k in wanted if k not in files)
    if missing:
        raise KeyError(f"base model {model_dir} lacks tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
    by_file: dict[str, list[str]] = defaultdict(list)
    for key in wanted:
        by_file[files[key]].append(key)
    for fname, keys in by_file.items():
        with safe_open(str(model_dir / fname), framework="pt", device="cpu") as f:
            for key in keys:
                src = f.get_tensor(key)
                dst = wanted[key]
                if src.shape != dst.shape:
                    raise ValueError(f"{key}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
                dst.copy_(src)
    return len(wanted)


def save_stage_shard(modules, out_dir: Path, stage_id: int, num_stages: int, dtype: torch.dtype) -> dict[str, str]:
    """Write this stage's tensors as one shard; returns its part of the weight map."""
    fname = f"model-{stage_id + 1:05d}-of-{num_stages:05d}.safetensors"
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in hf_named_tensors(modules).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
    return {k: fname for k in tensors}


def finish_export(out_dir: Path, weight_maps: list[dict[str, str]], base_dir: Path, config: MistralConfig,
                  dtype: torch.dtype, tokenizer: TokenizerSpec | None = None) -> None:
    """Index + config + generation config + tokenizer next to the shards (one rank calls this).
    ``tokenizer``: what the training data was rendered with (from the train-ready manifest): the
    export's tokenizer, chat template and pad token reproduce it (``training.export_tokenizer``)."""
    merged: dict[str, str] = {}
    for part in weight_maps:
        merged.update(part)
    total = 0
    for fname in set(merged.values()):
        with safe_open(str(out_dir / fname), framework="pt") as f:
            total += sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    total *= torch.finfo(dtype).bits // 8
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2))

    export_cfg = MistralConfig.from_dict(config.to_dict())
    export_cfg.torch_dtype = dtype
    export_cfg.architectures = ["MistralForCausalLM"]
    if tokenizer is not None and tokenizer.pad_id is not None:
        export_cfg.pad_token_id = tokenizer.pad_id
    export_cfg.save_pretrained(str(out_dir))

    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(str(base_dir))
    except OSError:
        gen = GenerationConfig.from_model_config(export_cfg)
    if export_cfg.pad_token_id is not None:
        gen.pad_token_id = export_cfg.pad_token_id
    gen.save_pretrained(str(out_dir))
    export_tokenizer(out_dir, base_dir, tokenizer)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
