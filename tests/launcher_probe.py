"""A stand-in training module for the launcher-kill tests: what a rank that has children looks like.

Run as `-m tests.launcher_probe` (by torchrun, one per rank, or directly). It starts a grandchild
(a data-loader or compile worker, say) and records both pids under $LAUNCHER_PROBE_DIR, then waits.
`--trap-sigterm` makes both ignore SIGTERM, like a rank stuck in a collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    trap = "--trap-sigterm" in argv
    if trap:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = Path(os.environ["LAUNCHER_PROBE_DIR"])
    grandchild_code = ("import signal, time\n"
                       + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if trap else "")
                       + "time.sleep(600)\n")
    same_group = subprocess.Popen([sys.executable, "-c", grandchild_code])
    own_session = subprocess.Popen([sys.executable, "-c", grandchild_code], start_new_session=True)
    rank = os.environ.get("RANK", "x")
    tmp = out / f".pids-{rank}"
    tmp.write_text(f"{os.getpid()} {same_group.pid} {own_session.pid}\n")
    tmp.rename(out / f"pids-{rank}")  # whole file or nothing for the test polling it
    print(f"probe rank {rank} ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1:])
