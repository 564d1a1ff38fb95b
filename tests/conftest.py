"""Shared fixtures: a real S3 server on loopback (moto's server mode), local stores, env hygiene."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline_core import uris
from pipeline_core.config import StorageSection

REPO = Path(__file__).resolve().parents[1]

# Deterministic, offline, CPU-only defaults for every test process (and the subprocesses they start).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
# torch builds DeepSpeed's CPU ops with the first `ninja` on PATH; two ninja versions (the venv's
# 1.13 and /usr/bin's 1.11) hash commands differently and rebuild the shared op (~2 min) on every
# switch. Always the venv's, whether or not it is activated.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: without one they are skipped with the reason (never
    deselected), so the default run still collects and reports them; `pytest -m gpu` on the device runs them."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="marker gpu: needs a CUDA device (run `pytest -m gpu` on the device)")
        for item in gpu:
            item.add_marker(skip)


def free_port() -> int:
    """A port that was free a moment ago: racy (another process may take it before the caller binds).
    Only for servers that cannot bind port 0 themselves and report it; prefer binding port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """A moto S3 server on 127.0.0.1 and the settings to reach it.

    Credentials are never put into the session's environment: a test that uses `s3_server` gets
    them for its own duration (the autouse `_s3_credentials`), subprocesses get `env`, and a
    fixture of wider scope wraps its S3 calls in `with s3_server.credentials():`. So a local-store
    test behaves the same whether or not an S3 test ran before it."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.storage = StorageSection(endpoint_url=endpoint, max_attempts=3)
        self.env = {**S3_CREDENTIALS, "MFT__STORAGE__ENDPOINT_URL": endpoint}

    @contextlib.contextmanager
    def credentials(self) -> Iterator[None]:
        """The server's credentials in os.environ for the block, restored after it."""
        with pytest.MonkeyPatch.context() as mp:
            for k, v in S3_CREDENTIALS.items():
                mp.setenv(k, v)
            yield

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )

    def new_bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server():
    """moto's real S3 server (HTTP on loopback), shared by the session; one bucket per test via `s3_bucket_uri`."""
    from moto.server import ThreadedMotoServer

    # port 0: the server binds a free port itself and reports it (no window for another process)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _s3_credentials(request, monkeypatch):
    """The moto server's credentials for exactly the tests that use it (see `S3Server`)."""
    if "s3_server" in request.fixturenames:
        for k, v in S3_CREDENTIALS.items():
            monkeypatch.setenv(k, v)


@pytest.fixture
def s3_bucket_uri(s3_server) -> str:
    return f"s3://{s3_server.new_bucket()}"


@pytest.fixture
def local_store_uri(tmp_path) -> str:
    root = tmp_path / "store"
    root.mkdir()
    return uris.qualify(root)


@pytest.fixture(params=["local", "s3"])
def store_root(request, tmp_path, monkeypatch):
    """(root URI, StorageSection) for each backend: the contract suite runs against both."""
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()
        return uris.qualify(root), StorageSection()
    server = request.getfixturevalue("s3_server")
    for k, v in S3_CREDENTIALS.items():  # requested dynamically: `_s3_credentials` could not see it
        monkeypatch.setenv(k, v)
    return f"s3://{server.new_bucket()}", server.storage


def checkpoint_run(s3_server, tmp_path: Path) -> dict:
    """A run prefix on the S3 server with a committed input artifact (the checkpoint tests' setting)."""
    from pipeline_core.artifacts import publish_artifact

    store = f"s3://{s3_server.new_bucket()}"
    inp = tmp_path / "input"
    (inp / "data" / "train").mkdir(parents=True)
    (inp / "data" / "train" / "part-0.parquet").write_bytes(b"tokens")
    input_uri = uris.join(store, "datasets/v/train/abc")
    publish_artifact(inp, input_uri, kind="train-ready", storage=s3_server.storage)
    return {"run": uris.join(store, "runs", "r1"), "input": input_uri, "storage": s3_server.storage,
            "staging": tmp_path / "staging" / "runs" / "r1"}


# One Spark JVM for every Spark test module (a start costs ~10 s of a 2-core CI machine each).
SPARK_TEST_SETTINGS = {"spark.ui.enabled": "false", "spark.sql.execution.arrow.maxRecordsPerBatch": "512"}


@pytest.fixture(scope="session")
def _spark_jvm() -> Iterator[None]:
    """Stops whichever session is active when the test session ends (py4j logs errors if the
    gateway is only collected at interpreter exit)."""
    yield
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


@pytest.fixture(scope="module")
def spark(request, _spark_jvm):
    """The shared local[2] SparkSession. A module's `SPARK_CONF` (runtime SQL settings) applies to
    that module only: every setting the module or a stage under test changed is put back after it,
    and its cached frames are dropped, so modules cannot see each other's state. A stage that owns
    its session stops it; the next module then gets a fresh one (getOrCreate)."""
    from spark_jobs.common import spark_session

    s = spark_session("tests", "local[2]", 2, SPARK_TEST_SETTINGS)
    before = dict(s.conf.getAll)
    for k, v in getattr(request.module, "SPARK_CONF", {}).items():
        s.conf.set(k, v)
    yield s
    if s.sparkContext._jsc is None:  # stopped under the module
        return
    s.catalog.clearCache()
    after = dict(s.conf.getAll)
    for k in after.keys() - before.keys():
        s.conf.unset(k)
    for k, v in before.items():
        if after.get(k) != v and s.conf.isModifiable(k):
            s.conf.set(k, v)
