"""Training across nodes, the way the launchers start it: two CPU "nodes" on loopback, each a
torchrun agent built by the local launcher (`--nnodes 2 --node-rank R --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:P`), one rank each, join one rendezvous and train one run (2 pipeline
stages across the two nodes, gloo); the model is committed once."""

from __future__ import annotations

import logging
import threading

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import read_manifest
from plugins.mft_airflow.launchers import LocalTrainProcess, attempt_env, local_command, local_env
from plugins.mft_airflow.plan import load_plan_config, resolve_plan
from plugins.mft_airflow.settings import load_settings
from tests.conftest import REPO, free_port
from tests.test_dag_params import deployment_env
from tests.training_helpers import build_train_ready
from training.tiny import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class LineLog:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, fmt, *args):
        self.lines.append(fmt % args if args else fmt)
        logging.getLogger("node").info(fmt, *args)


def test_two_nodes_with_a_shared_rendezvous_train_one_run(tmp_path):
    store = uris.qualify(tmp_path / "store")
    model_dir = make_tiny_model(tmp_path / "tiny", hidden_size=32, intermediate_size=64)
    input_uri = build_train_ready(store, tmp_path / "ready", seq_len=64, n_train_docs=24, n_val_docs=4)
    settings = [load_settings(env={}, nnodes=2, node_rank=r, local_nproc_per_node=1,
                              rdzv_endpoint=f"127.0.0.1:{free_port()}") for r in (0, 1)]
    settings[1] = settings[1].model_copy(update={"rdzv_endpoint": settings[0].rdzv_endpoint})
    plan = resolve_plan(
        {"dataset_version": "test", "run_id": "two-nodes", "steps": 2, "seq_len": 64,
         "base_model": str(model_dir),
         "config_overrides": {"train.precision": "fp32", "train.micro_batch_size": 1, "train.global_batch_size": 2,
                              "train.checkpoint_every": 1, "train.eval_batches": 1, "train.warmup_steps": 1}},
        dag_id="d", airflow_run_id="manual__x", run_date=None,
        env=deployment_env({"pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp_path / "staging")}),
        world_size=settings[0].world_size(), settings=settings[0].model_copy(
            update={"allowed_base_models": (str(model_dir),)}))
    # the plan's train-ready URI is derived from the config; train on the artifact built above
    plan = plan.model_copy(update={"train_ready_uri": input_uri})
    cfg = load_plan_config(plan)
    nodes = []
    for s in settings:
        cmd = local_command(plan, s)
        assert f"--node-rank={s.node_rank}" in cmd and "--nnodes=2" in cmd
        nodes.append(LocalTrainProcess(cmd, local_env(cfg, s), str(REPO), LineLog()))
    errors: list[BaseException] = []

    def run(node):
        try:
            node.execute()
        except BaseException as e:  # reported below with the node's log
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(800)
    logs = ["\n".join(n.log.lines) for n in nodes]
    assert not errors, f"{errors}\n--- node 0\n{logs[0][-4000:]}\n--- node 1\n{logs[1][-4000:]}"
    # one world of two ranks, one per node, a pipeline stage each (rank 0 on node 0 logs the grid)
    assert "Using topology: {ProcessCoord(pipe=0, data=0): 0, ProcessCoord(pipe=1, data=0): 1}" in logs[0], logs[0]
    model = read_manifest(plan.model_uri)
    assert model is not None and model.kind == "model" and [i["uri"] for i in model.inputs] == [input_uri]


class _TI:  # what attempt_env reads of Airflow's task instance
    def __init__(self, run_id: str, try_number: int):
        self.run_id, self.try_number = run_id, try_number


def test_each_try_of_a_two_node_launch_has_its_own_attempt_and_stale_markers_do_not_count(tmp_path):
    """Issue 26 item 3: two Airflow tries of one two-node run, each launched as the local launcher
    does (two torchrun agents, one rendezvous, the launcher's per-try MFT_ATTEMPT_ID), running a
    stand-in module (tests/attempt_probe.py) that picks its attempt directory and writes its
    per-rank checkpoint markers like the trainer. Each try gets its own directory, both ranks agree
    on it, and the second try's rank 0 does not count the first try's marker of rank 1 (which the
    second try never wrote)."""
    store = uris.qualify(tmp_path / "store")
    plan = resolve_plan(
        {"dataset_version": "test", "run_id": "two-nodes", "steps": 2, "seq_len": 64, "base_model": "tiny"},
        dag_id="d", airflow_run_id="manual__x", run_date=None,
        env=deployment_env({"pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp_path / "staging")}),
        world_size=2)
    cfg = load_plan_config(plan)
    out = tmp_path / "out"
    out.mkdir()
    for try_number, skip in ((1, ""), (2, "1")):
        endpoint = f"127.0.0.1:{free_port()}"
        nodes = []
        for r in (0, 1):
            s = load_settings(env={}, nnodes=2, node_rank=r, local_nproc_per_node=1, rdzv_endpoint=endpoint,
                              train_module="tests.attempt_probe")
            env = {**local_env(cfg, s), **attempt_env({"ti": _TI("manual__x", try_number)}),
                   "PROBE_OUT": str(out), "PROBE_SKIP_RANK": skip}
            nodes.append(LocalTrainProcess(local_command(plan, s), env, str(REPO), LineLog()))
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_run, args=(n, errors)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, f"{errors}\n" + "\n".join("\n".join(n.log.lines[-30:]) for n in nodes)
    attempts = sorted(p.name for p in (out / "attempts").iterdir())
    assert attempts == ["manual__x-try1-r0", "manual__x-try2-r0"], attempts
    ranks = sorted(p.name for p in out.glob("rank*"))
    assert ranks == [f"rank{r}-manual__x-try{t}-r0" for r in (0, 1) for t in (1, 2)], ranks  # both ranks agree
    assert (out / "wait-manual__x-try1-r0").read_text() == "complete"
    refused = (out / "wait-manual__x-try2-r0").read_text()
    assert refused.startswith("refused") and "rank(s) [1]" in refused, refused


def _run(node, errors):
    try:
        node.execute()
    except BaseException as e:  # reported with the nodes' logs
        errors.append(e)
