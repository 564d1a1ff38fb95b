"""Promotion's compare-and-swap through the publish task's own code (`summary.publish_model`, S3 on
loopback): a backfill promoted between a nightly's evaluation and its move makes the nightly
evaluate again (and not replace the better model); a publisher whose mirror write failed after its
pointer step leaves `models/LATEST` behind only until the next publish, whatever that one decides;
an order key far in the future is refused before anything is evaluated (issue 26.4, 26.5). The DPO
pointer (`models/dpo/LATEST`, issue 30) goes through the same loop and loses the same race the same way."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from pipeline_core import uris
from pipeline_core.artifacts import publish_artifact, read_latest
from pipeline_core.config import DPOSettings, ReleaseSection, StorageSection
from pipeline_core.pointers import PointerError, order_key_from_date, read_pointer
from plugins.mft_airflow.run_plan import RunPlan
from plugins.mft_airflow.summary import publish_model
from tests.dpo_helpers import dpo_run
from tests.fault_proxy import FaultProxy, puts_ending_with
from tests.report_helpers import tiny_models, val_artifact

DAY = datetime(2026, 1, 1, 2, tzinfo=UTC)


def _key(days: int) -> str:
    return order_key_from_date(DAY + timedelta(days=days))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("models"))


def _plans(root: str, val: str, storage, weights: dict[str, str], models) -> dict[str, RunPlan]:
    plans = {}
    for run, which in weights.items():
        run_uri = uris.join(root, "runs", run)
        plans[run] = RunPlan(
            config_file="unused.yaml", dataset_version="v1", run_id=run, source_uri=root, store_uri=root,
            enriched_uri=uris.join(root, "datasets", "v1", "enriched", "e"), train_ready_uri=val,
            run_uri=run_uri, model_uri=uris.join(run_uri, "model"), models_uri=uris.join(root, "models"),
            trainer_name=f"t-{run}")
        publish_artifact(models[which], plans[run].model_uri, kind="model", storage=storage)
    return plans


def _race(s3_server, plans: dict[str, RunPlan], gate: ReleaseSection, dpo: DPOSettings | None = None) -> tuple[dict, dict]:
    """The nightly (order key 3) is evaluated against the old pointer (key 1) and held right after,
    at its first summary write, before its move; meanwhile the backfill (key 2) publishes. Returns
    (the backfill's promotion, the nightly's final promotion)."""
    storage = s3_server.storage
    assert publish_model(plans["old"], storage, _key(1), gate, dpo=dpo).promotion.promoted
    hold = threading.Event()
    with FaultProxy(s3_server.endpoint, fail_first=1, methods=("PUT",), path_contains="/runs/nightly/pipeline_summary",
                    hold=hold) as proxy:
        out: dict = {}
        nightly = threading.Thread(target=lambda: out.update(s=publish_model(
            plans["nightly"], StorageSection(endpoint_url=proxy.endpoint, max_attempts=3), _key(3), gate, dpo=dpo)))
        nightly.start()
        deadline = time.monotonic() + 600
        while proxy.held == 0 and nightly.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.held == 1, "the nightly never reached its summary write"
        back = publish_model(plans["backfill"], storage, _key(2), gate, dpo=dpo).promotion.to_dict()
        hold.set()
        nightly.join(600)
    return back, out["s"].promotion.to_dict()


def test_a_backfill_promoted_between_compare_and_apply_makes_the_nightly_evaluate_again(
        models, s3_server, s3_bucket_uri, tmp_path):
    root, storage = s3_bucket_uri, s3_server.storage
    val = val_artifact(tmp_path / "tr", uris.join(root, "datasets", "v1", "train", "abc"), storage)
    # the nightly's model is as good as the old LATEST (it would be promoted over it) and worse
    # than the backfill's
    plans = _plans(root, val, storage, {"old": "bad", "backfill": "good", "nightly": "bad"}, models)
    back, p = _race(s3_server, plans, ReleaseSection())
    assert back["promoted"] and back["current_uri"] == plans["old"].model_uri
    assert not p["promoted"], p
    assert p["current_uri"] == plans["backfill"].model_uri and p["current_order_key"] == _key(2)
    assert p["candidate_val_loss"] > p["current_val_loss"] and "worse than the current LATEST" in p["reason"]
    assert read_pointer(plans["old"].models_uri, storage).target == plans["backfill"].model_uri
    assert read_latest(plans["old"].models_uri, storage) == plans["backfill"].model_uri


def test_the_dpo_pointer_compares_and_swaps_like_the_sft_one(s3_server, s3_bucket_uri, tmp_path):
    """The same race on `models/dpo/LATEST` through the DPO gate (training/dpo_promote.py): the nightly's
    val reward accuracy beats the old DPO model's and not the backfill's, so after the lost race it
    is compared again and not promoted."""
    root, storage = s3_bucket_uri, s3_server.storage
    val, ref = uris.join(root, "datasets", "pref", "train", "dpo0"), uris.join(root, "reference", "k")
    plans = {}
    for name, acc, margin in (("old", 0.6, 0.1), ("backfill", 0.8, 0.3), ("nightly", 0.7, 0.2)):
        run_uri, model_uri = dpo_run(root, tmp_path, name, acc, margin, ref, storage)
        plans[name] = RunPlan(
            config_file="unused.yaml", dataset_version="pref", run_id=name, source_uri=root, store_uri=root,
            enriched_uri=uris.join(root, "datasets", "pref", "enriched", "e"), train_ready_uri=val, run_uri=run_uri,
            model_uri=model_uri, models_uri=uris.join(root, "models", "dpo"), trainer_name=f"t-{name}", objective="dpo")
    back, p = _race(s3_server, plans, ReleaseSection(), DPOSettings())
    assert back["promoted"] and back["current_uri"] == plans["old"].model_uri
    assert not p["promoted"], p
    assert p["current_uri"] == plans["backfill"].model_uri and p["current_order_key"] == _key(2)
    assert "val reward accuracy 0.7000 < the promoted DPO model's 0.8000" in p["reason"]
    pointer = read_pointer(plans["old"].models_uri, storage)
    assert pointer.target == plans["backfill"].model_uri and pointer.extra["reward_accuracy"] == 0.8
    assert read_latest(plans["old"].models_uri, storage) == plans["backfill"].model_uri


def test_a_mirror_left_behind_by_a_failed_publisher_converges_on_the_next_publish(
        models, s3_server, s3_bucket_uri, tmp_path):
    root, storage = s3_bucket_uri, s3_server.storage
    val = val_artifact(tmp_path / "tr", uris.join(root, "datasets", "v1", "train", "abc"), storage)
    plans = _plans(root, val, storage, {"first": "good", "second": "good", "late": "good"}, models)
    models_uri = plans["first"].models_uri
    gate = ReleaseSection(promote_tolerance=0.01)
    publish_model(plans["first"], storage, _key(1), gate)
    # the second publisher's pointer step lands, then every write of the plain mirror fails (as if it was killed)
    with FaultProxy(s3_server.endpoint, fail_matching=True, match=puts_ending_with("/models/LATEST")) as proxy:
        with pytest.raises(Exception):  # noqa: B017 - whatever the client raises after its retries
            publish_model(plans["second"], StorageSection(endpoint_url=proxy.endpoint, max_attempts=2), _key(3), gate)
        assert proxy.failed >= 1
    assert read_pointer(models_uri, storage).target == plans["second"].model_uri
    assert read_latest(models_uri, storage) == plans["first"].model_uri  # the mirror points backwards
    # an older run publishes next: it does not move the pointer, and the mirror is repaired anyway
    late = publish_model(plans["late"], storage, _key(2), gate).promotion.to_dict()
    assert not late["promoted"] and "only moves forward" in late["reason"]
    assert read_latest(models_uri, storage) == plans["second"].model_uri == read_pointer(models_uri, storage).target


def test_an_order_key_far_in_the_future_is_refused_before_evaluation(models, local_store_uri, tmp_path):
    root = local_store_uri
    val = val_artifact(tmp_path / "tr", uris.join(root, "datasets", "v1", "train", "abc"))
    plans = _plans(root, val, None, {"r2100": "good"}, models)
    with pytest.raises(PointerError, match="release.max_order_key_ahead_s"):
        publish_model(plans["r2100"], None, order_key_from_date(datetime(2100, 1, 1, tzinfo=UTC)), ReleaseSection())
    assert read_pointer(plans["r2100"].models_uri) is None and read_latest(plans["r2100"].models_uri) is None
