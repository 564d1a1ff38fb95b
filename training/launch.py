"""How `training.train` is started on one node: its arguments, the torchrun command, the process
environment, and how a run is killed like a lost node.

One definition for the Airflow local launcher (plugins/mft_airflow/launchers.py builds its agents
from `train_args`/`standalone_argv`), the end-to-end tests and the GPU benchmark.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

TRAIN_MODULE = "training.train"
REPO = Path(__file__).resolve().parents[1]


def train_args(input_uri: str, output_uri: str, config: str | Path) -> list[str]:
    """The trainer's own arguments (the stage contract: --input --output --config)."""
    return ["--input", input_uri, "--output", output_uri, "--config", str(config)]


def standalone_argv(input_uri: str, output_uri: str, config: str | Path, nproc: int, *,
                    launcher: list[str] | None = None, module: str = TRAIN_MODULE) -> list[str]:
    """One node, `nproc` ranks: `torchrun --standalone` (this interpreter's, unless `launcher`)."""
    launcher = launcher or [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", f"--nproc-per-node={nproc}", "-m", module,
            *train_args(input_uri, output_uri, config)]


def process_env(extra: Mapping[str, str] | None = None, *, cpu: bool) -> dict[str, str]:
    """The caller's environment for a directly started run: unbuffered, no hub; on CPU DeepSpeed's
    CPU accelerator with one thread per rank and a fixed extension cache (built once)."""
    env = {**os.environ, **(extra or {}), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if cpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"))
    return env


def kill_tree(proc) -> None:
    """SIGKILL torchrun and its workers (they run in their own sessions), like a lost node."""
    import signal

    import psutil

    procs = [psutil.Process(proc.pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(procs, timeout=30)
