"""The image's Dockerfile: linted by the real hadolint, pinned, and consistent with the locks,
the repository and the compose stack. No Docker engine here, so nothing is built; what can be
run (the image's own offline-model check) runs against the same pinned packages locally."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache

import pytest

from tests._deploy_support import (
    DOCKERFILE,
    REPO,
    compose_model,
    dockerfile_args,
    dockerfile_instructions,
    final_stage_env,
    lock_pins,
    substitute,
    venv_bin,
)

HADOLINT_CONFIG = REPO / ".hadolint.yaml"


def hadolint(dockerfile_text: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(venv_bin("hadolint")), "--config", str(HADOLINT_CONFIG), "--format", "json"]
    if dockerfile_text is None:
        return subprocess.run(cmd + [str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    return subprocess.run(cmd + ["-"], input=dockerfile_text, capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing():
    proc = hadolint()
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode == 0 and findings == [], "\n".join(
        f"line {f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    ) or proc.stderr


def test_hadolint_config_is_strict():
    # Same config on a bad Dockerfile: warnings fail, untrusted registries are errors.
    proc = hadolint("FROM quay.io/someone/thing:latest\nRUN cd /tmp && apt-get install curl\n")
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert proc.returncode != 0
    assert {"DL3007", "DL3026", "DL3003"} <= codes, codes


def test_base_images_pinned_by_exact_tag():
    args = dockerfile_args()
    stages, images = set(), []
    for instr, rest in dockerfile_instructions():
        if instr == "FROM":
            parts = substitute(rest, args).split()
            image = [p for p in parts if not p.startswith("--")][0]
            if image not in stages:
                images.append(image)
            if " AS " in rest.upper():
                stages.add(parts[-1])
    assert images, "no FROM in the Dockerfile"
    for image in images:
        assert "$" not in image, f"unresolved ARG in FROM {image}"
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image}: pin an exact tag"


def test_torch_variant_matches_the_cuda_lock():
    """No CUDA base image: torch's CUDA wheels bring the CUDA runtime. The default variant (cu130),
    its PyTorch index, and the CUDA libraries in lock-cuda.txt must be the same CUDA major.minor,
    and torch the same release as the CPU lock."""
    args = dockerfile_args()
    variant = args["TORCH_VARIANT"]
    assert re.fullmatch(r"cu\d{3}", variant), variant
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"
    cuda_mm = f"{variant[2:4]}.{variant[4]}"
    cuda_lock = lock_pins(REPO / "requirements" / "lock-cuda.txt")
    assert cuda_lock["nvidia-cuda-runtime"].startswith(cuda_mm + "."), (variant, cuda_lock["nvidia-cuda-runtime"])
    cpu_torch = lock_pins(REPO / "requirements" / "lock.txt")["torch"]
    assert cpu_torch.split("+")[0] == args["TORCH_VERSION"]
    run = " ".join(rest for instr, rest in dockerfile_instructions() if instr == "RUN")
    assert args["TORCH_LOCAL_VERSION"] == "+${TORCH_VARIANT}"
    assert '"torch==${TORCH_VERSION}${TORCH_LOCAL_VERSION}"' in run


def test_cuda_lock_is_hashed_and_disjoint_from_main_lock():
    text = (REPO / "requirements" / "lock-cuda.txt").read_text()
    entries = re.findall(r"^([A-Za-z0-9_.\-]+==\S+)\s*\\\s*\n\s*--hash=sha256:([0-9a-f]{64})$", text, re.M)
    pins = lock_pins(REPO / "requirements" / "lock-cuda.txt")
    assert len(entries) == len(pins) > 10, "every lock-cuda.txt entry needs exactly one sha256"
    overlap = set(pins) & set(lock_pins(REPO / "requirements" / "lock.txt"))
    assert not overlap, f"pinned twice (lock.txt and lock-cuda.txt): {overlap}"
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton", "setuptools"} <= set(pins)


def test_image_install_excludes_only_locked_names():
    # The Dockerfile filters some names out of lock.txt; a typo would silently install them.
    run = " ".join(rest for instr, rest in dockerfile_instructions() if instr == "RUN")
    excluded = re.search(r"grep -v -E '\^\(#\|([^)]*)\)'", run)
    assert excluded, "lock filter not found in the Dockerfile"
    names = [n.rstrip("=") for n in excluded.group(1).split("|")]
    pins = lock_pins(REPO / "requirements" / "lock.txt")
    assert names and all(n in pins for n in names), (names, "not all in lock.txt")


@cache
def _build_context() -> frozenset[str]:
    """The files `docker build` sends for this repository: docker-py's own .dockerignore matcher
    (the Go engine's rules: `**`, negation, last match wins), not a re-implementation."""
    from docker.utils.build import exclude_paths

    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    return frozenset(exclude_paths(str(REPO), patterns))


def _dockerignore_allows(path: str) -> bool:
    context = _build_context()
    return path in context or any(p.startswith(path + "/") for p in context)


def test_copied_sources_exist_and_are_in_build_context():
    copies = []
    for instr, rest in dockerfile_instructions():
        if instr == "COPY" and "--from=" not in rest:
            parts = [p for p in rest.split() if not p.startswith("--")]
            copies += parts[:-1]
    assert copies
    missing = [c for c in copies if not (REPO / c).exists()]
    assert not missing, f"COPY sources missing from the repository: {missing}"
    ignored = [c for c in copies if not _dockerignore_allows(c.rstrip("/"))]
    assert not ignored, f".dockerignore keeps these out of the build context: {ignored}"
    # the context is what the Dockerfile copies, nothing else (.env, .venv, .store, caches, bytecode)
    sources = [c.rstrip("/") for c in copies]
    extra = sorted(p for p in _build_context() if p not in (".dockerignore", "Dockerfile")
                   and not any(p == c or p.startswith(c + "/") for c in sources))
    assert not extra, f"sent to the Docker daemon but never copied: {extra[:10]}"
    assert not [p for p in _build_context() if "__pycache__" in p or p.endswith(".pyc")]


def test_runtime_stage_user_env_and_volumes():
    instructions = dockerfile_instructions()
    users = [rest for instr, rest in instructions if instr == "USER"]
    user = substitute(users[-1], dockerfile_args()) if users else "root"
    assert user not in ("root", "0") and not user.startswith("0:"), f"final USER is {user}"
    env = final_stage_env()
    for key in ("JAVA_HOME", "SPARK_HOME", "HF_HOME", "AIRFLOW_HOME", "TORCH_EXTENSIONS_DIR"):
        assert env.get(key, "").startswith("/"), f"{key} not set in the runtime stage"
    assert env["JAVA_HOME"].startswith("/usr/lib/jvm/java-17-")
    py_mm = ".".join(dockerfile_args()["PYTHON_VERSION"].split(".")[:2])
    assert env["SPARK_HOME"] == f"/opt/venv/lib/python{py_mm}/site-packages/pyspark"
    # caches must land on a volume the containers share, not in the container layer
    mounts = {v["target"] for s in compose_model()["services"].values() if "build" in s
              for v in s.get("volumes", []) if v["type"] == "volume"}
    for key in ("HF_HOME", "TORCH_EXTENSIONS_DIR"):
        assert any(env[key] == m or env[key].startswith(m + "/") for m in mounts), (key, env[key], mounts)


def test_image_offline_model_check_passes_with_the_pinned_packages():
    """Run the Dockerfile's own build-time check (offline MiniLM + Mistral tokenizer) here."""
    run = [rest for instr, rest in dockerfile_instructions() if instr == "RUN" and "HF_HUB_OFFLINE=1 python -c" in rest]
    assert len(run) == 1, "the image's offline model check is missing"
    code = re.search(r'python -c "(.*?)"\s*&&', run[0]).group(1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("stage", ["build", "runtime"])
def test_named_stages_exist(stage):
    assert any(instr == "FROM" and rest.split()[-1] == stage for instr, rest in dockerfile_instructions())
    assert compose_model()["services"]["trainer"]["build"]["target"] == "runtime"


def test_gpu_optimizer_needs_no_jit_build():
    """The image has no CUDA compiler (no devel base, DeepSpeed installed with DS_BUILD_OPS=0), so the
    trainer's optimizer must not be an op DeepSpeed JIT-compiles (FusedAdam): ds_config's `optimizer`
    section only carries hyper-parameters, the trainer builds torch's AdamW (fused on GPUs) itself
    and hands DeepSpeed a config without `optimizer` (training/optim.py, training/engine.build_engine)."""
    import torch

    from training.optim import build_optimizer

    ds = json.loads((REPO / "training" / "ds_config.json").read_text())
    opt = build_optimizer(torch.nn.Linear(4, 4), ds, torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW) and not type(opt).__module__.startswith("deepspeed"), type(opt)
    src = (REPO / "training" / "engine.py").read_text()  # the one engine builder (issue 33)
    assert 'if k != "optimizer"}' in src and "optimizer=optimizer" in src  # the client-optimizer path
    run = " ".join(rest for instr, rest in dockerfile_instructions() if instr == "RUN")
    assert "DS_BUILD_OPS=0" in run and "nvcc" not in run
