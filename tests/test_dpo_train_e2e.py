"""DPO through the real trainer (issue 30): `torchrun --nproc_per_node 2 training/train.py` on CPU
(gloo), 2 pipeline stages, tiny Mistral, the bundled preference sample's pairs rendered by the
filter's own code, one pair per row.

One uninterrupted run: the reference pass runs once before the first step and is committed under
reference/<key>; per-step and validation DPO metrics are in the report. A second run of the same
model and data is SIGKILLed after a checkpoint push and restarted: it reuses the committed
reference log-probs (no second pass) and its losses after the resume equal the uninterrupted run's
bit for bit (fp32), the SFT resume test's machinery (tests/test_training_e2e.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline_core import layout, uris
from pipeline_core.artifacts import fetch_artifact, publish_artifact, read_manifest
from pipeline_core.config import load_config
from spark_jobs.filter.train_ready import write_rows
from tests.proc_helpers import lines_within
from tests.training_helpers import make_tiny_model
from training.launch import kill_tree, process_env, standalone_argv
from training.metrics import read_csv

REPO = Path(__file__).resolve().parents[1]
SEQ = 128
STEPS = 21  # 3 epochs of the 28 train pairs at 4 pairs a step
pytestmark = pytest.mark.slow


def dpo_train_ready(store: str, local: Path) -> str:
    """The bundled preference sample's pairs (samples.preferences), rendered and packed
    by the filter's code (render_docs.render_pair, preference.pair_row); every 6th pair to val."""
    from types import SimpleNamespace

    from pipeline_core.config import FilterSection
    from pipeline_core.handoffs import TrainReadyInfo
    from samples.preferences import _pairs
    from spark_jobs.conversations.chat_format import load_tokenizer
    from spark_jobs.filter.filter_rows import conversation_options
    from spark_jobs.filter.render_docs import render_pair
    from spark_jobs.preference import pair_row

    fcfg = FilterSection(objective="dpo", seq_len=SEQ)
    tok = load_tokenizer("mistral-v1")
    rows: dict[str, list] = {"train": [], "val": []}
    for i, (q, good, bad) in enumerate(_pairs()):
        doc, cut = render_pair([{"role": "user", "content": q}, {"role": "assistant", "content": good}], bad,
                               SimpleNamespace(metadata=None, reasoning=None), tok, fcfg, conversation_options(fcfg))
        ids, labels, pos = pair_row((doc.input_ids[:cut], doc.labels[:cut]), (doc.input_ids[cut:], doc.labels[cut:]),
                                    SEQ, tok.pad_id)
        rows["val" if i % 6 == 0 else "train"].append(
            {"input_ids": ids.tolist(), "labels": labels.tolist(), "position_ids": pos.tolist()})
    write_rows(local / "data" / "train" / "part-00000.parquet", rows["train"][:14])
    write_rows(local / "data" / "train" / "part-00001.parquet", rows["train"][14:])
    write_rows(local / "data" / "val" / "part-00000.parquet", rows["val"])
    uri = uris.join(store, "datasets", "pref", "train", "dpo0")
    n = sum(len(v) for v in rows.values())
    publish_artifact(local, uri, kind="train-ready", counts={"in": n, "out": n},
                     extra=TrainReadyInfo(seq_len=SEQ, tokenizer=tok.spec_for_manifest(), objective="dpo",
                                          train_on="last_assistant_turn", prompt_context="conversation").to_extra())
    return uri


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo-e2e")
    store = uris.qualify(tmp / "store")
    model_dir = make_tiny_model(tmp / "tiny", hidden_size=32, intermediate_size=64)
    input_uri = dpo_train_ready(store, tmp / "ready")
    ds = json.loads((REPO / "training" / "ds_config.json").read_text())
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_type": "linear"}}
    (tmp / "ds_config.json").write_text(json.dumps(ds))
    over = {
        "pipeline.store_uri": store, "pipeline.staging_uri": uris.qualify(tmp / "staging"),
        "enrich.objective": "dpo", "filter.objective": "dpo", "train.objective": "dpo",
        "train.base_model": str(model_dir), "train.seq_len": SEQ, "train.micro_batch_size": 2,
        "train.gradient_accumulation_steps": 2, "train.steps": STEPS, "train.checkpoint_every": 4,
        "train.keep_last": 2, "train.precision": "fp32", "train.learning_rate": 1e-2, "train.warmup_steps": 1,
        "train.eval_batches": 2, "train.ds_config": str(tmp / "ds_config.json"), "train.lease_ttl_s": 6,
        "train.eval_every": 8, "train.dpo": {"beta": 0.5},
    }
    cfg = load_config(env={}, overrides=over)
    long_cfg = load_config(env={}, overrides={**over, "train.steps": 40})
    env = process_env({"MFT_CHECKPOINT_HMAC_KEY": "dpo-e2e-checkpoint-signing-key"}, cpu=True)
    return {"tmp": tmp, "store": store, "cfg": cfg, "cfg_path": cfg.dump(tmp / "config.yaml"),
            "long_cfg_path": long_cfg.dump(tmp / "long.yaml"), "input": input_uri, "env": env}


