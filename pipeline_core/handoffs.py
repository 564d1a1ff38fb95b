"""Typed hand-offs between stages: what one stage's manifest promises the next.

The filter stage writes `TrainReadyInfo` into the train-ready manifest's `extra`; the trainer, the
data report and the Airflow summary read it back with `TrainReadyInfo.from_manifest`, never by
string keys of their own. A field added here is a contract change: bump nothing, but give it a
default so manifests committed before it still read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from pipeline_core.artifacts import Manifest


class _Handoff(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TokenizerSpec(_Handoff):
    """The tokenizer and chat format a train-ready artifact was rendered with.

    The trainer refuses a base model whose vocabulary disagrees (size, special ids) before any
    weights load, and the exported model carries `chat_template` so `apply_chat_template`, vLLM
    and TGI reproduce the training format.
    """

    name: str = Field(description="filter.tokenizer as configured: 'mistral-v1', 'mistral-v3', or an HF path/id")
    vocab_size: int = Field(ge=1)
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    chat_template: str | None = Field(None, description="Jinja chat template equivalent to the rendering used")


class TrainReadyInfo(_Handoff):
    """What the filter stage promises about a train-ready artifact (manifest `extra`)."""

    seq_len: int = Field(ge=1)
    tokenizer: TokenizerSpec
    tokens: dict[str, int] = Field(default_factory=dict, description="tokens per split (train/val)")
    target_tokens: dict[str, int] = Field(default_factory=dict, description="loss-bearing tokens per split")
    documents: dict[str, int] = Field(default_factory=dict, description="packed documents per split")
    sequences: dict[str, int] = Field(default_factory=dict, description="packed rows per split")
    packing_efficiency: float | None = None
    train_on: str | None = None
    prompt_context: str | None = None
    objective: str = Field("sft", description="sft: packed documents; dpo: one pair per row (chosen, rejected)")

    def to_extra(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> TrainReadyInfo:
        return cls.model_validate(manifest.extra or {})
