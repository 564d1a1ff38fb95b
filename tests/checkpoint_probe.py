"""A trainer's checkpoint pushing without the model, for tests that need it in a real process of
its own (SIGSTOP/SIGCONT): `python -m tests.checkpoint_probe RUN_URI ENDPOINT STAGING ATTEMPT TTL`
takes the run lease as ATTEMPT, saves step 2 the way Trainer.save_checkpoint leaves it on disk and
pushes it with the trainer's uploader (fenced by the lease). Exit status: 0 pushed, 3 LeaseLost,
1 anything else. `save_fake_checkpoint` is also what tests/test_checkpoint_faults.py saves."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from training import checkpoints as ckpt

KEY = b"test-signing-key-0123456789abcdef"


def save_fake_checkpoint(staging: Path, attempt: str, step: int, world: int = 2, salt: bytes = b"") -> Path:
    """What Trainer.save_checkpoint leaves on disk: the DeepSpeed tag dir with every rank's files."""
    local = staging / "attempts" / attempt / "checkpoints" / f"step-{step}"
    tag = local / ckpt.TAG
    tag.mkdir(parents=True)
    for layer in range(3):
        (tag / f"layer_{layer:02d}-model_states.pt").write_bytes(bytes([step, layer]) * 500 + salt)
    for r in range(world):
        (tag / f"mp_rank_{r:02d}_model_states.pt").write_bytes(b"optim" * 100 + bytes([step, r]) + salt)
        ckpt.save_rng(tag, r)
    return local


def main(argv: list[str]) -> int:
    from pipeline_core.config import StorageSection, load_config
    from training.lease import LeaseLost, RunLease

    run_uri, endpoint, staging, attempt, ttl = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s probe %(levelname)s %(name)s: %(message)s")
    storage = StorageSection(endpoint_url=endpoint, max_attempts=2)
    lease = RunLease(run_uri, storage, ttl_s=float(ttl), attempt=attempt).acquire()
    print("probe: holding the lease", flush=True)
    up = ckpt.CheckpointUploader(run_uri, storage, ckpt.PushPolicy(keep_last=2), load_config().model_dump(mode="json"),
                                 [], key=KEY, lease=lease)
    try:
        up.submit(2, save_fake_checkpoint(Path(staging), attempt, 2, salt=attempt.encode()), {"data_position": 4})
        up.close()
    except LeaseLost as e:
        print(f"probe: LeaseLost: {e}", flush=True)
        return 3
    print(f"probe: pushed {up.pushed}", flush=True)
    lease.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
