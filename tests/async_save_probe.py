"""Child process for tests/test_async_checkpoint.py: one asynchronous checkpoint save as the
trainer makes it (SnapshotCheckpointEngine + CheckpointUploader), then a step loop that never
ends; the test SIGKILLs it mid-upload or mid-write.

    python -m tests.async_save_probe <mode> <staging> <run_uri> <input_uri> <endpoint>
mode: upload (files complete, the upload is held by the test's proxy) | write (the writer is
stuck before the last file: the checkpoint is never complete)
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

from pipeline_core.config import StorageSection, load_config
from training import checkpoints as ckpt
from training.async_save import SnapshotCheckpointEngine

KEY = b"test-signing-key-0123456789abcdef"


def main() -> int:
    mode, staging, run_uri, input_uri, endpoint = sys.argv[1:6]
    local = Path(staging) / "attempts" / "a1" / "checkpoints" / "step-2"
    (local / ckpt.TAG).mkdir(parents=True)
    writer = SnapshotCheckpointEngine(pin_memory=False)
    if mode == "write":
        real, stuck = writer._write, threading.Event()

        def write(snapshot, path):
            if path.endswith("optim_states.pt"):
                print("WRITING", flush=True)
                stuck.wait()  # never set: the process dies here
            real(snapshot, path)

        writer._write = write
    weights = torch.arange(4096, dtype=torch.float32)
    writer.save({"module": {"w": weights}}, str(local / ckpt.TAG / "mp_rank_00_model_states.pt"))
    writer.save({"optimizer": {"m": weights * 2}}, str(local / ckpt.TAG / "zero_pp_rank_0_optim_states.pt"))
    writer.after(lambda: ckpt.save_rng(local / ckpt.TAG, 0, ckpt.rng_state()))
    config = load_config().model_dump(mode="json")
    uploader = ckpt.CheckpointUploader(run_uri, StorageSection(endpoint_url=endpoint), ckpt.PushPolicy(keep_last=2),
                                       config, [input_uri], key=KEY)

    def written():
        writer.flush()
        ckpt.wait_for_all_ranks(local, 1, timeout_s=60)

    uploader.submit(2, local, {"data_position": 4}, ready=written)
    step = 0
    while True:  # the training loop goes on; the test kills the process
        weights += 1
        step += 1
        print(f"STEP {step}", flush=True)
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
