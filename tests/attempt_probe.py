"""A stand-in training module for the multi-node attempt test: run by the launchers' torchrun agents
(`-m tests.attempt_probe`), it takes its attempt directory the way the trainer does
(training.lease.attempt_id, rank 0's broadcast by training.collectives.agreed_staging), writes this rank's
checkpoint marker (the RNG file) for step 2 unless $PROBE_SKIP_RANK names it, and rank 0 waits for
every rank's marker as the async uploader does. Results go to $PROBE_OUT."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from training import checkpoints as ckpt
from training.collectives import agreed_staging
from training.lease import attempt_id


def main() -> None:
    out = Path(os.environ["PROBE_OUT"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    staging = agreed_staging(out / "attempts" / attempt_id())
    local = staging / "checkpoints" / "step-2"
    (local / ckpt.TAG).mkdir(parents=True, exist_ok=True)
    if str(rank) != os.environ.get("PROBE_SKIP_RANK"):
        ckpt.save_rng(local / ckpt.TAG, rank)
    dist.barrier()
    (out / f"rank{rank}-{staging.name}").write_text(attempt_id())
    if rank == 0:
        try:
            ckpt.wait_for_all_ranks(local, world, timeout_s=2)
            result = "complete"
        except ckpt.CheckpointError as e:
            result = f"refused: {e}"
        (out / f"wait-{staging.name}").write_text(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
