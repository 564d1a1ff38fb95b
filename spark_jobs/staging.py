"""Per-attempt staging directories of the Spark stages, and sweeping those of dead attempts.

An attempt of a stage writes under `<staging_uri>/<stage>/<output key>-<attempt id>` (siblings
`…-input`, `…-docs` beside it hold downloads and intermediate frames, never published). Beside them
`<output key>-<attempt id>.owner.json` says who owns them: the host (hostname, boot id and pid
namespace: a pid means something only there), the pid and the process's start time (a reused pid
is another process: its start in clock ticks since boot, from /proc/<pid>/stat, which no wall
clock step moves), and a heartbeat the owner rewrites every `ttl_s / 6` seconds while it runs.
The record is written before the directory exists and removed after it is gone.

A crashed attempt (kill -9, OOM, lost node) leaves all of it behind. The next attempt of the same
artifact sweeps an earlier one only when it is provably dead:
  - on this host: its process is gone (no such pid, a zombie, or a pid now owned by a process
    started at another boot-relative tick), whatever its heartbeat says - no wall clock involved
    (issue 26 item 7: a clock step used to make a live attempt's start time look like another
    process's);
  - from another host: its heartbeat is stale by both clocks that can judge it - the writer's
    wall-clock stamp against the sweeper's clock, and the record file's mtime against a probe file
    the sweeper writes beside it now (both stamped by the shared file system) - each by more than
    the larger of its own and the sweeper's TTL (`pipeline.staging_ttl_s`) plus half of it as a
    margin. A clock step on either host moves only one of the two, so a fresh heartbeat is never
    swept.
Never swept: a live process of this host (even with a stalled heartbeat), a fresh heartbeat from
elsewhere, an unreadable record, or a directory without a record (left by older code: logged).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("spark_jobs")

OWNER_SUFFIX = ".owner.json"
ATTEMPT_ID_LEN = 12


def host_identity() -> str:
    """This host as far as pids are concerned: hostname + boot + pid namespace."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:  # not Linux: the hostname alone
        pass
    return "/".join(parts)


def proc_start_ticks(pid: int) -> int | None:
    """The process's start in clock ticks since boot (/proc/<pid>/stat field 22; boot-relative, no
    wall clock); None when no live process has this pid (zombies included) or there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    return None if fields[0] in ("Z", "X") else int(fields[19])


def process_start_time(pid: int) -> float | None:
    """The process's start time, None when no live process has this pid (zombies included)."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except psutil.NoSuchProcess:
        return None


@dataclass(frozen=True)
class StagingOwner:
    host: str
    pid: int
    started: float  # the owning process's start time (psutil create_time)
    attempt: str
    heartbeat: float  # time.time() of the last refresh
    ttl_s: float
    start_ticks: int | None = None  # proc_start_ticks (None: written by older code, or no /proc)

    @classmethod
    def read(cls, path: Path) -> StagingOwner | None:
        try:
            d = json.loads(path.read_text())
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def write(self, path: Path) -> None:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)  # readers never see half a record


HEARTBEAT_MARGIN = 0.5  # of the ttl, on top of it: a heartbeat is stale only after 1.5 x ttl


def dead_because(owner: StagingOwner, ttl_s: float, now: float, fs_age: float | None = None) -> str | None:
    """Why the attempt is provably dead, or None when it may be alive. ``fs_age``: the record's
    age on the file system's clock (its mtime against a file written now beside it)."""
    if owner.host == host_identity():
        if owner.start_ticks is not None and Path("/proc/self/stat").exists():
            ticks = proc_start_ticks(owner.pid)
            if ticks is None:
                return f"process {owner.pid} is gone"
            if ticks != owner.start_ticks:
                return f"pid {owner.pid} now belongs to another process (started at tick {ticks}, not {owner.start_ticks})"
            return None  # alive here: never swept, however stale its heartbeat
        started = process_start_time(owner.pid)  # a record of older code: wall-clock start times
        if started is None:
            return f"process {owner.pid} is gone"
        if abs(started - owner.started) > 1.0:
            return f"pid {owner.pid} now belongs to another process"
        return None  # alive here: never swept, however stale its heartbeat
    limit = max(ttl_s, owner.ttl_s) * (1 + HEARTBEAT_MARGIN)
    age = now - owner.heartbeat
    if age > limit and (fs_age is None or fs_age > limit):
        return (f"no heartbeat from {owner.host.split('/')[0]} for {age:.0f} s by the clocks and "
                f"{'?' if fs_age is None else f'{fs_age:.0f}'} s by the file system (> {limit:.0f} s)")
    return None


