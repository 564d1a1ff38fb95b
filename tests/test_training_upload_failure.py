"""A store that refuses every checkpoint upload: the training run must fail, and no model may be
committed (a run whose checkpoints are not in the store is not done). Real torchrun, 2 DeepSpeed
pipeline stages on CPU, a real S3 server behind a proxy that answers every checkpoint PUT with a
503. When the run raises (at the first failed push or at the end) is the trainer's choice; this
test asserts the outcome only."""

from __future__ import annotations

import json
import subprocess

import pytest

from pipeline_core import layout, uris
from pipeline_core.artifacts import read_latest, read_manifest
from pipeline_core.config import StorageSection, load_config
from tests.conftest import REPO, S3_CREDENTIALS
from tests.fault_proxy import FaultProxy
from tests.test_training_e2e import _cmd, _env
from tests.training_helpers import make_tiny_model, sample_train_ready

pytestmark = pytest.mark.slow


def _checkpoint_puts(method: str, path: str) -> bool:
    return method in ("PUT", "POST") and "/checkpoints/" in path


def test_failed_checkpoint_uploads_fail_the_run_and_commit_no_model(s3_server, tmp_path):
    store = f"s3://{s3_server.new_bucket()}"
    direct = StorageSection(endpoint_url=s3_server.endpoint, max_attempts=1)
    input_uri = sample_train_ready(store, tmp_path / "ready", seq_len=128, storage=direct)
    model_dir = make_tiny_model(tmp_path / "tiny", hidden_size=32, intermediate_size=64)
    ds = json.loads((REPO / "training" / "ds_config.json").read_text())
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_type": "linear"}}
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    run_uri = uris.join(store, "runs", "upload-fails")
    with FaultProxy(s3_server.endpoint, fail_matching=True, match=_checkpoint_puts, status=503,
                    code="ServiceUnavailable") as proxy:
        cfg = load_config(env={}, overrides={
            "pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp_path / "staging"),
            "storage.endpoint_url": proxy.endpoint, "storage.max_attempts": 2,
            "train.base_model": str(model_dir), "train.seq_len": 128, "train.micro_batch_size": 2,
            "train.gradient_accumulation_steps": 1, "train.steps": 4, "train.checkpoint_every": 2,
            "train.precision": "fp32", "train.warmup_steps": 1, "train.eval_batches": 1,
            "train.verify_parity": False, "train.ds_config": str(tmp_path / "ds_config.json"),
        })
        # credentials only: MFT__STORAGE__ENDPOINT_URL would override the config and bypass the proxy
        log_path = tmp_path / "train.log"
        with log_path.open("w") as log:
            proc = subprocess.run(_cmd(input_uri, run_uri, cfg.dump(tmp_path / "config.yaml")), env=_env(S3_CREDENTIALS),
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=600)
        out = log_path.read_text()
        assert proxy.failed > 0, "no checkpoint PUT reached the proxy: the fault never fired\n" + out[-3000:]
    assert proc.returncode != 0, "the run succeeded although no checkpoint reached the store\n" + out[-3000:]
    assert "checkpoint" in out and "fail" in out.lower(), out[-3000:]
    assert read_manifest(layout.model_uri(run_uri), direct) is None, "a model was committed"
    assert read_latest(layout.checkpoints_uri(run_uri), direct) is None
