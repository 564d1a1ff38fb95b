"""The train stage end to end: `torchrun --nproc_per_node 2 training/train.py` on CPU (gloo),
2 pipeline stages, tiny Mistral with the real v1 tokenizer, checkpoints pushed to a real S3
server (moto over HTTP).

One reference run and one run that is SIGKILLed after a checkpoint push, damaged in the store,
and restarted: its losses after the resume must equal the reference's bit for bit (fp32)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline_core import layout, uris
from pipeline_core.artifacts import fetch_artifact, read_latest, read_manifest
from pipeline_core.config import load_config
from pipeline_core.store import open_store
from tests.proc_helpers import lines_within
from tests.training_helpers import make_tiny_model, sample_train_ready
from training.checkpoints import store_steps
from training.launch import kill_tree, process_env, standalone_argv
from training.metrics import read_csv

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
pytestmark = pytest.mark.slow


def _env(extra: dict[str, str]) -> dict[str, str]:
    return process_env({**extra, "MFT_CHECKPOINT_HMAC_KEY": "e2e-test-checkpoint-signing-key"}, cpu=True)


def _cmd(input_uri: str, run_uri: str, cfg_path: Path) -> list[str]:
    return standalone_argv(input_uri, run_uri, cfg_path, nproc=2)


def _run(cmd, env, log_path: Path) -> str:
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=400)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-6000:]
    return out


_kill_tree = kill_tree


def _losses(run_uri: str, storage, tmp: Path) -> dict[int, float]:
    fetch_artifact(layout.report_uri(run_uri), tmp, storage)
    return {int(r["step"]): r["loss"] for r in read_csv(tmp / "data" / "metrics.csv")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, s3_server):
    tmp = tmp_path_factory.mktemp("train-e2e")
    store = f"s3://{s3_server.new_bucket()}"
    model_dir = make_tiny_model(tmp / "tiny", hidden_size=32, intermediate_size=64)  # small checkpoints
    # the bundled Nemotron sample, tokenized and packed by the filter stage's own code
    with s3_server.credentials():  # module scope: the per-test credentials fixture does not reach here
        input_uri = sample_train_ready(store, tmp / "ready", seq_len=128, storage=s3_server.storage)
    ds = json.loads((REPO / "training" / "ds_config.json").read_text())
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_type": "linear"}}
    ds_path = tmp / "ds_config.json"
    ds_path.write_text(json.dumps(ds))
    cfg = load_config(overrides={
        "pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp / "staging"),
        "storage.endpoint_url": s3_server.endpoint, "storage.max_attempts": 3,
        "train.base_model": str(model_dir), "train.seq_len": 128, "train.micro_batch_size": 2,
        "train.gradient_accumulation_steps": 2, "train.steps": STEPS, "train.checkpoint_every": 4,
        "train.keep_last": 2, "train.precision": "fp32", "train.learning_rate": 2e-3, "train.warmup_steps": 1,
        "train.verify_parity": True, "train.eval_batches": 2, "train.ds_config": str(ds_path),
        # the killed run's lease expires in 12 s; a live one renews every 4 s and is lost only after 9 s
        # without a renewal (training.lease margins), room enough for a loaded 2-core machine
        "train.lease_ttl_s": 12,
        "train.eval_every": 6,
    })
    cfg_path = cfg.dump(tmp / "config.yaml")
    # The run that gets killed is planned longer, so that it is surely still training when the
    # kill lands; a constant LR after warmup makes its first STEPS steps the reference's.
    long_cfg = load_config(overrides={**cfg.model_dump(), "train": {**cfg.train.model_dump(), "steps": 40}})
    return {"tmp": tmp, "store": store, "cfg": cfg, "cfg_path": cfg_path, "long_cfg_path": long_cfg.dump(tmp / "long.yaml"),
            "input": input_uri, "env": _env(s3_server.env), "storage": cfg.storage}


@pytest.fixture(scope="module")
def reference(setup):
    run_uri = uris.join(setup["store"], "runs", "reference")
    out = _run(_cmd(setup["input"], run_uri, setup["cfg_path"]), setup["env"], setup["tmp"] / "ref.log")
    return run_uri, out


def test_reference_run_learns_exports_and_reports(setup, reference):
    run_uri, out = reference
    storage, tmp = setup["storage"], setup["tmp"]
    losses = _losses(run_uri, storage, tmp / "ref-report")
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = [losses[s] for s in (1, 2, 3)], [losses[s] for s in (STEPS - 2, STEPS - 1, STEPS)]
    assert sum(last) / 3 < sum(first) / 3 - 0.3, losses

    summary = json.loads((tmp / "ref-report" / "data" / "summary.json").read_text())
    # the 2-stage pipeline's logits equal transformers' on a packed val batch, on the base
    # model and on the exported one after training
    assert summary["parity_base_max_abs_diff"] <= 1e-5
    assert summary["parity_export_max_abs_diff"] <= 1e-5
    # the exported tokenizer reproduced every training document of the bundled sample (render sample)
    # and the prompts of their final answers before anything was published (training.render_check)
    assert summary["render_check_documents"] > 200 and summary["render_check_generation_prompts"] > 200
    assert summary["eval_loss"] < losses[1] and summary["eval_perplexity"] > 1
    assert (tmp / "ref-report" / "data" / "loss_curve.png").stat().st_size > 1000
    # periodic validation (train.eval_every=6) and the final one, token-weighted, in eval.csv
    evals = read_csv(tmp / "ref-report" / "data" / "eval.csv")
    assert [int(r["step"]) for r in evals] == [6, STEPS]
    assert all(r["eval_target_tokens"] > 0 and r["eval_loss"] > 0 for r in evals)
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    assert summary["best_eval_step"] in (6, STEPS) and summary["skipped_steps"] == 0
    assert summary["best_checkpoint"] in (None, layout.checkpoint_uri(run_uri, STEPS))

    # checkpoints: on S3, committed, LATEST -> newest, only keep_last=2 left
    assert read_latest(layout.checkpoints_uri(run_uri), storage) == layout.checkpoint_uri(run_uri, STEPS)
    assert store_steps(run_uri, storage) == [STEPS, STEPS - 4]
    assert read_manifest(layout.checkpoint_uri(run_uri, STEPS), storage).extra["data_position"] == STEPS * 2

    # export: a Hugging Face model directory with tokenizer, loadable as is
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fetch_artifact(layout.model_uri(run_uri), tmp / "model", storage)
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "model" / "data"))
    tok = AutoTokenizer.from_pretrained(str(tmp / "model" / "data"))
    ids = tok("The cat is", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 1 and len(tok) == 32000 and tok.pad_token_id == 0
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()



def test_rerunning_a_finished_run_is_a_noop(setup, reference, monkeypatch, caplog):
    from training.train import main

    run_uri, _ = reference
    monkeypatch.setenv("WORLD_SIZE", "2")
    caplog.set_level("INFO")
    assert main(["--input", setup["input"], "--output", run_uri, "--config", str(setup["cfg_path"])]) == 0
    assert "nothing to do" in caplog.text


def test_kill_resume_skips_damaged_checkpoints_and_matches_reference(setup, reference):
    ref_uri, _ = reference
    storage, tmp, env = setup["storage"], setup["tmp"], setup["env"]
    run_uri = uris.join(setup["store"], "runs", "killed")
    cmd = _cmd(setup["input"], run_uri, setup["cfg_path"])
    long_cmd = _cmd(setup["input"], run_uri, setup["long_cfg_path"])

    # 1) SIGKILL the whole job right after the step-8 checkpoint is in the store
    with (tmp / "killed-1.log").open("w") as log:
        proc = subprocess.Popen(long_cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in lines_within(proc, timeout_s=300):
                log.write(line)
                if "pushed checkpoint" in line and line.rstrip().endswith("/step-8"):
                    _kill_tree(proc)
                    break
            else:
                _kill_tree(proc)
                log.flush()
                pytest.fail("run ended without pushing step-8: " + (tmp / "killed-1.log").read_text()[-3000:])
        except TimeoutError:
            _kill_tree(proc)
            log.flush()
            pytest.fail("no step-8 checkpoint push within 300 s: " + (tmp / "killed-1.log").read_text()[-3000:])
    assert read_manifest(layout.model_uri(run_uri), storage) is None, "killed run must not have finished"
    committed = [s for s in store_steps(run_uri, storage)
                 if read_manifest(layout.checkpoint_uri(run_uri, s), storage) is not None]
    newest = committed[0]
    assert len(committed) >= 2 and committed[1] <= STEPS - 2, committed
    previous = committed[1]

    # 2) damage the store: the newest checkpoint gets a corrupted file, and a newer one is only
    #    partly uploaded (files, no manifest)
    store, key = open_store(layout.checkpoint_uri(run_uri, newest), storage)
    victim = f"{key}/{read_manifest(layout.checkpoint_uri(run_uri, newest), storage).object_path('data/layer_03-model_states.pt')}"
    raw = bytearray(store.get_bytes(victim))
    raw[len(raw) // 2] ^= 0xFF
    s3 = boto3_client(setup)
    bucket = uris.split_bucket_key(setup["store"])[0]
    s3.put_object(Bucket=bucket, Key=victim, Body=bytes(raw))  # bypasses the store's own checksums
    partial_step = newest + 1
    pstore, pkey = open_store(layout.checkpoint_uri(run_uri, partial_step), storage)
    pstore.put_bytes(f"{pkey}/data/layer_00-model_states.pt", b"half an upload")

    # 3) restart (now for STEPS steps): skips both with a warning naming them, resumes from the
    #    previous checkpoint
    # on a fresh machine (new staging): what the killed attempt saved locally but never pushed is gone,
    # so the resume point is decided by the store alone
    out = _run(cmd, {**env, "MFT__PIPELINE__STAGING_URI": uris.qualify(tmp / "staging-fresh")}, tmp / "killed-2.log")
    assert f"skipping checkpoint {layout.checkpoint_uri(run_uri, partial_step)}: no manifest" in out
    assert f"skipping checkpoint {layout.checkpoint_uri(run_uri, newest)}" in out and "layer_03" in out
    assert f"resumed from {layout.checkpoint_uri(run_uri, previous)}: step {previous}" in out

    # 4) losses after the resume equal the uninterrupted run's, bitwise (fp32, same data order)
    ref = _losses(ref_uri, storage, tmp / "ref-report-2")
    got = _losses(run_uri, storage, tmp / "killed-report")
    assert sorted(got) == list(range(1, STEPS + 1))
    resumed = list(range(previous + 1, STEPS + 1))
    assert len(resumed) >= 2
    assert [got[s] for s in resumed] == [ref[s] for s in resumed]
    assert read_latest(layout.checkpoints_uri(run_uri), storage) == layout.checkpoint_uri(run_uri, STEPS)


def boto3_client(setup):
    import boto3

    return boto3.client("s3", endpoint_url=setup["cfg"].storage.endpoint_url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def test_a_second_trainer_is_refused_while_the_first_pushes(setup):
    """Two trainers on one run id (a zombie task and its retry): the second is refused, naming the
    holder, and the first's checkpoints are untouched."""
    storage, tmp, env = setup["storage"], setup["tmp"], setup["env"]
    run_uri = uris.join(setup["store"], "runs", "contended")
    cfg = setup["cfg"]  # planned far longer than the test lasts: it is surely still training (and is killed)
    endless = load_config(overrides={**cfg.model_dump(), "train": {**cfg.train.model_dump(), "steps": 100_000}})
    with (tmp / "first.log").open("w") as log:
        first = subprocess.Popen(_cmd(setup["input"], run_uri, endless.dump(tmp / "endless.yaml")), env=env, cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in lines_within(first, timeout_s=300):  # TimeoutError if no push is seen
                log.write(line)
                if "pushed checkpoint" in line and line.rstrip().endswith("/step-4"):
                    break
            else:
                pytest.fail("first trainer ended early: " + (tmp / "first.log").read_text()[-3000:])
            second = subprocess.run(_cmd(setup["input"], run_uri, setup["cfg_path"]), env=env, cwd=REPO,
                                    capture_output=True, text=True, timeout=300)
            assert second.returncode != 0
            assert "LeaseHeld" in second.stdout + second.stderr
            assert "is being trained by" in second.stdout + second.stderr
            assert first.poll() is None, "the first trainer must go on"
            refused = second.stdout + second.stderr
            for write in ("committed", "quarantined", "pruned", "removing", "discarded", "pushing"):
                assert write not in refused, f"the refused trainer wrote to the run ({write!r})"
            # the first's newest checkpoint (it keeps pruning older ones) is intact: every file verifies
            latest = read_latest(layout.checkpoints_uri(run_uri), storage)
            assert latest is not None
            fetch_artifact(latest, tmp / "contended-latest", storage)
        finally:
            _kill_tree(first)


def test_a_model_without_its_report_is_repaired_on_retry(setup, reference):
    """Killed between the model and the report publish: the retry is not a no-op; it resumes from the
    last checkpoint, re-publishes the same model (no-op) and the report."""
    run_uri, _ = reference
    storage, tmp, env = setup["storage"], setup["tmp"], setup["env"]
    model = read_manifest(layout.model_uri(run_uri), storage)
    store, key = open_store(layout.report_uri(run_uri), storage)
    store.delete_prefix(key.rstrip("/") + "/")
    assert read_manifest(layout.report_uri(run_uri), storage) is None
    out = _run(_cmd(setup["input"], run_uri, setup["cfg_path"]), env, tmp / "repair.log")
    assert f"resumed from {layout.checkpoint_uri(run_uri, STEPS)}: step {STEPS}" in out
    assert read_manifest(layout.model_uri(run_uri), storage).sha256 == model.sha256, "the model was replaced"
    assert read_manifest(layout.report_uri(run_uri), storage) is not None
    assert sorted(_losses(run_uri, storage, tmp / "repaired-report")) == list(range(1, STEPS + 1))
