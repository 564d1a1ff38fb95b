"""FP8 linear layers for training (``train.fp8``): torchao's float8 training, as torchtitan uses it.

Every ``nn.Linear`` of the decoder layers becomes torchao's ``Float8Linear`` (same parameter
objects and names, so weight loading, checkpoints and export do not change): inputs, weights and
output gradients are cast to float8 with dynamic scales each micro-batch and the three GEMMs of
the layer run in float8 with higher-precision accumulation; the bf16 weights, the fp32 master
copy and the optimizer are untouched. Recipes: ``tensorwise`` (one scale per tensor, cuBLAS) and
``rowwise`` (one scale per row, CUTLASS; more accurate, slower). The embedding, the final norm and
the LM head (whose fused loss reads its weight directly) stay bf16.

The casts are separate elementwise passes unless ``torch.compile`` fuses them into their
neighbours, so FP8 is fast only with ``train.compile_layers`` (torchao's and torchtitan's advice).
"""

from __future__ import annotations

from torch import nn

FP8_RECIPES = ("tensorwise", "rowwise")
_ALIGN = 16  # float8 GEMMs need both dimensions divisible by 16


def convert_linears_to_fp8(module: nn.Module, within: type, recipe: str) -> int:
    """Swap the ``nn.Linear`` layers inside modules of type ``within`` for ``Float8Linear`` with
    ``recipe``'s scaling. Returns how many were swapped."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8: unknown recipe {recipe!r}, expected one of {list(FP8_RECIPES)}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:  # pragma: no cover - torchao is pinned in the lock
        raise RuntimeError("train.fp8 needs the torchao package (pinned in requirements/lock.txt)") from exc

    wanted = set()
    for name, block in module.named_modules():
        if isinstance(block, within):
            for sub_name, sub in block.named_modules():
                if (type(sub) is nn.Linear and sub.in_features % _ALIGN == 0 and sub.out_features % _ALIGN == 0):
                    wanted.add(f"{name}.{sub_name}" if name else sub_name)
    if not wanted:
        return 0
    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda _mod, fqn: fqn in wanted)
    return len(wanted)
