"""The DAG side of DPO (issue 30): the `objective` param sets every stage's objective through the
real form schema, and `base_model: latest` pins the model `models/LATEST` points to, which the
trainer then loads from the store (verified against its manifest); the DPO promotion gate; and
`make demo`'s DPO run through `airflow dags test` with the demo's settings (learns, promotes)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import publish_artifact
from pipeline_core.config import load_config
from pipeline_core.pointers import advance
from plugins.mft_airflow.plan import PlanError
from tests.dag_helpers import REPO
from tests.dpo_helpers import dpo_run
from tests.test_dag_params import dag, form, resolve, roots  # noqa: F401  (fixtures)
from tests.training_helpers import make_tiny_model


def test_objective_param_sets_every_stage(dag, roots):  # noqa: F811
    plan = resolve(form(dag, {"objective": "dpo"}), roots)
    cfg = load_config(plan.config_file, env={})
    assert (cfg.enrich.objective, cfg.filter.objective, cfg.train.objective) == ("dpo", "dpo", "dpo")
    assert load_config(resolve(form(dag, {}), roots).config_file, env={}).train.objective == "sft"
    with pytest.raises(Exception, match="dpo"):
        form(dag, {"objective": "ppo"})


def test_base_model_latest_resolves_to_the_promoted_model(dag, roots, tmp_path):  # noqa: F811
    from training.train import make_plan

    with pytest.raises(PlanError, match="no model was promoted yet"):
        resolve(form(dag, {"base_model": "latest"}), roots)
    model_dir = make_tiny_model(tmp_path / "sft-model" / "data")
    store = roots["pipeline.store_uri"]
    model_uri = uris.join(store, "runs", "sft-1", "model")
    publish_artifact(tmp_path / "sft-model", model_uri, kind="model", counts={}, extra={"format": "huggingface"})
    advance(uris.join(store, "models"), model_uri, "20260101000000000000")
    plan = resolve(form(dag, {"base_model": "latest", "objective": "dpo"}), roots)
    cfg = load_config(plan.config_file, env={})
    assert cfg.train.base_model == model_uri  # pinned: a retry trains from the same model
    # the trainer reads the store model's config (fetched and verified) before any weights load
    ready = tmp_path / "ready"
    from tests.test_dpo_train_e2e import dpo_train_ready

    cfg = load_config(plan.config_file, env={}, overrides={"train.seq_len": 128, "filter.seq_len": 128})
    tp = make_plan(cfg, dpo_train_ready(store, ready), plan.run_uri, 2, on_gpu=False)
    assert tp.base_config.num_hidden_layers == 4 and tp.base_config.model_type == "mistral"
    assert model_dir.is_dir()


def test_dpo_promotion_is_gated_on_val_reward_metrics_forward_only(tmp_path):
    from pipeline_core.config import DPOSettings, ReleaseSection
    from pipeline_core.pointers import order_key_from_date, read_pointer
    from training.dpo_promote import apply, evaluate

    store = uris.qualify(tmp_path / "store")
    models = uris.join(store, "models", "dpo")
    val, ref = uris.join(store, "datasets", "v", "train", "x"), uris.join(store, "reference", "k")
    release, dpo = ReleaseSection(), DPOSettings(min_val_reward_accuracy=0.6)

    def promote(name, acc, margin, day, val_uri=val):
        run, model = dpo_run(store, tmp_path, name, acc, margin, ref)
        key = order_key_from_date(datetime(2026, 1, 1, tzinfo=UTC) + timedelta(days=day))
        return apply(evaluate(model, run, val_uri, models, key, release, dpo), models, run_id=name)

    low = promote("r0", 0.5, 0.2, 1)
    assert not low.promoted and "min_val_reward_accuracy" in low.reason and read_pointer(models) is None
    first = promote("r1", 0.7, 0.2, 2)
    assert first.promoted and read_pointer(models).target.endswith("r1/model")
    worse = promote("r2", 0.65, 0.3, 3)  # same pairs, lower accuracy than the promoted model's
    assert not worse.promoted and "promoted DPO model's 0.7000" in worse.reason
    better = promote("r3", 0.75, 0.25, 4)
    assert better.promoted and read_pointer(models).target.endswith("r3/model")
    stale = promote("r4", 0.9, 0.9, 0)  # an older run never moves the pointer back
    assert not stale.promoted and read_pointer(models).target.endswith("r3/model")
    other = promote("r5", 0.61, 0.1, 5, val_uri=uris.join(store, "datasets", "w", "train", "y"))
    assert other.promoted and "other pairs: not compared" in other.reason


DEMO_DPO_CONF = REPO / "scripts" / "demo-dpo.json"  # what `make demo`'s DPO run triggers (scripts/demo.sh)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_demo_dpo_run_learns_and_promotes_through_the_dag(tmp_path):
    """`make demo`'s second run, through `airflow dags test` with the demo's own settings: objective dpo
    from the promoted SFT model (`base_model: latest`) on the bundled preference sample, through the
    real enrich, filter, trainer (torchrun, pp2) and publish. The reward accuracy moves, the model
    lands on `models/dpo/LATEST` (its record keeps the numbers the next DPO run is compared with) and
    the summary prints the per-step and validation metrics. The SFT run before it is
    test_dag_e2e's; here the promoted SFT model is the embedded tiny model, published as a store
    model (what that run's publish leaves), which saves the SFT run's minutes."""
    from pipeline_core import layout
    from pipeline_core.artifacts import fetch_artifact, read_manifest
    from pipeline_core.pointers import order_key_from_date, read_pointer
    from plugins.mft_airflow.summary import format_summary, latest_summary
    from tests.dag_helpers import airflow_env, init_db
    from tests.test_dag_e2e import SPARK_CONF, dags_test, roots_env
    from training.metrics import read_csv

    store = uris.qualify(tmp_path / "store")
    env = {**roots_env(tmp_path, store), "MFT_DEPLOY__SPARK_CONF": SPARK_CONF}
    home = tmp_path / "home"
    init_db(airflow_env(home, env))
    make_tiny_model(tmp_path / "sft" / "data")
    sft_model = uris.join(store, "runs", "sft", "model")
    publish_artifact(tmp_path / "sft", sft_model, kind="model", counts={}, extra={"format": "huggingface"})
    advance(uris.join(store, "models"), sft_model, order_key_from_date(datetime(2026, 1, 1, tzinfo=UTC)))

    conf = {**json.loads(DEMO_DPO_CONF.read_text()), "source_uri": uris.qualify(REPO / "sample_data" / "preference"),
            "run_id": "demo-dpo"}
    dags_test(home, conf, "2026-01-02", env)

    run = uris.join(store, "runs", "demo-dpo")
    model = read_manifest(layout.model_uri(run))
    assert model.config["train"]["base_model"] == sft_model  # `latest`, pinned to the promoted SFT model
    pointer = read_pointer(uris.join(store, "models", "dpo"))
    assert pointer.target == layout.model_uri(run)  # promoted to models/dpo/LATEST; models/LATEST stays SFT's
    assert read_pointer(uris.join(store, "models")).target == sft_model
    fetch_artifact(layout.report_uri(run), tmp_path / "report")
    steps, evals = (read_csv(tmp_path / "report" / "data" / f) for f in ("metrics.csv", "eval.csv"))
    assert abs(steps[0]["loss"] - 0.693147) < 1e-4 and steps[0]["reward_accuracy"] == 0  # the policy is the reference
    last = steps[-4:]
    assert sum(r["reward_accuracy"] for r in last) / 4 >= 0.75 and min(r["reward_margin"] for r in last) > 0, steps
    first, final = evals[0], evals[-1]
    assert final["eval_pairs"] >= 8  # filter.val_fraction 0.25 of the sample's prompts
    assert final["eval_reward_accuracy"] > first["eval_reward_accuracy"], evals  # the validation moves
    assert final["eval_reward_margin"] > first["eval_reward_margin"] + 0.5 and final["eval_dpo_loss"] < 0.45, evals
    assert pointer.extra["reward_accuracy"] == final["eval_reward_accuracy"]
    assert pointer.extra["reward_margin"] == pytest.approx(final["eval_reward_margin"])
    text = format_summary(latest_summary(store, None, "dpo"))
    assert "PROMOTED to models/dpo/LATEST" in text and f"{final['eval_reward_accuracy']:.3f} at step {final['step']}" in text
    assert len([ln for ln in text.splitlines() if ln.strip().split(" |")[0].strip().isdigit()]) == len(steps) // 2 + 1
