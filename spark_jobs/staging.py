"""Per-attempt staging directories of the Spark stages, and sweeping those of dead attempts.

An attempt of a stage writes under `<staging_uri>/<stage>/<output key>-<attempt id>` (siblings
`…-input`, `…-docs` beside it hold downloads and intermediate frames, never published). Beside them
`<output key>-<attempt id>.owner.json` says who owns them: the host (hostname, boot id and pid
namespace: a pid means something only there), the pid and the process's start time (a reused pid
is another process), and a heartbeat the owner rewrites every `ttl_s / 6` seconds while it runs.
The record is written before the directory exists and removed after it is gone.

A crashed attempt (kill -9, OOM, lost node) leaves all of it behind. The next attempt of the same
artifact sweeps an earlier one only when it is provably dead:
  - on this host: its process is gone (no such pid, a zombie, or a pid now owned by a process
    started at another time), whatever its heartbeat says;
  - from another host: its heartbeat is older than the larger of its own and the sweeper's TTL
    (`pipeline.staging_ttl_s`).
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

    @classmethod
    def read(cls, path: Path) -> StagingOwner | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def write(self, path: Path) -> None:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)  # readers never see half a record


def dead_because(owner: StagingOwner, ttl_s: float, now: float) -> str | None:
    """Why the attempt is provably dead, or None when it may be alive."""
    if owner.host == host_identity():
        started = process_start_time(owner.pid)
        if started is None:
            return f"process {owner.pid} is gone"
        if abs(started - owner.started) > 1.0:
            return f"pid {owner.pid} now belongs to another process"
        return None  # alive here: never swept, however stale its heartbeat
    ttl = max(ttl_s, owner.ttl_s)
    if now - owner.heartbeat > ttl:
        return f"no heartbeat from {owner.host.split('/')[0]} for {now - owner.heartbeat:.0f} s (> {ttl:.0f} s)"
    return None


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
        self._owner = StagingOwner(host_identity(), pid, process_start_time(pid) or 0.0, self.attempt, time.time(), ttl_s)
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
    now = time.time() if now is None else now
    attempts = {p.name[len(output_key) + 1:][:ATTEMPT_ID_LEN] for p in stage_dir.glob(f"{output_key}-*")}
    swept = []
    for attempt in sorted(attempts):
        name = f"{output_key}-{attempt}"
        owner = StagingOwner.read(stage_dir / f"{name}{OWNER_SUFFIX}")
        if owner is None:
            log.warning("staging %s has no readable owner record; left alone (remove it by hand once no "
                        "attempt of this artifact runs)", stage_dir / name)
            continue
        why = dead_because(owner, ttl_s, now)
        if why is None:
            continue
        remove_attempt(stage_dir, name)
        log.info("swept the staging of dead attempt %s (%s)", stage_dir / name, why)
        swept.append(attempt)
    return swept