def _run(cmd, env, log_path: Path) -> str:
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-6000:]
    return out


def _report(run_uri: str, tmp: Path) -> Path:
    fetch_artifact(layout.report_uri(run_uri), tmp)
    return tmp / "data"


@pytest.fixture(scope="module")
def reference(setup):
    run_uri = uris.join(setup["store"], "runs", "dpo-ref")
    out = _run(standalone_argv(setup["input"], run_uri, setup["cfg_path"], 2), setup["env"], setup["tmp"] / "ref.log")
    return run_uri, out


def test_dpo_run_computes_reference_once_and_reports_reward_metrics(setup, reference):
    run_uri, out = reference
    assert out.count("reference pass:") == 2  # logged by both ranks, once
    data = _report(run_uri, setup["tmp"] / "ref-report")
    summary = json.loads((data / "summary.json").read_text())
    ref = read_manifest(summary["reference_uri"])
    assert ref is not None and ref.kind == "reference" and summary["reference_reused"] is False
    rows = read_csv(data / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["pairs"] == 4 and 0 <= r["reward_accuracy"] <= 1 for r in rows)  # 2 pairs x 2 micro-batches
    assert abs(rows[0]["loss"] - 0.693147) < 1e-4  # step 1: the policy is the reference, margin 0
    assert all(abs(r["reward_margin"] - (r["chosen_reward"] - r["rejected_reward"])) < 1e-9 for r in rows)
    evals = read_csv(data / "eval.csv")
    # preferences are being learnt: the third epoch's mean loss and reward accuracy against the first's
    first, third = rows[:7], rows[-7:]
    assert sum(r["loss"] for r in third) / 7 < sum(r["loss"] for r in first) / 7 - 0.02, rows
    assert sum(r["reward_accuracy"] for r in third) > sum(r["reward_accuracy"] for r in first), rows
    assert [e["step"] for e in evals] == [8, 16, STEPS]
    assert all(e["eval_pairs"] == 4 and e["eval_reward_accuracy"] is not None for e in evals)
    assert summary["eval_reward_accuracy"] == evals[-1]["eval_reward_accuracy"]


def test_kill_resume_reuses_the_reference_and_matches(setup, reference):
    ref_uri, _ = reference
    tmp, env = setup["tmp"], setup["env"]
    run_uri = uris.join(setup["store"], "runs", "dpo-killed")
    with (tmp / "killed-1.log").open("w") as log:
        proc = subprocess.Popen(standalone_argv(setup["input"], run_uri, setup["long_cfg_path"], 2), env=env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in lines_within(proc, timeout_s=400):
                log.write(line)
                if "pushed checkpoint" in line and line.rstrip().endswith("/step-8"):
                    kill_tree(proc)
                    break
            else:
                kill_tree(proc)
                pytest.fail("run ended without pushing step-8: " + (tmp / "killed-1.log").read_text()[-3000:])
        except TimeoutError:
            kill_tree(proc)
            pytest.fail("no step-8 push within 400 s: " + (tmp / "killed-1.log").read_text()[-3000:])
    first = (tmp / "killed-1.log").read_text()
    assert "reference log-probs reused" in first  # same model + data as the reference run: no second pass
    out = _run(standalone_argv(setup["input"], run_uri, setup["cfg_path"], 2),
               {**env, "MFT__PIPELINE__STAGING_URI": uris.qualify(tmp / "staging-fresh")}, tmp / "killed-2.log")
    assert "reference log-probs reused" in out and "reference pass:" not in out
    assert "resumed from" in out
    ref = {r["step"]: r for r in read_csv(_report(ref_uri, tmp / "r1") / "metrics.csv")}
    got = {r["step"]: r for r in read_csv(_report(run_uri, tmp / "r2") / "metrics.csv")}
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(9, STEPS + 1):
        assert got[s]["loss"] == ref[s]["loss"] and got[s]["reward_accuracy"] == ref[s]["reward_accuracy"], s
