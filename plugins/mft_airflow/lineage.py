"""OpenLineage for the custom operators: inputs and outputs from the plan's URIs.

Each operator's `get_openlineage_facets_on_complete` returns `lineage(...)`; the OpenLineage
provider's listener sends it with the run's events (console, file, HTTP: whatever transport the
deployment configures; nothing is sent when it configures none). Dataset names follow the
OpenLineage naming spec: `s3://bucket` + key, `file` + absolute path, `hdfs://host` + path; hub
sources `huggingface` + repo id. The provider is imported only here, at the end of a task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pipeline_core.artifacts import Manifest


def dataset_id(uri: str) -> tuple[str, str]:
    """(namespace, name) of a URI under the OpenLineage naming convention."""
    parts = urlsplit(uri)
    if parts.scheme == "file":
        return "file", parts.path.rstrip("/") or "/"
    if parts.scheme == "hf":
        return "huggingface", f"{parts.netloc}{parts.path}".removeprefix("datasets/")
    return f"{parts.scheme}://{parts.netloc}", parts.path.strip("/") or "/"


def lineage(inputs: list[str], outputs: list[tuple[str, Manifest | None]]) -> Any:
    """An `OperatorLineage`: the input URIs, and each output URI with its committed manifest's row
    count and bytes as output statistics."""
    from airflow.providers.common.compat.openlineage.facet import (
        InputDataset,
        OutputDataset,
        OutputStatisticsOutputDatasetFacet,
    )
    from airflow.providers.openlineage.extractors import OperatorLineage

    from pipeline_core.handoffs import FileEntry, StageCounts

    outs = []
    for uri, manifest in outputs:
        facets = {}
        if manifest is not None:
            counts, files = StageCounts.of(manifest), FileEntry.all_of(manifest)
            facets["outputStatistics"] = OutputStatisticsOutputDatasetFacet(
                rowCount=counts.rows_out if counts else None, size=sum(f.size for f in files), fileCount=len(files))
        outs.append(OutputDataset(*dataset_id(uri), outputFacets=facets))
    return OperatorLineage(inputs=[InputDataset(*dataset_id(u)) for u in inputs], outputs=outs)
