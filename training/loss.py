"""The step loss as the mean over all of a step's target tokens (torchtitan's rule, Megatron's
``--calculate-per-token-loss``), never a mean of per-micro-batch means.

DeepSpeed's pipeline engine divides each micro-batch's ``loss_fn`` output by the number of
micro-batches (for the backward and the reported loss) and averages gradients and the reported
loss over data-parallel ranks. So ``TokenMeanLoss`` returns ``Σ CE(micro-batch) × M × dp / T``,
where ``T`` is the step's target count summed over its ``M`` micro-batches and all ``dp`` ranks:
the step's gradient and reported loss both become ``Σ CE / T``. A micro-batch without targets
contributes nothing and dilutes nothing.

The last stage knows the step's labels before the step starts: ``StepBatches`` takes the step's
micro-batches from the loader, counts the targets, all-reduces the count over data parallel and
sets the scale; then hands DeepSpeed an iterator over exactly those micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pipeline_core.handoffs import IGNORE_INDEX

SumLoss = Callable[[object, torch.Tensor], torch.Tensor]  # (stage outputs, targets) -> Σ CE


class TokenMeanLoss:
    """``loss_fn`` of the PipelineModule. ``sum_fn`` computes the summed cross-entropy of one
    micro-batch (swappable: the fused Liger loss replaces it, same contract)."""

    def __init__(self, sum_fn: SumLoss):
        self.sum_fn = sum_fn
        self.scale: float | None = None
        self.targets = 0  # the current step's global target count (for logs and tests)

    @staticmethod
    def count(targets: torch.Tensor) -> torch.Tensor:
        """What the step mean divides by, in one micro-batch (``dpo_loss.DPOLoss`` counts pairs)."""
        return (targets != IGNORE_INDEX).sum()

    def begin(self, global_targets: int, micro_batches: int, dp_size: int) -> None:
        self.targets = global_targets
        # a step without a single target: every micro-batch's sum is 0, any finite scale gives 0
        self.scale = micro_batches * dp_size / max(global_targets, 1)

    def __call__(self, outputs, targets: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("TokenMeanLoss.begin() was not called for this step (use StepBatches)")
        return self.sum_fn(outputs, targets) * self.scale


class StepBatches:
    """Pulls one step's micro-batches from ``source`` and, on the last stage, sets the loss scale
    from their target count (all-reduced over ``dp_group``). Stages without data pass None."""

    def __init__(self, source: Iterator | None, loss: TokenMeanLoss | None, *, micro_batches: int, dp_size: int,
                 dp_group=None, device: torch.device | None = None):
        self.source, self.loss = source, loss
        self.micro_batches, self.dp_size, self.dp_group = micro_batches, dp_size, dp_group
        self.device = device or torch.device("cpu")

    def next_step(self, micro_batches: int | None = None) -> Iterator | None:
        m = micro_batches or self.micro_batches
        if self.source is None:
            return None
        batches = [next(self.source) for _ in range(m)]
        if self.loss is not None:
            # one device->host read for the step, not one per micro-batch
            local = int(torch.stack([self.loss.count(labels) for _, labels in batches]).sum()) if batches else 0
            self.loss.begin(self.all_reduce(local), m, self.dp_size)
        return iter(batches)

    def all_reduce(self, value: int) -> int:
        if self.dp_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return int(t.item())
