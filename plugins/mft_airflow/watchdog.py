"""Run a command so that its whole process tree dies with the Airflow task that started it.

`python watchdog.py --parent PID --grace S -- cmd ...` (Linux; the process table through psutil).

torchrun starts its ranks in process groups of their own, so neither killing the agent's group nor
a parent-death signal on the agent reaches them: after a SIGKILLed task, orphaned ranks kept
training and pushing checkpoints. The watchdog is a child subreaper (orphaned descendants are
re-parented to it, so it can always find them) started with a parent-death signal: when the task
process dies, or on SIGTERM/SIGINT (`on_kill`), it forwards SIGTERM to the command, waits `grace`
seconds, then SIGKILLs every descendant still alive. When the command exits by itself, leftover
descendants are ended the same way. The exit status is the command's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36


def _children(pid: int, recursive: bool) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=recursive)
    except psutil.NoSuchProcess:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(root: int) -> list[int]:
    """Every live descendant of `root` (zombies left out: they are dead, only not yet reaped)."""
    return [p.pid for p in _children(root, recursive=True) if _alive(p)]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _reap_orphans(keep: int) -> None:
    """Collect re-parented zombies, never the command itself (Popen must read its exit status)."""
    for p in _children(os.getpid(), recursive=False):
        if p.pid != keep and not _alive(p):
            try:
                os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def end_tree(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the command and its descendants, then SIGKILL whatever outlives `grace_s`."""
    me = os.getpid()
    _signal_all(descendants(me), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and descendants(me):
        _reap_orphans(child.pid)
        time.sleep(0.1)
    while pids := descendants(me):
        _signal_all(pids, signal.SIGKILL)
        _reap_orphans(child.pid)
        time.sleep(0.05)
    _reap_orphans(child.pid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parent", type=int, required=True, help="pid whose death ends the command")
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass
    stop = {"requested": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if os.getppid() != args.parent:  # the task died before the death signal was armed
        return 143
    child = subprocess.Popen(command)
    while child.poll() is None and not stop["requested"]:
        if os.getppid() != args.parent:  # belt and braces: the death signal was lost
            stop["requested"] = True
            break
        time.sleep(0.2)
    try:
        if stop["requested"]:  # the task's log pipe may be gone with the task: never fail on it
            print(f"watchdog: stopping {command[0]} (pid {child.pid}) and its descendants", file=sys.stderr,
                  flush=True)
    except OSError:
        pass
    finally:
        end_tree(child, args.grace if stop["requested"] else min(args.grace, 10.0))
    rc = child.wait()
    return 128 + signal.SIGTERM if stop["requested"] and rc == 0 else (rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    sys.exit(main())
