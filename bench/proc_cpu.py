"""CPU seconds of a benchmark process tree (shared by the Spark benchmarks)."""

from __future__ import annotations


def cpu_seconds() -> float:
    """CPU time of this process and its descendants (the Spark JVM, its Python workers): on a shared
    machine this is steadier than wall time."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total
