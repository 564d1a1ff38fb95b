"""The GPU variant of the image (TORCH_VARIANT=cu130, `make image-cuda-test`, which builds it and
sets MFT_TEST_CUDA_IMAGE), run on a host without a GPU: torch is the CUDA 13.0 build and imports,
its CUDA runtime, cuDNN and NCCL libraries (from the hash-pinned wheels of lock-cuda.txt, no CUDA
base image) load, no GPU is seen, and the project's entry points import next to it. A GPU host
runs the trainer itself (bench/, docs/training.md). Skipped without a built CUDA image."""

from __future__ import annotations

import json

import pytest

from tests._deploy_support import IMAGE_UID, REPO, cuda_image_under_test, lock_pins, run_in_image

pytestmark = pytest.mark.skipif(cuda_image_under_test() is None, reason="needs the CUDA image: make image-cuda-test")

PROBE = """
import json, torch, torch.backends.cudnn as cudnn
import importlib.metadata as md
out = {
    "torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
    "cudnn": cudnn.version(), "nccl": list(torch.cuda.nccl.version()),
    "cpu_matmul": float((torch.ones(2, 3) @ torch.ones(3, 2)).sum()),
    "dists": {d: md.version(d) for d in ("nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-nccl-cu13",
                                         "triton", "liger-kernel")},
}
print(json.dumps(out))
"""


def _run(argv: list[str], **kw):
    return run_in_image(argv, image=cuda_image_under_test(), timeout=300, **kw)


def test_torch_is_the_cuda_13_build_and_loads_its_libraries_without_a_gpu():
    proc = _run(["python", "-c", PROBE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch"].split("+")[0] == lock_pins(REPO / "requirements" / "lock.txt")["torch"].split("+")[0], out
    assert out["cuda"] == "13.0", out
    assert out["available"] is False, out  # no GPU here; a GPU host sees its devices
    assert out["cudnn"] and out["nccl"][0] >= 2, out  # the libraries of the wheels load
    assert out["cpu_matmul"] == 12.0
    cuda_lock = lock_pins(REPO / "requirements" / "lock-cuda.txt")
    for dist, version in out["dists"].items():
        assert cuda_lock.get(dist) == version or lock_pins(REPO / "requirements" / "lock.txt").get(dist) == version, (
            dist, version)


def test_the_entry_points_import_next_to_the_cuda_torch():
    code = ("import deepspeed, pyspark, airflow, pipeline_core.config, spark_jobs.enrich.job, "
            "spark_jobs.filter.job, training.train, training.model; print('ok')")
    proc = _run(["python", "-c", code])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_it_runs_as_the_non_root_user():
    proc = _run(["id", "-u"])
    assert proc.returncode == 0 and proc.stdout.strip() == str(IMAGE_UID), proc.stdout + proc.stderr