def file_system_now(stage_dir: Path) -> float | None:
    """The shared file system's notion of now: the mtime of a file written beside the records."""
    probe = stage_dir / f".sweep-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        return probe.stat().st_mtime
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)


class AttemptStaging:
    """The staging directory of one attempt: created with its owner record, heartbeat refreshed in a
    daemon thread, everything removed by `close()` (the directory and its siblings, then the record)."""

    def __init__(self, stage_dir: Path, output_key: str, ttl_s: float):
        self.attempt = uuid.uuid4().hex[:ATTEMPT_ID_LEN]
        self.name = f"{output_key}-{self.attempt}"
        self.path = stage_dir / self.name
        self.owner_path = stage_dir / f"{self.name}{OWNER_SUFFIX}"
        self.ttl_s = ttl_s
        stage_dir.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        self._owner = StagingOwner(host_identity(), pid, process_start_time(pid) or 0.0, self.attempt, time.time(), ttl_s,
                                   proc_start_ticks(pid))
        self._owner.write(self.owner_path)  # before the directory: no directory without a record
        self.path.mkdir(exist_ok=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"staging-heartbeat-{self.attempt}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 6):
            try:
                StagingOwner(**{**asdict(self._owner), "heartbeat": time.time()}).write(self.owner_path)
            except OSError as e:
                log.warning("staging heartbeat %s: %s", self.owner_path, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        remove_attempt(self.path.parent, self.name)


def remove_attempt(stage_dir: Path, name: str) -> None:
    """The attempt's directory and siblings (`name`, `name-…`), then its owner record."""
    owner = stage_dir / f"{name}{OWNER_SUFFIX}"
    for p in sorted(stage_dir.glob(f"{name}*")):
        if p == owner:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    owner.unlink(missing_ok=True)


def sweep_dead_attempts(stage_dir: Path, output_key: str, ttl_s: float, now: float | None = None) -> list[str]:
    """Remove what dead attempts of this artifact (`output_key`) left under `stage_dir`; returns their
    attempt ids. Other artifacts' attempts are not looked at."""
    if not stage_dir.is_dir():
        return []
    now = time.time() if now is None else now  # the wall clock, injectable (tests step it)
    fs_now = file_system_now(stage_dir)
    attempts = {p.name[len(output_key) + 1:][:ATTEMPT_ID_LEN] for p in stage_dir.glob(f"{output_key}-*")}
    swept = []
    for attempt in sorted(attempts):
        name = f"{output_key}-{attempt}"
        record = stage_dir / f"{name}{OWNER_SUFFIX}"
        owner = StagingOwner.read(record)
        if owner is None:
            log.warning("staging %s has no readable owner record; left alone (remove it by hand once no "
                        "attempt of this artifact runs)", stage_dir / name)
            continue
        try:
            fs_age = None if fs_now is None else fs_now - record.stat().st_mtime
        except OSError:
            continue  # removed meanwhile by its owner
        why = dead_because(owner, ttl_s, now, fs_age)
        if why is None:
            continue
        remove_attempt(stage_dir, name)
        log.info("swept the staging of dead attempt %s (%s)", stage_dir / name, why)
        swept.append(attempt)
    return swept
