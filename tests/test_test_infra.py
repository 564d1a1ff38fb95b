"""The test suite's own machinery: no hidden waits, no ports picked then lost, no environment
carried from one test to the next."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from urllib.parse import urlsplit

import pytest

from tests.conftest import REPO, S3_CREDENTIALS
from tests.proc_helpers import lines_within


def test_lines_within_gives_up_on_a_silent_child():
    # prints one line, then says nothing for a long time: the deadline must still fire
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    seen = []
    try:
        with pytest.raises(TimeoutError):
            for line in lines_within(proc, timeout_s=3):
                seen.append(line.strip())
        # the child sleeps 60 s: still running means the reader kept its own deadline, not the child's
        assert proc.poll() is None, "the reader waited for the child instead of its own deadline"
    finally:
        proc.kill()
        proc.wait()
    assert seen == ["hello"]


def test_lines_within_ends_at_eof():
    proc = subprocess.Popen([sys.executable, "-c", "print('a'); print('b')"], stdout=subprocess.PIPE, text=True)
    assert [x.strip() for x in lines_within(proc, timeout_s=60)] == ["a", "b"]
    proc.wait()


def test_s3_server_binds_its_own_port_and_answers(s3_server):
    port = urlsplit(s3_server.endpoint).port
    assert port and port != 0
    bucket = s3_server.new_bucket()
    assert bucket in [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]


# Two tests in one session, S3 first: the local one must see the environment it would see alone.
def test_an_s3_test_leaves_no_credentials_behind(tmp_path):
    probe = tmp_path / "test_order_probe.py"
    probe.write_text(textwrap.dedent(f'''
        import os

        KEYS = {sorted(S3_CREDENTIALS)!r}
        BEFORE = {{k: os.environ.get(k) for k in KEYS}}


        def test_a_s3(s3_server, s3_bucket_uri):
            assert all(os.environ[k] == v for k, v in {S3_CREDENTIALS!r}.items())
            s3_server.client().head_bucket(Bucket=s3_bucket_uri.removeprefix("s3://"))


        def test_b_local(local_store_uri):
            assert {{k: os.environ.get(k) for k in KEYS}} == BEFORE, "an earlier S3 test leaked its credentials"
    '''))
    env = {k: v for k, v in os.environ.items() if k not in S3_CREDENTIALS and not k.startswith("PYTEST_")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(probe)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout, out.stdout[-2000:]


# Two modules on the one shared Spark session: the second sees none of the first's settings.
def test_a_spark_module_leaves_no_settings_behind(tmp_path):
    (tmp_path / "test_spark_a.py").write_text(textwrap.dedent('''
        SPARK_CONF = {"spark.sql.shuffle.partitions": "7"}


        def test_a(spark):
            assert spark.conf.get("spark.sql.shuffle.partitions") == "7"
            spark.conf.set("spark.sql.adaptive.enabled", "false")  # as a stage under test might
            spark.conf.set("spark.mft.probe", "1")
            spark.range(10).cache().count()
    '''))
    (tmp_path / "test_spark_b.py").write_text(textwrap.dedent('''
        def test_b(spark):
            assert spark.conf.get("spark.sql.shuffle.partitions") == "2"
            assert spark.conf.get("spark.sql.adaptive.enabled") == "true"
            assert spark.conf.get("spark.mft.probe", None) is None
            assert spark.sparkContext._jsc.sc().getPersistentRDDs().size() == 0, "a cached frame survived"
    '''))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_spark_a.py"),
                          str(tmp_path / "test_spark_b.py")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout, out.stdout[-2000:]


# The `gpu` marker: registered (the run uses --strict-markers), and without a CUDA device its tests are
# skipped with the reason, not failed and not deselected; `-m gpu` selects only them.
def test_gpu_tests_skip_cleanly_without_a_cuda_device(tmp_path):
    probe = tmp_path / "test_gpu_probe.py"
    probe.write_text(textwrap.dedent('''
        import pytest


        @pytest.mark.gpu
        def test_on_the_device():
            raise AssertionError("ran without a CUDA device")


        def test_anywhere():
            pass
    '''))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "CUDA_VISIBLE_DEVICES": ""}
    runs = {}
    for select in ((), ("-m", "gpu")):
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-c", str(REPO / "pyproject.toml"),
                              "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                              *select, str(probe)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        runs[select] = out.stdout
    assert "1 passed, 1 skipped" in runs[()] and "marker gpu: needs a CUDA device" in runs[()], runs[()][-2000:]
    assert "1 skipped, 1 deselected" in runs[("-m", "gpu")], runs[("-m", "gpu")][-2000:]
