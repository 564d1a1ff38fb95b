"""Asynchronous checkpoint saves (training/async_save.py + the uploader's ``ready`` hook) against a
real S3 server (moto over HTTP) through tests/fault_proxy.py, which holds the checkpoint's PUTs:
the step loop keeps running while the upload is in flight, the upload carries the state as it
was at the save, and a process killed mid-upload or mid-write commits nothing (the next attempt
pushes a complete checkpoint, and discards an incomplete one). The whole trainer with async
saves (DeepSpeed's save through the engine, SIGKILL, resume) runs in tests/test_training_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline_core import layout
from pipeline_core.artifacts import fetch_artifact, read_manifest
from pipeline_core.config import StorageSection, load_config
from tests.conftest import checkpoint_run
from tests.fault_proxy import FaultProxy
from training import checkpoints as ckpt
from training.async_save import SnapshotCheckpointEngine

KEY = b"test-signing-key-0123456789abcdef"  # the probe's (tests/async_save_probe.py)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run(s3_server, tmp_path):
    return checkpoint_run(s3_server, tmp_path)


def _wait(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.02)


def test_the_step_loop_runs_on_while_the_upload_is_held_and_the_upload_has_the_saved_state(run, s3_server):
    hold = threading.Event()
    local = run["staging"] / "attempts" / "a1" / "checkpoints" / "step-2"
    (local / ckpt.TAG).mkdir(parents=True)
    with FaultProxy(s3_server.endpoint, fail_first=10_000, methods=("PUT",), path_contains="/checkpoints/step-2/",
                    hold=hold) as proxy:
        writer = SnapshotCheckpointEngine(pin_memory=False)
        uploader = ckpt.CheckpointUploader(run["run"], StorageSection(endpoint_url=proxy.endpoint),
                                           ckpt.PushPolicy(keep_last=2), load_config().model_dump(mode="json"),
                                           [run["input"]], key=KEY)
        weights = torch.zeros(4096)
        disk = threading.Event()
        writer.after(disk.wait)  # a slow disk: nothing is written until the test says so
        t0 = time.perf_counter()
        writer.save({"module": {"w": weights}}, str(local / ckpt.TAG / "mp_rank_00_model_states.pt"))
        writer.after(lambda: ckpt.save_rng(local / ckpt.TAG, 0, ckpt.rng_state()))
        uploader.submit(2, local, {"data_position": 4},
                        ready=lambda: (writer.flush(), ckpt.wait_for_all_ranks(local, 1, timeout_s=60)))
        returned_s = time.perf_counter() - t0
        for _ in range(25):  # training goes on before a byte is written, mutating the saved weights
            weights += 1
        assert not (local / ckpt.TAG / "mp_rank_00_model_states.pt").exists() and not (local / ckpt.PENDING).exists()
        disk.set()
        _wait(lambda: proxy.held >= 1, "the upload never started")
        for _ in range(25):  # ... and while the upload is in flight
            weights += 1
        assert proxy.held >= 1, "the loop ran while the upload was in flight"
        assert read_manifest(layout.checkpoint_uri(run["run"], 2), run["storage"]) is None, "held: not committed"
        assert (local / ckpt.PENDING).is_file(), "every file was complete, so the pending marker is there"
        hold.set()
        uploader.close()
    assert returned_s < 30, "the save returned before the upload (held until now) finished"
    m = read_manifest(layout.checkpoint_uri(run["run"], 2), run["storage"])
    assert m is not None and m.extra["step"] == 2 and m.extra["data_position"] == 4
    ckpt.verify_signature(KEY, layout.checkpoint_uri(run["run"], 2), m)
    got = run["staging"].parent / "got"
    fetch_artifact(layout.checkpoint_uri(run["run"], 2), got, run["storage"])
    saved = torch.load(next(got.rglob("mp_rank_00_model_states.pt")), weights_only=True)
    assert torch.equal(saved["module"]["w"], torch.zeros(4096)), "the upload holds the state at the save"
    assert torch.equal(weights, torch.full((4096,), 50.0))


def _probe(mode: str, run, endpoint: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.async_save_probe", mode, str(run["staging"]), run["run"],
                             run["input"], endpoint], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, marker: str, timeout_s: float = 120.0) -> list[str]:
    lines: list[str] = []
    done = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(marker):
                done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout_s), f"probe never printed {marker!r}: {''.join(lines)[-2000:]}"
    return lines


def test_a_kill_mid_upload_commits_nothing_and_the_next_attempt_pushes_the_complete_checkpoint(run, s3_server):
    hold = threading.Event()
    uri = layout.checkpoint_uri(run["run"], 2)
    with FaultProxy(s3_server.endpoint, fail_first=10_000, methods=("PUT",), path_contains="/checkpoints/step-2/",
                    hold=hold) as proxy:
        proc = _probe("upload", run, proxy.endpoint)
        try:
            _wait(lambda: proxy.held >= 1, "the probe's upload never started", timeout_s=120)
            lines = _read_until(proc, "STEP 20")  # the loop runs while the upload is held
            assert any(line.startswith("STEP") for line in lines)
        finally:
            proc.kill()
            proc.wait()
            hold.set()
    assert read_manifest(uri, run["storage"]) is None, "a killed upload must leave no committed checkpoint"
    assert ckpt.fetch_newest_valid(run["run"], run["storage"], run["staging"] / "resume", key=KEY) is None
    local = run["staging"] / "attempts" / "a1" / "checkpoints" / "step-2"
    assert (local / ckpt.PENDING).is_file(), "complete files: left for the next attempt to push"
    pushed = ckpt.prepare_attempt(run["staging"], run["staging"] / "attempts" / "a2", run["run"], run["storage"],
                                  key=KEY, keep_last=2)
    assert pushed == [2]
    got = ckpt.fetch_newest_valid(run["run"], run["storage"], run["staging"] / "resume", key=KEY)
    assert got is not None and got.step == 2
    saved = torch.load(got.local_dir / ckpt.TAG / "zero_pp_rank_0_optim_states.pt", weights_only=True)
    assert torch.equal(saved["optimizer"]["m"], torch.arange(4096, dtype=torch.float32) * 2)


def test_a_kill_mid_write_leaves_nothing_a_later_attempt_would_push(run, s3_server):
    proc = _probe("write", run, s3_server.endpoint)
    try:
        _read_until(proc, "STEP 5")  # the writer is stuck on the second file; the loop runs on
    finally:
        proc.kill()
        proc.wait()
    local = run["staging"] / "attempts" / "a1" / "checkpoints" / "step-2"
    assert (local / ckpt.TAG / "mp_rank_00_model_states.pt").is_file(), "the first file was written"
    assert not (local / ckpt.PENDING).exists() and not ckpt.rng_path(local / ckpt.TAG, 0).exists()
    pushed = ckpt.prepare_attempt(run["staging"], run["staging"] / "attempts" / "a2", run["run"], run["storage"],
                                  key=KEY, keep_last=2)
    assert pushed == [] and not local.exists(), "an incomplete checkpoint is discarded, never pushed"
    assert read_manifest(layout.checkpoint_uri(run["run"], 2), run["storage"]) is None
