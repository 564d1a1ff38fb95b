"""The Spark stages' lifecycle (`common.run_stage`) and their staging: each attempt owns its staging
directory (an owner record with a heartbeat beside it); what a crashed attempt left is swept by the
next attempt of the same artifact once it is provably dead, never while its owner lives.

Attempts are real processes: subprocesses that create their staging through the production
`attempt_staging` and die by SIGKILL (a crash leaves no chance to clean up). The stage that sweeps is
`run_stage` itself; its compute writes a Parquet file without Spark (the lifecycle does not depend on
what computes the payload; the Spark stages' own tests cover that part)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest
from pipeline_core.config import load_config
from pipeline_core.handoffs import StageCounts
from spark_jobs import common
from spark_jobs.staging import (
    OWNER_SUFFIX,
    StagingOwner,
    host_identity,
    proc_start_ticks,
    process_start_time,
    sweep_dead_attempts,
)

ATTEMPT = """
import os, signal, sys
from pipeline_core.config import load_config
from spark_jobs import common

staging_uri, output_uri, mode, ttl = sys.argv[1:5]
cfg = load_config(env={}, overrides={"pipeline.staging_uri": staging_uri, "pipeline.staging_ttl_s": float(ttl)})
a = common.attempt_staging(cfg, "enrich", output_uri)
(a.path / "data").mkdir()
(a.path / "data" / "part-00000-c000.parquet").write_bytes(b"half-written")
common.download_dir(a.path).mkdir()  # a downloaded input beside it
print(a.path, flush=True)
if mode == "crash":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.readline()  # alive until the test says so
a.close()
print("closed", flush=True)
"""

SPEC = common.StageSpec("enrich", "enriched", "lifecycle-test")
NO_SPARK = object()  # compute below does not use Spark; run_stage does not stop a session it was given


def _cfg(tmp_path: Path, ttl: float = 600.0):
    return load_config(env={}, overrides={"pipeline.staging_uri": uris.qualify(tmp_path / "staging"),
                                          "pipeline.staging_ttl_s": ttl})


class Attempt:
    def __init__(self, tmp_path: Path, output_uri: str, mode: str, ttl: float = 600.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ATTEMPT, uris.qualify(tmp_path / "staging"), output_uri, mode, str(ttl)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        assert line, f"the attempt died before creating its staging (rc={self.proc.wait()})"
        self.path = Path(line)
        self.owner = self.path.with_name(self.path.name + OWNER_SUFFIX)
        self.input = common.download_dir(self.path)
        if mode == "crash":
            assert self.proc.wait(timeout=60) == -signal.SIGKILL

    def leftovers(self) -> list[Path]:
        return [p for p in (self.path, self.input, self.owner) if p.exists()]

    def finish(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "closed" and self.proc.wait(timeout=60) == 0


@pytest.fixture
def attempt(tmp_path):
    """Starts attempts; any still running when the test ends (it failed) is killed, not left behind."""
    started: list[Attempt] = []

    def start(output_uri: str, mode: str, ttl: float = 600.0) -> Attempt:
        started.append(Attempt(tmp_path, output_uri, mode, ttl))
        return started[-1]

    yield start
    for a in started:
        if a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait(timeout=60)


def _compute(seen: dict):
    def compute(ctx: common.StageContext) -> common.StageOutput:
        import pyarrow as pa
        import pyarrow.parquet as pq

        owner = StagingOwner.read(ctx.staging.with_name(ctx.staging.name + OWNER_SUFFIX))
        seen["owner"], seen["staging"] = owner, ctx.staging
        (ctx.staging / "data").mkdir()
        pq.write_table(pa.table({"id": ["a"]}), ctx.staging / "data" / "part-00000-c000.parquet")
        return common.StageOutput(StageCounts(rows_in=1, rows_out=1), {})
    return compute


def test_the_next_run_sweeps_a_killed_attempt_and_never_a_live_one(tmp_path, attempt):
    out = uris.qualify(tmp_path / "store" / "enriched" / "a")
    other = uris.qualify(tmp_path / "store" / "enriched" / "b")
    dead, live, other_dead = attempt(out, "crash"), attempt(out, "live"), attempt(other, "crash")
    assert len(dead.leftovers()) == 3 and len(live.leftovers()) == 3  # a crash leaves everything behind

    cfg, seen = _cfg(tmp_path), {}
    m = common.run_stage(SPEC, cfg, cfg.enrich, out, {"k": 1}, _compute(seen), spark=NO_SPARK)
    assert m.counts["out"] == 1 and read_manifest(out) is not None
    assert dead.leftovers() == []  # swept: its process is gone
    assert len(live.leftovers()) == 3  # kept: its process lives
    assert len(other_dead.leftovers()) == 3  # another artifact's attempts are not this run's business
    # this run's own attempt had its record while it ran, and left nothing behind
    assert seen["owner"].pid == os.getpid() and seen["owner"].host == host_identity()
    assert not seen["staging"].exists() and not seen["staging"].with_name(seen["staging"].name + OWNER_SUFFIX).exists()

    # the committed artifact makes a rerun a no-op, and the no-op still sweeps
    crashed_after = attempt(out, "crash")
    again = common.run_stage(SPEC, cfg, cfg.enrich, out, {"k": 1}, _compute({}), spark=NO_SPARK)
    assert again.sha256 == m.sha256 and crashed_after.leftovers() == []
    assert len(live.leftovers()) == 3
    live.finish()
    assert live.leftovers() == []  # a live attempt cleans up after itself


def test_heartbeat_runs_while_the_attempt_lives_and_a_kill_9_is_swept_despite_a_fresh_one(tmp_path, attempt):
    out = uris.qualify(tmp_path / "store" / "x")
    live = attempt(out, "live", ttl=6.0)  # a beat every second
    first = StagingOwner.read(live.owner)
    deadline = time.monotonic() + 120
    while (beat := StagingOwner.read(live.owner)) is None or beat.heartbeat == first.heartbeat:
        assert time.monotonic() < deadline, "the heartbeat never moved"
        time.sleep(0.2)
    assert beat.pid == live.proc.pid and beat.started == first.started
    stage_dir, key = live.path.parent, live.path.name[:16]
    assert sweep_dead_attempts(stage_dir, key, 6.0) == [] and len(live.leftovers()) == 3
    live.proc.send_signal(signal.SIGKILL)
    live.proc.wait(timeout=60)
    assert time.time() - StagingOwner.read(live.owner).heartbeat < 6.0 * 10  # fresh, but the process is gone
    assert sweep_dead_attempts(stage_dir, key, 600.0) == [live.path.name[17:]]
    assert live.leftovers() == []


def _record(stage_dir: Path, name: str, **fields) -> Path:
    (stage_dir / name).mkdir(parents=True)
    me = os.getpid()
    base = dict(host=host_identity(), pid=me, started=process_start_time(me), attempt=name[17:], heartbeat=time.time(),
                ttl_s=60.0, start_ticks=proc_start_ticks(me))
    owner = StagingOwner(**{**base, **fields})
    record = stage_dir / f"{name}{OWNER_SUFFIX}"
    owner.write(record)
    os.utime(record, (owner.heartbeat, owner.heartbeat))  # written when its heartbeat says
    return stage_dir / name


@pytest.mark.parametrize("case, fields, swept", [
    ("other_host_stale", dict(host="node-7/boot/1", age=3600), True),
    ("other_host_fresh", dict(host="node-7/boot/1"), False),
    ("other_host_stale_under_its_own_longer_ttl", dict(host="node-7/boot/1", age=300, ttl_s=900.0),
     False),
    ("pid_reused_by_another_process", dict(started=1.0, start_ticks=1, age=3600), True),
    ("pid_reused_record_of_older_code", dict(started=1.0, start_ticks=None, age=3600), True),
    ("live_here_with_a_stalled_heartbeat", dict(age=3600), False),
])
def test_sweep_decides_by_liveness_here_and_by_heartbeat_from_elsewhere(tmp_path, case, fields, swept):
    """Records of attempts on another node (which cannot exist here) and of this process written by hand."""
    key = "0123456789abcdef"
    fields = dict(fields)
    if "age" in fields:  # the heartbeat's age, made absolute when the test runs (not when it is collected)
        fields["heartbeat"] = time.time() - fields.pop("age")
    path = _record(tmp_path, f"{key}-aaaaaaaaaaaa", **fields)
    assert sweep_dead_attempts(tmp_path, key, ttl_s=60.0) == (["aaaaaaaaaaaa"] if swept else [])
    assert path.exists() != swept


def test_what_cannot_be_proven_dead_is_left_alone(tmp_path):
    key = "0123456789abcdef"
    legacy = tmp_path / f"{key}-bbbbbbbbbbbb"  # made by older code: no owner record
    legacy.mkdir()
    garbled = tmp_path / f"{key}-cccccccccccc"
    garbled.mkdir()
    garbled.with_name(garbled.name + OWNER_SUFFIX).write_text(json.dumps({"pid": 1}))
    assert sweep_dead_attempts(tmp_path, key, ttl_s=5.0, now=time.time() + 10**6) == []
    assert legacy.exists() and garbled.exists()


def test_a_clock_step_never_makes_a_live_or_heartbeating_attempt_look_dead(tmp_path, monkeypatch):
    """Issue 26 item 7. Here: a live attempt of this process, and the wall clock stepped an hour
    forward (the sweep's injected `now`; psutil's wall-clock start times move with a step too -
    faked by 5 s). From another host: a heartbeat just written (its record's mtime on the shared
    file system is fresh) while the sweeper's clock is a day ahead. Neither is swept; a record stale
    by both clocks still is."""
    import psutil

    key = "0123456789abcdef"
    here = _record(tmp_path, f"{key}-aaaaaaaaaaaa")
    elsewhere = _record(tmp_path, f"{key}-bbbbbbbbbbbb", host="node-7/boot/1")
    stepped = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: stepped(self) + 5.0)
    assert sweep_dead_attempts(tmp_path, key, ttl_s=60.0, now=time.time() + 86400) == []
    assert here.exists() and elsewhere.exists()
    gone = _record(tmp_path, f"{key}-cccccccccccc", host="node-7/boot/1", heartbeat=time.time() - 3600)
    assert sweep_dead_attempts(tmp_path, key, ttl_s=60.0, now=time.time() + 86400) == ["cccccccccccc"]
    assert not gone.exists() and here.exists() and elsewhere.exists()
