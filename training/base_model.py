"""`train.base_model` given as a committed model artifact in the store (`runs/<run>/model`, what
`base_model: latest` resolves to through `models/LATEST`): fetched, verified against its manifest,
into a per-manifest cache directory, then loaded as any Hugging Face model directory.
"""

from __future__ import annotations

from pathlib import Path

from pipeline_core import uris
from pipeline_core.artifacts import ArtifactError, fetch_artifact, read_manifest, require_manifest
from pipeline_core.config import StorageSection

MODEL_FILES = "data/"  # a model artifact's payload: a Hugging Face model directory
CONFIG_FILE = MODEL_FILES + "config.json"


def _store_model(base_model: str, storage: StorageSection | None):
    if uris.scheme_of(base_model) not in ("file", "s3"):
        return None
    m = read_manifest(base_model, storage)
    return m if m is not None and m.kind == "model" else None


def fetch(base_model: str, storage: StorageSection | None, cache: Path, config_only: bool = False) -> Path | None:
    """The local model directory of a store model artifact (None: `base_model` is not one)."""
    m = _store_model(base_model, storage)
    if m is None:
        return None
    dest = cache / m.sha256[:16]
    fetch_artifact(base_model, dest, storage, prefix=CONFIG_FILE if config_only else MODEL_FILES)
    return dest / "data"


def fetch_model(uri: str, dest: Path, storage: StorageSection | None) -> Path:
    """A committed model artifact's model directory under `dest`, every file sha256-checked against
    the manifest (promotion and benchmark scoring; raises before anything loads)."""
    manifest = require_manifest(uri, storage, kind="model")
    fetch_artifact(uri, dest, storage)
    if not manifest.file_paths(MODEL_FILES):
        raise ArtifactError(f"{uri}: the model artifact has no {MODEL_FILES} files")
    return dest / MODEL_FILES
