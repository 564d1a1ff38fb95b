"""The image's Python set is closed and consistent without building the image:
deploy/check-image-lock.sh has uv resolve requirements/lock.txt (as the Dockerfile filters it),
lock-cuda.txt, torch's CUDA build and DeepSpeed's requirements for linux x86_64 and the image's
CPython, and must fail when the `--no-deps` installs would miss or change a package.
Needs PyPI (metadata only, ~30 s per resolve); CI reaches it (it installs the venv from there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests._deploy_support import DOCKERFILE, REPO, dockerfile_args, lock_pins, venv_bin

SCRIPT = REPO / "deploy" / "check-image-lock.sh"
LOCK = REPO / "requirements" / "lock.txt"


def check_image_lock(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UV": str(venv_bin("uv")), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(root / "deploy" / "check-image-lock.sh")], capture_output=True, text=True,
                          env=env, timeout=600)


def test_the_image_package_set_is_closed_and_consistent():
    proc = check_image_lock(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: "), proc.stdout


def test_a_lock_missing_a_dependency_is_refused(tmp_path):
    # a copy of what the script reads, with one dependency of a pinned package gone (pyarrow's
    # consumers stay): `--no-deps` would build an image that fails at import
    for rel in ("Dockerfile", "requirements/lock.txt", "requirements/lock-cuda.txt", "deploy/check-image-lock.sh"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, tmp_path / rel)
    lock = tmp_path / "requirements" / "lock.txt"
    lines = lock.read_text().splitlines()
    kept = [line for line in lines if not line.lower().startswith("pyarrow==")]
    assert len(kept) == len(lines) - 1
    lock.write_text("\n".join(kept) + "\n")
    proc = check_image_lock(tmp_path)
    assert proc.returncode != 0
    assert "image set not closed" in proc.stderr and "pyarrow" in proc.stderr, proc.stdout + proc.stderr


def test_the_image_installer_is_the_locked_uv():
    # one uv version: the Dockerfile's installer and the one that checks the image's set
    assert dockerfile_args()["UV_VERSION"] == lock_pins(LOCK)["uv"], DOCKERFILE
