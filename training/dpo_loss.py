"""DPO on the last pipeline stage: per-document summed log-probabilities from packed pair rows.

A DPO train-ready row holds one pair (spark_jobs/preference.py): document 1 is the chosen side,
document 2 the rejected side (position ids restart at each), then padding. The last stage gets
``labels = (targets, side, reference, row)`` (training/dpo_data.py): the shifted targets, which
side each target belongs to (0 chosen, 1 rejected, -1 none; from the position-id segments), the
reference model's summed log-probs of the row's two sides, and the row's index in its split.

Log-probs never need the [tokens, vocab] logits: the head hands over ``(hidden, lm_head.weight)``
(``fast_kernels.fused_lm_head_forward``, the fused loss path's seam) and only the target tokens'
hidden states are projected, a chunk at a time, each chunk recomputed in backward
(``torch.utils.checkpoint``), so at most one chunk's logits exist at once.

Loss (TRL DPOTrainer's definitions): with margin d = (pi_c - ref_c) - (pi_r - ref_r),
  sigmoid: -(1-ls) log sigma(beta d) - ls log sigma(-beta d);   ipo: (d_c/n_c - d_r/n_r - 1/(2 beta))^2
(IPO per-token normalised, as TRL does). Rewards: beta (pi - ref) per side. The step loss is the
mean over the step's pairs across micro-batches and data-parallel ranks: ``begin`` sets the scale
exactly as ``loss.TokenMeanLoss`` does for tokens (``StepBatches`` counts pairs through ``count``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from training.loss import IGNORE_INDEX

CHOSEN, REJECTED = 0, 1
LOGP_CHUNK = 4096  # target tokens projected onto the vocabulary at once


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def target_logps(outputs, targets: torch.Tensor, chunk: int = LOGP_CHUNK) -> torch.Tensor:
    """log p(target) at every target position ([B, S] fp32, 0 where targets == -100). ``outputs`` is
    the last stage's: ``(hidden, head weight)`` (fused head) or logits [B, S, V]."""
    flat_t = targets.reshape(-1)
    where = torch.nonzero(flat_t != IGNORE_INDEX).flatten()
    t = flat_t[where].long()
    if isinstance(outputs, tuple | list):
        hidden, weight = outputs
        h = hidden.reshape(-1, hidden.shape[-1])[where]
        parts = []
        for a in range(0, len(t), chunk):
            args = (h[a:a + chunk], weight, t[a:a + chunk])
            parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False) if torch.is_grad_enabled()
                         else _chunk_logps(*args))
        picked = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)
    else:
        logits = outputs.reshape(-1, outputs.shape[-1])[where].float()
        picked = logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    out = torch.zeros(flat_t.shape, dtype=torch.float32, device=targets.device)
    return out.index_put((where,), picked).view(targets.shape)


def side_sums(token_logps: torch.Tensor, side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (summed log-probs [B, 2], target counts [B, 2]) of its chosen and rejected documents."""
    sums = torch.stack([(token_logps * (side == s)).sum(-1) for s in (CHOSEN, REJECTED)], dim=-1)
    counts = torch.stack([(side == s).sum(-1) for s in (CHOSEN, REJECTED)], dim=-1)
    return sums, counts


@dataclass(frozen=True)
class PairTerms:
    losses: torch.Tensor  # [P]
    chosen_rewards: torch.Tensor  # [P], detached
    rejected_rewards: torch.Tensor


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, *, beta: float,
                label_smoothing: float = 0.0, loss_type: str = "sigmoid") -> PairTerms:
    """DPO/IPO per pair from [P, 2] (chosen, rejected) summed log-probs of policy and reference."""
    ratios = policy - reference.to(policy.dtype)
    delta = ratios[:, CHOSEN] - ratios[:, REJECTED]
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "ipo":
        per_token = ratios / counts.clamp(min=1).to(ratios.dtype)
        losses = (per_token[:, CHOSEN] - per_token[:, REJECTED] - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"train.dpo.loss_type: unknown {loss_type!r}")
    rewards = beta * ratios.detach()
    return PairTerms(losses, rewards[:, CHOSEN], rewards[:, REJECTED])


STAT_FIELDS = ("pairs", "loss", "correct", "chosen_reward", "rejected_reward")


@dataclass(frozen=True)
class DPOMetrics:
    """Means over the pairs of a step (or an evaluation), all data-parallel ranks."""

    pairs: int
    loss: float | None
    reward_accuracy: float | None  # share of pairs whose chosen reward > rejected reward
    chosen_reward: float | None
    rejected_reward: float | None

    @property
    def margin(self) -> float | None:
        return None if self.pairs == 0 else self.chosen_reward - self.rejected_reward

    def as_row(self, prefix: str = "") -> dict[str, float | int | None]:
        return {f"{prefix}pairs": self.pairs, f"{prefix}dpo_loss": self.loss,
                f"{prefix}reward_accuracy": self.reward_accuracy, f"{prefix}chosen_reward": self.chosen_reward,
                f"{prefix}rejected_reward": self.rejected_reward, f"{prefix}reward_margin": self.margin}

    @classmethod
    def from_sums(cls, sums: list[float]) -> DPOMetrics:
        n, loss, correct, ch, rj = sums
        if n == 0:
            return cls(0, None, None, None, None)
        return cls(int(n), loss / n, correct / n, ch / n, rj / n)


class DPOLoss:
    """``loss_fn`` of the PipelineModule for objective dpo (same contract as ``TokenMeanLoss``:
    ``begin`` per step, ``count`` for ``StepBatches``). With ``collect`` set (the reference pass)
    it records each row's summed log-probs instead of a loss."""

    def __init__(self, beta: float, label_smoothing: float = 0.0, loss_type: str = "sigmoid"):
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type
        self.scale: float | None = None
        self.targets = 0  # the current step's global pair count (the trainer logs it as TokenMeanLoss's)
        self.collect: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float64)

    @staticmethod
    def count(labels) -> torch.Tensor:
        """Pairs in a micro-batch: one per row."""
        return torch.tensor(labels[0].shape[0])

    def begin(self, global_pairs: int, micro_batches: int, dp_size: int) -> None:
        self.targets = global_pairs
        self.scale = micro_batches * dp_size / max(global_pairs, 1)

    def __call__(self, outputs, labels) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("DPOLoss.begin() was not called for this step (use StepBatches)")
        targets, side, reference, row = labels
        policy, counts = side_sums(target_logps(outputs, targets), side)
        if self.collect is not None:
            self.collect.append((row.detach().cpu(), policy.detach().cpu(), counts.detach().cpu()))
            return policy.sum() * 0.0
        terms = pair_losses(policy, reference, counts, beta=self.beta, label_smoothing=self.label_smoothing,
                            loss_type=self.loss_type)
        self._stats += torch.tensor([
            len(terms.losses), float(terms.losses.detach().sum()),
            float((terms.chosen_rewards > terms.rejected_rewards).sum()),
            float(terms.chosen_rewards.sum()), float(terms.rejected_rewards.sum())], dtype=torch.float64)
        return terms.losses.sum() * self.scale

    def take_metrics(self, dp_group=None, device: torch.device | None = None) -> DPOMetrics:
        """The pairs seen since the last call, summed over data-parallel ranks (a collective on the
        last stage's dp group), then reset."""
        sums = self._stats.clone()
        self._stats.zero_()
        if dp_group is not None:
            import torch.distributed as dist

            if dist.get_world_size(dp_group) > 1:
                t = sums.to(device or torch.device("cpu"))
                dist.all_reduce(t, group=dp_group)
                sums = t.cpu()
        return DPOMetrics.from_sums(sums.tolist())
