"""Hooks: how the operators talk to the pipeline's object store and to a local trainer.

`ArtifactStoreHook` reads committed artifacts (manifests) through `pipeline_core` with a run's
storage settings, so no operator opens the store itself. `LocalTrainHook` runs the training agent
on the worker under the watchdog (`launchers.LocalTrainProcess`). Docker and Kubernetes trainers
go through the providers' own hooks, inside the operators that subclass theirs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.hook import BaseHook

if TYPE_CHECKING:
    from pipeline_core.artifacts import Manifest
    from pipeline_core.config import StorageSection


class ArtifactStoreHook(BaseHook):
    """Committed artifacts in the store a run's config names (file://, s3://)."""

    hook_name = "Pipeline artifact store"

    def __init__(self, storage: StorageSection | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.storage = storage

    def manifest(self, uri: str) -> Manifest | None:
        """The artifact's manifest if it is committed, else None."""
        from pipeline_core.artifacts import read_manifest

        return read_manifest(uri, self.storage)


class LocalTrainHook(BaseHook):
    """A training agent on this worker; `stop` ends its whole process tree."""

    hook_name = "Local torchrun"

    def __init__(self, command: list[str], env: dict[str, str], cwd: str, **kwargs: Any):
        super().__init__(**kwargs)
        from plugins.mft_airflow.launchers import LocalTrainProcess

        self.process = LocalTrainProcess(command, env, cwd, self.log)

    def run(self) -> None:
        self.process.execute()

    def stop(self) -> None:
        self.process.on_kill()
