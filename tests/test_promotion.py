"""Evaluation-gated promotion with real (tiny, random) Mistral-architecture models exported with
`save_pretrained`: the token-weighted val loss matches transformers' own loss, a worse model does not
move `models/LATEST`, a forced one does, an older run never moves it back, and a same-size corrupt
`model.safetensors` stops publishing before any pointer moves (local store and S3 on loopback)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline_core import uris
from pipeline_core.artifacts import CorruptArtifact, publish_artifact, read_latest
from pipeline_core.config import ReleaseSection
from pipeline_core.handoffs import IGNORE_INDEX
from pipeline_core.pointers import advance, order_key_from_date, read_pointer
from tests.report_helpers import packed_rows, tiny_models, val_artifact
from training.promote import decide, promote
from training.val_loss import val_loss

DAY = datetime(2026, 1, 1, 2, tzinfo=UTC)


def _key(days: int) -> str:
    return order_key_from_date(DAY + timedelta(days=days))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return tiny_models(tmp_path_factory.mktemp("models"))


def _val_artifact(tmp_path, root, storage) -> str:
    return val_artifact(tmp_path / "train-ready", uris.join(root, "datasets", "v1", "train", "abc"), storage)


def _model_artifact(src: Path, root: str, run: str, storage) -> str:
    uri = uris.join(root, "runs", run, "model")
    publish_artifact(src, uri, kind="model", storage=storage)
    return uri


def test_val_loss_is_token_weighted_and_matches_transformers(models, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    f = tmp_path / "val.parquet"
    table = packed_rows(3, seed=1)
    pq.write_table(table, f)
    got = val_loss(models["good"] / "data", [f])
    model = AutoModelForCausalLM.from_pretrained(str(models["good"] / "data")).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist(), strict=True):
            for s, e in ((0, 20), (20, 38)):  # the two documents, each on its own
                lab = torch.tensor(labels[s:e])[None]
                n = int((lab[0, 1:] != IGNORE_INDEX).sum())
                out = model(input_ids=torch.tensor(ids[s:e])[None], labels=lab)  # HF shifts and means
                total += float(out.loss) * n
                count += n
    assert got.target_tokens == count == 3 * (10 + 9)
    assert got.documents == 6 and got.rows == 3
    assert math.isclose(got.loss, total / count, rel_tol=1e-5)


def test_decision_rule():
    assert decide(2.0, None, 0.0, False)[0]
    assert decide(2.05, 2.0, 0.1, False)[0]
    ok, why = decide(2.2, 2.0, 0.1, False)
    assert not ok and "release.promote_tolerance=0.1" in why
    assert decide(2.2, 2.0, 0.1, True)[0]


def test_worse_model_stays_out_forced_one_goes_in_older_never_back(models, store_root, tmp_path):
    root, storage = store_root
    models_uri = uris.join(root, "models")
    val = _val_artifact(tmp_path, root, storage)
    good = _model_artifact(models["good"], root, "r-good", storage)
    bad = _model_artifact(models["bad"], root, "r-bad", storage)
    late = _model_artifact(models["good"], root, "r-late", storage)
    gate = ReleaseSection(promote_tolerance=0.05)

    first = promote(good, val, models_uri, _key(1), gate, storage)
    assert first.promoted and first.current_val_loss is None and read_pointer(models_uri, storage).target == good

    worse = promote(bad, val, models_uri, _key(2), gate, storage)
    assert not worse.promoted and "worse than the current LATEST" in worse.reason
    assert worse.candidate_val_loss > worse.current_val_loss + gate.promote_tolerance
    assert math.isclose(worse.current_val_loss, first.candidate_val_loss, rel_tol=1e-6)  # same rows, same number
    assert read_pointer(models_uri, storage).target == good == read_latest(models_uri, storage)

    forced = promote(bad, val, models_uri, _key(3), ReleaseSection(force_promote=True), storage)
    assert forced.promoted and forced.forced and read_pointer(models_uri, storage).target == bad

    # an older run (day 0) finishing last, even with a better model, never moves LATEST back
    older = promote(late, val, models_uri, _key(0), gate, storage)
    assert not older.promoted and "only moves forward" in older.reason
    assert read_pointer(models_uri, storage).target == bad == read_latest(models_uri, storage)


def test_same_size_corrupt_weights_never_move_latest(models, store_root, tmp_path):
    root, storage = store_root
    models_uri = uris.join(root, "models")
    val = _val_artifact(tmp_path, root, storage)
    uri = _model_artifact(models["good"], root, "r-corrupt", storage)
    from pipeline_core.artifacts import read_manifest

    # the file under the payload prefix its manifest names (one writer per artifact)
    key = "runs/r-corrupt/model/" + read_manifest(uri, storage).object_path("data/model.safetensors")
    if root.startswith("file://"):
        path = uris.to_local_path(uris.join(root, key))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    else:  # overwrite the object behind the store's back, same size
        from pipeline_core.store import s3_client

        bucket = uris.split_bucket_key(root)[0]
        client = s3_client(storage)[0]
        body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[-1] ^= 0xFF
        client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(CorruptArtifact, match="model.safetensors"):
        promote(uri, val, models_uri, _key(1), ReleaseSection(force_promote=True), storage)
    assert read_pointer(models_uri, storage) is None and read_latest(models_uri, storage) is None


def test_a_latest_that_cannot_be_scored_blocks_promotion_unless_forced(models, local_store_uri, tmp_path):
    from training.tiny import make_tiny_model

    root, models_uri = local_store_uri, uris.join(local_store_uri, "models")
    val = _val_artifact(tmp_path, root, None)
    small = make_tiny_model(tmp_path / "small" / "data", max_shard_size=None, vocab_size=1000)  # ids < 32000 fail
    other = _model_artifact(small.parent, root, "r-other-vocab", None)
    good = _model_artifact(models["good"], root, "r-good", None)
    advance(models_uri, other, _key(1))  # published earlier, for a dataset of another tokenizer
    blocked = promote(good, val, models_uri, _key(2), ReleaseSection())
    assert not blocked.promoted and "cannot be scored" in blocked.reason and read_pointer(models_uri).target == other
    forced = promote(good, val, models_uri, _key(3), ReleaseSection(force_promote=True))
    assert forced.promoted and read_pointer(models_uri).target == good
