"""Reading a child process's output without trusting it to keep talking."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Iterator

_EOF = object()


def lines_within(proc: subprocess.Popen[str], timeout_s: float) -> Iterator[str]:
    """Yield `proc`'s stdout lines until EOF; raise TimeoutError once `timeout_s` has passed,
    even while the child is silent (a `for line in proc.stdout` loop would block in readline
    and never look at its deadline). A daemon thread does the blocking reads."""
    q: queue.Queue[object] = queue.Queue()

    def pump() -> None:
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                q.put(line)
        finally:
            q.put(_EOF)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no end of output within {timeout_s:.0f}s")
        try:
            item = q.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(f"no end of output within {timeout_s:.0f}s") from None
        if item is _EOF:
            return
        yield item  # type: ignore[misc]
