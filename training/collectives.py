"""Object collectives over torch.distributed that the trainer and the DPO reference pass share:
small Python values (paths, counts, metrics) agreed across ranks, not tensors."""

from __future__ import annotations

from pathlib import Path


def broadcast(obj, src: int = 0, group=None):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agreed_staging(staging: Path, group=None) -> Path:
    """Rank 0's attempt directory on every rank (its attempt id names the lease holder too): agents
    of one launch may count restarts differently, and a rank writing elsewhere would leave its
    checkpoint markers where rank 0 never looks."""
    return Path(broadcast(str(staging), group=group))


def gather_all(value, group=None) -> list:
    import torch.distributed as dist

    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def gather_value(value, group=None):
    """The one non-None value (e.g. the last stage's), on every rank."""
    return next((v for v in gather_all(value, group) if v is not None), None)
