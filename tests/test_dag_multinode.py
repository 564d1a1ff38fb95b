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
from plugins.mft_airflow.launchers import LocalTrainProcess, local_command, local_env
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
