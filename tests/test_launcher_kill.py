"""Killing a training task kills all of it: `on_kill` (task timeout, mark-failed) must leave no
rank and no rank's child running -- not one that traps SIGTERM, not one in its own session
(torchrun starts every rank with `start_new_session=True`, out of reach of a process-group
signal)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipeline_core import uris
from plugins.mft_airflow.launchers import LocalTrainProcess
from plugins.mft_airflow.operators import TrainOperator
from plugins.mft_airflow.plan import resolve_plan
from plugins.mft_airflow.settings import load_settings
from tests.conftest import REPO
from tests.test_dag_params import deployment_env

log = logging.getLogger("test_launcher_kill")


def _wait_for_pids(probe_dir: Path, n_files: int, thread: threading.Thread, timeout_s: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(probe_dir.glob("pids-*"))
        if len(files) == n_files:
            return [int(x) for f in files for x in f.read_text().split()]
        if not thread.is_alive():
            pytest.fail("the launched process ended before it was ready")
        time.sleep(0.2)
    pytest.fail(f"no {n_files} probe pid files within {timeout_s}s: {sorted(probe_dir.iterdir())}")


def _survivors(pids: list[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def _start(target) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run():
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_on_kill_escalates_to_every_descendant_of_a_child_that_traps_sigterm(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_PROBE_DIR", str(tmp_path))
    import os

    proc = LocalTrainProcess([sys.executable, "-m", "tests.launcher_probe", "--trap-sigterm"],
                             env=dict(os.environ), cwd=str(REPO), log=log)
    thread, errors = _start(proc.execute)
    pids = _wait_for_pids(tmp_path, 1, thread)
    try:
        proc.on_kill(grace_s=2)
        thread.join(timeout=60)
        assert not thread.is_alive(), "execute() still running after on_kill"
        deadline = time.monotonic() + 10
        while _survivors(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _survivors(pids) == [], "processes outlived on_kill"
        assert errors and isinstance(errors[0], RuntimeError) and "exited with status" in str(errors[0])
    finally:
        _kill_leftovers(pids)


class _TaskInstance:
    """What the operator asks of Airflow's task instance here: the plan in XCom, and which try this is
    (the launcher's per-try attempt id, MFT_ATTEMPT_ID)."""

    try_number = 1
    run_id = "manual__kill"

    def __init__(self, plan: dict):
        self.plan = plan

    def xcom_pull(self, task_ids: str):
        return self.plan


@pytest.mark.timeout(400)
def test_train_operator_on_kill_stops_torchrun_its_ranks_and_their_children(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCHER_PROBE_DIR", str(tmp_path / "probe"))
    (tmp_path / "probe").mkdir()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    store = tmp_path / "store"
    store.mkdir()
    params = {"dataset_version": "v1", "run_id": "r1", "stages": ["enrich", "filter", "train"]}
    # store and staging are deployment settings (MFT__ environment), never a trigger's
    env = deployment_env({"pipeline.store_uri": uris.qualify(store),
                          "pipeline.staging_uri": uris.qualify(tmp_path / "staging")})
    plan = resolve_plan(params, dag_id="mistral_finetune", airflow_run_id="manual__kill", run_date=None, env=env)
    op = TrainOperator(task_id="train", settings=load_settings(env={}, train_module="tests.launcher_probe", env_passthrough=("LAUNCHER_PROBE_DIR",),
                                                                local_nproc_per_node=2))
    thread, errors = _start(lambda: op.execute({"ti": _TaskInstance(plan)}))
    pids = _wait_for_pids(tmp_path / "probe", 2, thread)  # 2 ranks, each with 2 children
    torchrun = [p.pid for p in psutil.Process(pids[0]).parents() if "torch.distributed.run" in " ".join(p.cmdline())]
    assert torchrun, "the ranks do not run under torchrun"
    try:
        op.on_kill()
        thread.join(timeout=120)
        assert not thread.is_alive(), "execute() still running after on_kill"
        deadline = time.monotonic() + 10
        while _survivors(pids + torchrun) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _survivors(pids + torchrun) == [], "processes outlived TrainOperator.on_kill"
        assert errors, "a killed training must not look like success"
    finally:
        _kill_leftovers(pids + torchrun)
