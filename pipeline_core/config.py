"""One typed configuration for the whole pipeline (DESIGN.md principle 4).

Sources, later wins: the defaults below (the embedded, laptop-scale setup), a YAML/JSON file,
environment variables `MFT__<SECTION>__<FIELD>` (values parsed as YAML, so `[chat, code]` and
`1e-4` work), then explicit overrides (Airflow Params); `pipeline_core.settings_loader` merges them
(a section field by field). Validation happens at load time, before
any compute: an invalid value raises `ConfigError` naming the field and what is allowed.
Each stage gets one resolved file (`Config.dump`) and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticUndefined
from pydantic_settings import PydanticBaseSettingsSource

from pipeline_core import settings_loader, uris
from pipeline_core.settings_loader import PrefixedEnvSource, SettingsSourceError, ValuesSource

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ENV_PREFIX = "MFT__"
NEMOTRON_SPLITS = ("chat", "code", "math", "stem", "tool")  # v1's files: data/<split>-*.parquet
# v2 adds these (78% of its rows); any other `<name>` matching SPLIT_NAME is accepted too and must exist.
NEMOTRON_V2_SPLITS = ("chat", "code", "math", "stem", *(f"multilingual_{c}" for c in ("de", "es", "fr", "it", "ja")))
SPLIT_ALIASES = {"tool_calling": "tool"}  # the hub's config name for v1's data/tool-*.parquet
SPLIT_NAME = re.compile(r"^[a-z0-9][a-z0-9_]{0,63}$")
# Spark settings that make a read drop data it cannot read instead of failing
LOSSY_SPARK_SETTINGS = ("spark.sql.files.ignoreCorruptFiles", "spark.sql.files.ignoreMissingFiles")


# Self-identification as another model or lab (filter.identity_patterns), word-bounded, matched
# case-insensitively in answers and reasoning: "I am Qwen", "I'm Claude, made by Anthropic",
# "developed by Google". A model named in passing ("search on Google") does not match.
_SELF = r"\b(?:i am|i'm|my name is|i am called|call me)\s+(?:an? (?:ai |large |large language |language )?(?:model|assistant)\s+(?:called|named)\s+)?"
_MADE = r"\b(?:developed|created|trained|built|made|designed|brought to you)\s+by\s+(?:the\s+)?"
DEFAULT_IDENTITY_PATTERNS = (
    _SELF + r"(?:qwen|tongyi(?: qianwen)?)\b", _MADE + r"(?:alibaba(?: cloud)?|tongyi lab|qwen team)\b",
    _SELF + r"deepseek\b", _MADE + r"deepseek\b",
    _SELF + r"(?:chatglm|glm(?:-\d+)?)\b", _MADE + r"(?:zhipu(?: ai)?|z\.ai)\b",
    _SELF + r"(?:gemini|bard)\b", _MADE + r"google(?: deepmind)?\b",
    _SELF + r"(?:chatgpt|gpt-?\d)", _MADE + r"openai\b",
    _SELF + r"llama\b", _MADE + r"meta(?: ai)?\b",
    _SELF + r"claude\b", _MADE + r"anthropic\b",
)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names each offending field."""


Objective = Literal["sft", "dpo"]


class Role(StrEnum):
    """What a setting is, declared once on each field (`content(...)` / `execution(...)`); every
    classification elsewhere (artifact hashes, the resume contract, the trigger allowlist, the config
    reference in docs/config.md) is derived from these declarations."""

    CONTENT = "content"  # decides what is computed: hashed into artifact ids, must match on resume
    EXECUTION = "execution"  # decides only how it runs: never hashed, free to change on resume


def _setting(role: Role, default: Any, trigger: bool, kw: dict[str, Any]) -> Any:
    return Field(default, json_schema_extra={"role": role.value, "trigger": trigger}, **kw)


def content(default: Any = PydanticUndefined, *, trigger: bool = False, **kw: Any) -> Any:
    """A field that decides what a stage or run computes. `trigger=True`: a trigger may set it through
    `config_overrides` (only settings that cannot redirect I/O, credentials or code)."""
    return _setting(Role.CONTENT, default, trigger, kw)


def execution(default: Any = PydanticUndefined, *, trigger: bool = False, **kw: Any) -> Any:
    """A field that decides only how a stage or run executes (resources, timeouts, kernels, I/O)."""
    return _setting(Role.EXECUTION, default, trigger, kw)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @classmethod
    def role_of(cls, name: str) -> Role | None:
        """The field's declared role; None when it was declared without one (a test refuses that)."""
        extra = cls.model_fields[name].json_schema_extra
        return Role(extra["role"]) if isinstance(extra, dict) and "role" in extra else None

    @classmethod
    def fields_of(cls, role: Role) -> frozenset[str]:
        return frozenset(n for n in cls.model_fields if cls.role_of(n) is role)

    @classmethod
    def trigger_fields(cls) -> frozenset[str]:
        return frozenset(n for n, f in cls.model_fields.items()
                         if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("trigger") is True)

    def content_settings(self) -> dict[str, Any]:
        """The section without its execution-only fields: what artifact ids hash."""
        return self.model_dump(mode="json", exclude=set(type(self).fields_of(Role.EXECUTION)))


class PipelineSection(Section):
    """Where data comes from and where every artifact goes."""

    dataset_version: str = execution("sample", description="Version label; artifacts live under datasets/<version>/")
    source_uri: str = content(
        default_factory=lambda: uris.qualify(PROJECT_ROOT / "sample_data" / "nemotron_v1"),
        description="Raw Nemotron records: file://, s3:// URI or hf://datasets/<repo-id>",
    )
    store_uri: str = execution(
        default_factory=lambda: uris.qualify(PROJECT_ROOT / ".store"),
        description="Root of the object store (file:// directory or s3://bucket/prefix)",
    )
    run_id: str | None = execution(None, description="Training run id; runs/<run_id>/ (default: derived per run)")
    staging_uri: str = execution(
        default_factory=lambda: uris.qualify(PROJECT_ROOT / ".cache" / "staging"),
        description="Shared file system where Spark and the trainer write before publishing",
    )
    staging_ttl_s: float = execution(
        600.0, ge=5.0,
        description="A Spark stage attempt refreshes its staging heartbeat every ttl/6 s; a later attempt of the "
                    "same artifact sweeps a dead one's staging (owner process gone on this host, or no heartbeat "
                    "from another host for this long)",
    )
    max_reject_ratio: float = execution(
        0.5, ge=0.0, le=1.0,
        description="A Spark stage whose rejects exceed this share of its input fails (with counts) instead of committing",
    )

    @field_validator("dataset_version")
    @classmethod
    def _version(cls, v: str) -> str:
        return uris.safe_component(v, "dataset_version")

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        return None if v is None else uris.safe_component(v, "run_id")

    @field_validator("store_uri", "staging_uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        return uris.require_uri(v)

    @field_validator("source_uri")
    @classmethod
    def _source(cls, v: str) -> str:
        if v.startswith("hf://"):
            return v
        return uris.require_uri(v)


class StorageSection(Section):
    """S3 client settings (ignored by the local-directory backend)."""

    endpoint_url: str | None = execution(None, description="S3-compatible endpoint, e.g. http://minio:9000")
    region: str = execution("us-east-1")
    addressing_style: Literal["path", "virtual", "auto"] = execution("path")
    aws_conn_id: str | None = execution(None, description="Airflow connection holding credentials (else environment)")
    multipart_threshold_mb: int = execution(64, ge=5, le=5120)
    multipart_chunksize_mb: int = execution(16, ge=5, le=5120)
    max_concurrency: int = execution(8, ge=1, le=64)
    max_attempts: int = execution(8, ge=1, le=20, description="Attempts per request on throttling / 5xx")
    connect_timeout_s: float = execution(10, gt=0, le=300)
    read_timeout_s: float = execution(120, gt=0, le=3600)
    credentials_refresh_s: int = execution(
        900, ge=0, le=86_400, description="Rebuild S3 clients (re-reading static credentials) at least this often; 0 = never"
    )
    accept_unenforced_conditional_writes: bool = execution(
        False, description="Run on a server that ignores If-None-Match (found by a probe before the first conditional "
                           "write of each process): leases, manifests and models/LATEST lose their one-writer guarantee")


class SparkStageSection(Section):
    """Settings every Spark stage has: how it runs, not what it computes (all execution-only)."""

    spark_master: str = execution("local[*]")
    shuffle_partitions: int = execution(
        0, ge=0, le=100_000,
        description="0 = from the row count and the task slots Spark reports (spark_jobs/partitioning.py)", trigger=True)
    spark_conf: dict[str, str] = execution(default_factory=dict, description="extra Spark settings (spark.* keys)")

    @field_validator("spark_conf")
    @classmethod
    def _spark_conf(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not k.startswith("spark.")]
        if bad:
            raise ValueError(f"keys {bad} are not Spark settings (they must start with 'spark.')")
        return {k: str(x) for k, x in v.items()}

    @model_validator(mode="after")
    def _lossy_reads(self) -> SparkStageSection:
        # Spark then drops the rest of a file it cannot read without a word (issue 26.9b)
        lossy = [k for k in LOSSY_SPARK_SETTINGS if str(self.spark_conf.get(k, "false")).strip().lower() == "true"]
        if lossy and not getattr(self, "accept_corrupt_file_loss", False):
            accept = ("set enrich.accept_corrupt_file_loss to accept the loss (the manifest records the rows lost "
                      "per file)" if "accept_corrupt_file_loss" in type(self).model_fields else
                      "only the enrich stage (reading raw input) may accept that, with enrich.accept_corrupt_file_loss")
            raise ValueError(f"spark_conf {lossy}=true skips unreadable input files and their rows silently; {accept}")
        return self


class EnrichSection(SparkStageSection):
    """Spark enrichment: normalisation, sentences, embeddings, similarities."""

    accept_corrupt_file_loss: bool = execution(
        False, description="Deployment only: allow spark.sql.files.ignoreCorruptFiles; rows Spark skips are then "
                           "counted per input file against the file's own count and recorded in the manifest "
                           "(rejected.corrupt_input_file) instead of failing the stage")

    splits: list[str] = content(default_factory=lambda: list(NEMOTRON_SPLITS), trigger=True)
    input_format: Literal["auto", "parquet", "jsonl"] = content("auto", trigger=True)
    # --- preference optimisation (docs/dpo.md): the same value in enrich, filter and train
    objective: Objective = content(
        "sft", description="sft: Nemotron conversations; dpo: preference records ({prompt|messages, chosen, "
        "rejected} or HelpSteer3's context/response1/response2/overall_preference)")
    reasoning: Literal["separate", "drop", "inline"] = content(
        "separate", description="<think> trace: kept apart in reasoning_trace, dropped, or left in the answer", trigger=True
    )
    embedding_model: str = content("all-MiniLM-L6-v2", description="sentence-transformers model path or id")
    embedding_batch_size: int = execution(64, ge=1, le=16_384, description="max texts per forward pass")
    embedding_device: str = execution(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="auto: the GPU Spark assigned to the task, else CUDA when present, else CPU")
    embedding_precision: Literal["auto", "fp32", "fp16", "bf16"] = content(
        "auto", description="auto = fp16 on a GPU, fp32 on a CPU (fp16/bf16 refused on a CPU)")
    embedding_batch_tokens: int = execution(0, ge=0, le=4_194_304,
                                        description="padded tokens per forward; 0 = 8192 on CPU, 131072 on GPU")
    embedding_long_text: Literal["truncate", "chunk_mean"] = content(
        "chunk_mean", description="texts over the model window: first window only, or mean of window-sized chunks")
    embedding_max_chunks: int = content(8, ge=1, le=256, description="chunk_mean: at most this many windows per text")
    embedding_tokenizer_threads: int = execution(0, ge=0, le=256, description="tokenizer threads per task; 0 = spark.task.cpus")
    max_context_sentences: int = content(256, ge=1, le=100_000, trigger=True)
    max_sentence_chars: int = content(2000, ge=16, le=100_000, trigger=True)
    top_k: int = content(5, ge=1, le=1000, trigger=True)
    relevance_threshold: float = content(0.2, ge=-1.0, le=1.0, trigger=True)
    question_weight: float = content(0.5, ge=0.0, le=1.0, trigger=True)
    answer_weight: float = content(0.5, ge=0.0, le=1.0, trigger=True)
    embedding_threads: int = execution(0, ge=0, le=256, description="torch threads per Spark task; 0 = spark.task.cpus")
    arrow_batch_rows: int = execution(512, ge=1, le=100_000, description="records per Arrow batch into the UDFs")
    # -- the Nemotron family (issue 28; docs/data-sources.md)
    prompt_sources: dict[str, str] = content(
        default_factory=dict,
        description="seed dataset hub id -> URI of the user's copy (file://, s3://, hdfs://, hf://datasets/<id>), "
        "e.g. {'allenai/WildChat-1M': 's3://bucket/seeds/wildchat'}: withheld prompts are re-joined from it")

    @field_validator("prompt_sources")
    @classmethod
    def _prompt_sources(cls, v: dict[str, str]) -> dict[str, str]:
        out = {}
        for hub_id, uri in v.items():
            parts = hub_id.split("/")
            if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", p) for p in parts):
                raise ValueError(f"key {hub_id!r} is not a hub dataset id <owner>/<name> (e.g. allenai/WildChat-1M)")
            out[hub_id] = uri if uri.startswith("hf://datasets/") else uris.require_uri(uri, f"prompt_sources[{hub_id!r}]")
        return out

    @field_validator("splits")
    @classmethod
    def _splits(cls, v: list[str]) -> list[str]:
        bad = [s for s in v if not SPLIT_NAME.match(s)]
        if bad or not v:
            raise ValueError(
                f"invalid split name(s) {bad}; give a non-empty list of file prefixes (data/<name>-*.parquet), "
                f"lower case letters, digits and '_', e.g. v1 {list(NEMOTRON_SPLITS)} or v2 {list(NEMOTRON_V2_SPLITS)}"
            )
        out = list(dict.fromkeys(SPLIT_ALIASES.get(s, s) for s in v))
        return out

    @model_validator(mode="after")
    def _weights(self) -> EnrichSection:
        if self.question_weight + self.answer_weight <= 0:
            raise ValueError("question_weight + answer_weight must be > 0")
        return self


EVAL_TEXT_FIELDS = ("question", "prompt", "problem", "input")
EVAL_ANSWER_FIELDS = ("answer", "solution", "output", "target")


class EvalSetSpec(Section):
    """One evaluation set the filter decontaminates against (spark_jobs/filter/decontaminate.py): a JSONL or
    Parquet file, or a directory of them, whose text fields are matched against training prompts."""

    uri: str = Field(description="file:// or s3:// URI of a .jsonl/.json/.parquet file or a directory of them")
    name: str | None = Field(None, description="Name in rejects, manifest and report (default: the file's stem)")
    fields: list[str] = Field(default_factory=lambda: list(EVAL_TEXT_FIELDS),
                              description="Text fields of an eval document (those present are used; one must be)")
    answer_fields: list[str] = Field(default_factory=lambda: list(EVAL_ANSWER_FIELDS),
                                     description="With filter.decontaminate_answers: the eval documents' answer fields")
    id_field: str = Field("id", description="The document id field (absent: sha256 of the document's text)")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="auto: from the file extension")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        v = uris.require_uri(v, "filter.decontaminate[].uri")
        if uris.scheme_of(v) not in ("file", "s3"):
            raise ValueError(f"{v!r}: eval sets are read from file:// or s3:// (copy hub or HDFS data there first)")
        return v.rstrip("/")

    @field_validator("fields")
    @classmethod
    def _fields(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one text field, e.g. ['question']")
        return v

    @model_validator(mode="after")
    def _name(self) -> EvalSetSpec:
        if self.name is None:
            stem = uris.name(self.uri).split(".")[0] or "eval"
            object.__setattr__(self, "name", stem)
        uris.safe_component(self.name, "filter.decontaminate[].name")
        return self


# The LSH method's settings at their defaults, as every config the code before issue 33 dumped holds them
# (each in-flight run's resolved file among them). Under 'cluster' they changed nothing (its seed, lsh_seed,
# was 0 = near_dup_seed's default), so such a file still loads and a run resumes across the upgrade; any
# other value, or near_dup_method 'lsh', is refused with what to change (FilterSection.retired).
RETIRED_LSH_DEFAULTS = {"lsh_bands": 48, "lsh_min_band_matches": 2, "lsh_rows_per_band": 16, "lsh_max_leaders": 32,
                        "lsh_seed": 0}


class FilterSection(SparkStageSection):
    """Similarity filter, deduplication, split, tokenize and pack (spark_jobs/filter/job.py)."""

    arrow_batch_rows: int = execution(2048, ge=1, le=100_000, description="records per Arrow batch into the tokenizer")
    min_qa_similarity: float = content(0.2, ge=-1.0, le=1.0, description="Drop pairs with question-answer cosine below this", trigger=True)
    exact_dedup: bool = content(True, description="Drop exact duplicates (hash of normalised prompt and answer text)", trigger=True)
    near_dup_threshold: float | None = content(
        0.9, ge=0.5, le=1.0,
        description="Near duplicates: mean of question and answer cosine >= this (null = off); paraphrases score ~0.92-0.98", trigger=True,
    )
    near_dup_method: Literal["cluster"] = content(
        "cluster", description="cluster: k-means first, exact cosine inside clusters (recall independent of N); "
        "'lsh' was retired in issue 33 and is refused (docs/filter.md)", trigger=True)
    near_dup_guard: Literal["numbers", "none"] = content(
        "numbers", description="numbers: near duplicates must also agree on the question's numbers, code identifiers "
        "and literals, and the final answer (docs/filter.md); none: similarity alone", trigger=True)
    near_dup_cluster_size: int = content(2000, ge=16, le=1_000_000, description="target rows per k-means cluster", trigger=True)
    near_dup_probes: int = content(2, ge=1, le=16, description="clusters a row may join (boundary pairs)", trigger=True)
    near_dup_probe_margin: float = content(0.05, ge=0.0, le=2.0, description="join a further cluster within this cosine", trigger=True)
    near_dup_max_cluster_factor: float = content(
        4.0, ge=1.5, le=1000.0, description="split a k-means cluster estimated above this x near_dup_cluster_size rows", trigger=True)
    near_dup_split_rounds: int = content(3, ge=0, le=8, description="rounds of splitting oversized clusters (0 = never)", trigger=True)
    near_dup_coarse_probes: int = content(
        8, ge=0, le=4096, description="centroid index: coarse lists scored per row (about sqrt(clusters) "
        "centroids each); 0 = score every centroid (exact, O(rows x clusters))", trigger=True)
    near_dup_seed: int = content(
        0, description="Seed of the near-duplicate k-means (its sample rows, k-means++ seeds, splits, centroid index)",
        trigger=True)
    near_dup_recall_sample: int = execution(2000, ge=0, le=1_000_000,
                                        description="rows checked by brute force for the measured recall (0 = off)")
    min_answer_tokens: int = content(1, ge=0, description="Drop answers shorter than this (tokens, without </s>)", trigger=True)
    max_tokens: int = content(4096, ge=8, description="Drop records whose prompt + answer exceeds this (tokens)", trigger=True)
    val_fraction: float = content(0.05, ge=0.0, lt=1.0, description="Share of prompts (all their answers) in the validation split", trigger=True)
    seq_len: int = content(1024, ge=32, le=131_072, description="Tokens per packed row; must equal train.seq_len", trigger=True)
    tokenizer: str = content("mistral-v1", description="'mistral-v1', 'mistral-v3', or an HF tokenizer path/id")
    overflow: Literal["reject", "drop_earlier_reasoning", "truncate"] = content(
        "reject", description="A record longer than seq_len: reject it (too long rows are counted per split); "
        "drop_earlier_reasoning: render it again without the reasoning traces of turns before the final answer "
        "(the visible conversation and the trained answer are kept whole), reject it if still too long; "
        "truncate: cut its answer's tail (counted)", trigger=True
    )
    train_on_reasoning: bool = content(
        False, description="Train the final answer's <think> trace (and mark the mode in the system prompt); else the visible answer", trigger=True
    )
    reasoning_marker_on: str = content("/think", description="With train_on_reasoning: system-prompt marker of reasoning-on records", trigger=True)
    reasoning_marker_off: str = content("/no_think", description="With train_on_reasoning: marker of reasoning-off records", trigger=True)
    train_on: Literal["dataset_flags", "all_assistant_turns", "last_assistant_turn"] = content(
        "dataset_flags", description="Which assistant turns carry the loss (prompt, system and tool results never do); "
        "dataset_flags: the record's metadata.train_turns where it has them, else every assistant turn", trigger=True
    )
    prompt_context: Literal["conversation", "relevant"] = content(
        "conversation",
        description="conversation: every turn verbatim; relevant: system prompts / tool results over "
        "relevant_context_tokens become their top relevant units (by similarity to the question), in order", trigger=True,
    )
    relevant_context_tokens: int = content(
        512, ge=1, description="prompt_context=relevant: a system prompt or tool result longer than this (tokens) is reduced", trigger=True
    )
    relevant_top_k: int = content(5, ge=1, le=1000, description="prompt_context=relevant: units kept per reduced turn", trigger=True)
    # -- the Nemotron family (issue 28; docs/data-sources.md)
    identity_patterns: list[str] = content(
        default_factory=lambda: list(DEFAULT_IDENTITY_PATTERNS),
        description="Regexes (case-insensitive) of another model's or lab's self-identification, matched in "
        "answers and reasoning; [] = off")
    identity_action: Literal["reject", "keep"] = content(
        "reject", description="A record matching identity_patterns: rejected (identity_mismatch) or kept (counted)", trigger=True)
    licenses: list[str] | None = content(
        None, description="Allowed `license` values (null = all); others are rejected as license_excluded", trigger=True)
    val_max_documents: int = content(20_000, ge=1, description="Cap on validation documents (the rest of val is dropped, counted)", trigger=True)
    seed: int = content(1234, description="Seed of the train/val split hash", trigger=True)
    # --- preference optimisation (docs/dpo.md)
    objective: Objective = content(
        "sft", description="sft: pack conversations; dpo: one preference pair per row (chosen then rejected, each "
        "its own document, loss on each side's final assistant turn)")
    min_preference_margin: int = content(
        1, ge=1, le=3, description="dpo, HelpSteer3 records: drop pairs with |overall_preference| below this "
        "(ties, 0, are always dropped as preference_tie)", trigger=True)
    pack_buffer_docs: int = content(20_000, ge=1, le=10_000_000, description="Documents packed together (best-fit decreasing)", trigger=True)
    shard_tokens: int = content(1 << 25, ge=1024, description="Target tokens per output parquet file", trigger=True)
    render_sample_documents: int = content(
        1000, ge=1, le=100_000, description="Kept documents stored with their conversations (smallest keys) so the "
        "trainer can check that the exported tokenizer's apply_chat_template reproduces them token for token")

    # decontamination against evaluation sets (spark_jobs/filter/decontaminate.py; docs/evaluation.md)
    decontaminate: list[EvalSetSpec] = content(
        default_factory=list, description="Evaluation sets: a record sharing an n-gram with one of their documents "
        "is rejected as 'contaminated' (empty = off)")
    decontam_ngram: int = content(13, ge=3, le=64, description="n of the shared normalised-token n-grams", trigger=True)
    decontam_threshold: float = content(
        0.0, ge=0.0, lt=1.0, description="A record is contaminated by an eval document when more than this share of "
        "the document's n-grams occur in it (0: any one shared n-gram)", trigger=True)
    decontaminate_answers: bool = content(False, description="Match the records' answers too (against the eval "
                                        "documents' text and answer fields)", trigger=True)
    decontam_min_tokens: int = content(
        8, ge=1, le=64, description="An eval document shorter than decontam_ngram tokens matches as a whole "
        "token sequence when it has at least this many tokens (shorter ones are ignored, counted)", trigger=True)

    @field_validator("identity_patterns")
    @classmethod
    def _identity(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"pattern {p!r} is not a regular expression: {e}") from None
        return v

    @classmethod
    def retired(cls, settings: Mapping[str, Any], *, old_dump_ok: bool = True) -> list[str]:
        """What to change in a raw filter section written for the LSH method (retired in issue 33).
        `old_dump_ok`: LSH settings at their old defaults pass (see RETIRED_LSH_DEFAULTS)."""
        problems = []
        if settings.get("near_dup_method") == "lsh":
            problems.append("filter.near_dup_method 'lsh' was retired in issue 33 (its recall fell as the rows "
                            "grew, docs/scale.md): use 'cluster' (the default)")
        changed = {k: v for k, v in settings.items() if k.startswith("lsh_")
                   and not (old_dump_ok and k in RETIRED_LSH_DEFAULTS and v == RETIRED_LSH_DEFAULTS[k])}
        if "lsh_seed" in changed:
            problems.append(f"filter.lsh_seed={changed.pop('lsh_seed')!r} was retired with the LSH method (issue 33): "
                            "set filter.near_dup_seed instead (the k-means seed, which read lsh_seed before)")
        if changed:
            problems.append(f"{', '.join(f'filter.{k}={v!r}' for k, v in sorted(changed.items()))}: settings of the "
                            "LSH method, retired in issue 33: remove them (the 'cluster' method never read them; "
                            "near_dup_cluster_size and near_dup_probes tune it)")
        return problems

    @model_validator(mode="before")
    @classmethod
    def _refuse_retired(cls, data: Any) -> Any:
        # before field validation: an old config gets what to change, not "extra inputs are not permitted"
        if not isinstance(data, Mapping):
            return data
        problems = cls.retired(data)
        if problems:
            raise ValueError("; ".join(problems))
        return {k: v for k, v in data.items() if k not in RETIRED_LSH_DEFAULTS}

    @model_validator(mode="after")
    def _cross_fields(self) -> FilterSection:
        names = [e.name for e in self.decontaminate]
        if len(set(names)) != len(names):
            raise ValueError(f"decontaminate: eval set names {names} must be unique (set 'name' on each)")
        if self.decontam_min_tokens > self.decontam_ngram:
            raise ValueError(f"decontam_min_tokens={self.decontam_min_tokens} > decontam_ngram={self.decontam_ngram}")
        return self


class DPOSettings(BaseModel):
    """train.dpo: the preference loss (training/dpo_loss.py; TRL's DPOTrainer definitions)."""

    model_config = ConfigDict(extra="forbid")

    beta: float = Field(0.1, gt=0, le=100.0, description="KL strength: reward = beta x (policy - reference) log-prob")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="sigmoid loss: assumed share of flipped labels")
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid: -log sigmoid(beta x margin) (DPO); ipo: (margin/tokens - 1/(2 beta))^2")
    min_val_reward_accuracy: float = Field(
        0.0, ge=0.0, le=1.0, description="promotion gate: val reward accuracy must be at least this (and no worse "
        "than the promoted DPO model's)")


class TrainSection(Section):
    """DeepSpeed pipeline training (training/train.py). Batch-shape and optimiser fields here
    override the matching entries of the DeepSpeed config file (`ds_config`)."""

    base_model: str = content("tiny", description="'tiny' (embedded), an HF model directory, or a hub id")
    pipeline_stages: int = content(2, ge=1, le=256, description="Pipeline-parallel degree; must divide the world size", trigger=True)
    partition_method: str = content(
        "type:DecoderLayerPipe", description="DeepSpeed partition method: parameters, uniform or type:<regex>", trigger=True
    )
    seq_len: int = content(1024, ge=32, le=131_072, description="Must equal the train-ready artifact's sequence length", trigger=True)
    micro_batch_size: int = content(1, ge=1, le=1024, trigger=True)
    gradient_accumulation_steps: int = content(4, ge=1, le=4096, trigger=True)
    global_batch_size: int | None = content(
        None, ge=1, description="Sequences per optimizer step, fixed whatever the GPU count: gradient accumulation "
        "= global_batch_size / (micro_batch_size x data-parallel ranks), refused when it does not divide; "
        "None = use gradient_accumulation_steps", trigger=True)
    steps: int = execution(20, ge=1, description="Optimizer steps for the whole run (resumes continue to this)", trigger=True)
    learning_rate: float = content(1e-4, gt=0, le=1.0, trigger=True)
    warmup_steps: int = content(2, ge=1, description="Linear warm-up steps (DeepSpeed's WarmupLR needs at least 1)", trigger=True)
    checkpoint_every: int = execution(10, ge=1, description="Steps between checkpoints (the last step always saves one)", trigger=True)
    keep_last: int = execution(2, ge=1, le=1000, description="Checkpoints kept in the store", trigger=True)
    seed: int = content(1234, trigger=True)
    precision: Literal["auto", "bf16", "fp32"] = content(
        "auto", description="bf16 mixed precision (fp32 master weights) or full fp32; auto: bf16 on a GPU that has it "
        "and on CPUs with bf16 instructions, else fp32 (bf16 on a CPU without them is ~8x slower)", trigger=True
    )
    grad_accum_dtype: Literal["fp32", "bf16"] = content(
        "fp32", description="dtype gradients are accumulated and reduced in under bf16 (fp32: DeepSpeed's "
        "pipeline-aware BF16 optimizer, needs ZeRO stage 1; bf16 saves 2 bytes/parameter, loses precision)"
    )
    attention_backend: Literal["auto", "sdpa", "flex", "flash_varlen", "torch_varlen"] = execution(
        "auto", description="sdpa: exact dense mask (CPU); flex: flex-attention document mask; flash_varlen: flash-attn; "
        "torch_varlen: PyTorch's built-in FlashAttention-2 varlen kernel (GPU fast path, no extra package); "
        "auto: torch_varlen on a GPU, sdpa on CPU"
    )
    fast_kernels: Literal["auto", "none", "liger"] = execution(
        "auto", description="GPU only: 'liger' swaps in fused RMSNorm/SwiGLU/RoPE and a fused linear+cross-entropy "
        "loss (liger-kernel package); auto: liger on a GPU when importable (and verify_parity is off), else none"
    )
    lr_schedule: Literal["linear", "cosine", "constant"] | None = content(
        None, description="After the linear warm-up: linear decay to 0 (WarmupDecayLR), cosine decay "
        "(WarmupCosineLR) or constant (WarmupLR), DeepSpeed's own schedulers; None: the ds_config file's "
        "scheduler (the bundled one: linear)"
    )
    eval_every: int = execution(0, ge=0, description="Steps between validations (0: only at the end); the best "
                            "validation loss's checkpoint is tagged in the report", trigger=True)
    max_bad_steps: int = execution(3, ge=1, description="Stop after this many non-finite steps in a row (each is skipped)")
    io_timeout_s: int = execution(3600, ge=60, description="Timeout of the CPU side group the ranks wait on while rank 0 "
                              "fetches the dataset, base weights and checkpoint (NCCL keeps its own short timeout)")
    activation_checkpoint_interval: int = execution(
        0, ge=0, description="DeepSpeed's own checkpointing: decoder layers per checkpointed block; 0 = off "
        "(prefer train.recompute; the two are not combined)", trigger=True)
    recompute: Literal["auto", "none", "full", "attention", "mlp", "every_n"] = execution(
        "auto", description="Activation recomputation inside each decoder layer (non-reentrant checkpointing): none; "
        "full (keep only the layer input); attention (recompute norm + attention block); mlp (recompute norm + "
        "SwiGLU MLP); every_n (full on every recompute_every-th layer); auto: the cheapest of these whose "
        "estimated stage memory fits the GPU (training/memory.py, docs/training.md), none on CPU", trigger=True)
    recompute_every: int = execution(2, ge=1, le=1024, description="train.recompute=every_n: every n-th decoder layer "
                                 "is recomputed whole (1 = full)", trigger=True)
    compile_layers: bool = execution(
        False, description="GPU: torch.compile each decoder layer (regional compilation, one graph shared by all "
        "layers, as torchtitan does); Inductor then fuses RMSNorm/SwiGLU/RoPE itself, so Liger keeps only the "
        "fused loss. Costs a one-off compile at start")
    sync_free_attention: bool = execution(
        True, description="torch_varlen/flash_varlen: bound max_seqlen by the row length instead of reading the "
        "longest document back from the GPU every micro-batch (one host sync less; the kernel skips empty tiles)")
    causal_rows_sdpa: bool = execution(
        True, description="torch_varlen: a micro-batch whose rows are each one whole document runs PyTorch SDPA "
        "(cuDNN/flash, transformers' own sdpa path) instead of the varlen kernel; on an H200 cuDNN's attention "
        "took 0.61 s of a step where FA2 varlen took 1.07 s (bench/RESULTS.md)")
    fused_grad_accumulation: bool = execution(
        True, description="bf16 + grad_accum_dtype fp32: add each bf16 gradient into its fp32 buffer the moment "
        "backward produces it (DeepSpeed's bf16.immediate_grad_update), in one mixed-dtype kernel, and free the "
        "bf16 gradient: no bf16 accumulation, no fp32 temporary, 2 bytes/parameter less")
    fused_wgrad_accumulation: bool = execution(
        True, description="bf16 + grad_accum_dtype fp32: the decoder layers' weight-gradient GEMMs accumulate "
        "straight into the fp32 gradient buffer (beta=1, Megatron's gradient_accumulation_fusion): no bf16 weight "
        "gradient, no separate add, no per-micro-batch bf16 rounding (+2.3% on an H200). Eager layers only: "
        "skipped with compile_layers, and FP8 layers compute their own weight gradient")
    fp8: Literal["off", "tensorwise", "rowwise"] = content(
        "off", description="GPU (sm_89+): the decoder layers' linear layers in float8 (torchao float8 training, "
        "dynamic tensorwise or rowwise scales; weights, master copy and optimizer unchanged). Fast only with "
        "compile_layers, which fuses the casts")
    pin_memory: bool = execution(
        True, description="GPU: micro-batches go host->device from pinned memory without blocking the host")
    async_checkpoint: bool = execution(
        True, description="Checkpoint saves snapshot the state to host memory and return; a background writer "
        "writes the files, then the upload starts (the manifest is still written last, after every rank's files)")
    ds_config: str | None = content(None, description="DeepSpeed JSON (path or file:// URI); default training/ds_config.json")
    eval_batches: int = execution(8, ge=0, description="Validation micro-batches per data-parallel rank (0 = skip eval)", trigger=True)
    verify_parity: bool = execution(
        False, description="Compare pipeline logits with transformers' on a val batch before training and after export"
    )
    parity_tolerance: float = execution(1e-5, gt=0, description="Max abs logit difference allowed by verify_parity")
    peak_tflops: float | None = execution(None, gt=0, description="Per-device peak for MFU (default: known GPUs, else no MFU)")
    max_failed_pushes: int = execution(
        3, ge=1, le=100, description="Consecutive failed checkpoint pushes before training stops (local copies are kept)"
    )
    max_pending_pushes: int = execution(2, ge=1, le=64, description="Saved checkpoints waiting for upload before a save waits")
    push_backoff_s: float = execution(2.0, ge=0, le=600, description="First retry delay of a failed push (doubles, max 60 s)")
    lease_ttl_s: float = execution(
        120, ge=2, le=3600, description="Run lease lifetime: a dead trainer's run can be resumed this long after it died"
    )
    resume_across_changes: bool = execution(
        False, description="Resume a checkpoint made with other train content settings or another input (deliberately)"
    )
    # --- preference optimisation (docs/dpo.md)
    objective: Objective = content("sft", description="sft: token-mean cross-entropy; dpo: preference pairs against "
                                 "the frozen reference model's log-probabilities (computed once, stored)")
    dpo: DPOSettings = content(default_factory=lambda: DPOSettings(), trigger=True)

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on `world_size` ranks (raises `ConfigError` naming the fields)."""
        if world_size % self.pipeline_stages:
            raise ConfigError(f"train.pipeline_stages={self.pipeline_stages} does not divide the world size "
                              f"{world_size} (world size = data parallel x pipeline stages)")
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_step = self.micro_batch_size * (world_size // self.pipeline_stages)
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of train.micro_batch_size "
                f"({self.micro_batch_size}) x data-parallel ranks ({world_size // self.pipeline_stages}) = {per_step} "
                f"on {world_size} ranks; choose a multiple of {per_step} or change micro_batch_size")
        return self.global_batch_size // per_step

    @field_validator("partition_method")
    @classmethod
    def _partition(cls, v: str) -> str:
        if v not in ("parameters", "uniform") and not (v.startswith("type:") and len(v) > 5):
            raise ValueError("expected 'parameters', 'uniform' or 'type:<layer class regex>'")
        return v

    @field_validator("ds_config")
    @classmethod
    def _ds_config(cls, v: str | None) -> str | None:
        return None if v is None else uris.qualify(v)

    @model_validator(mode="after")
    def _one_recompute(self) -> TrainSection:
        if self.activation_checkpoint_interval and self.recompute not in ("auto", "none"):
            raise ValueError(f"train.activation_checkpoint_interval={self.activation_checkpoint_interval} and "
                             f"train.recompute={self.recompute!r} both checkpoint the decoder layers; set "
                             "activation_checkpoint_interval to 0 (or recompute to none)")
        return self

    @model_validator(mode="after")
    def _dpo_has_no_logits(self) -> TrainSection:
        if self.objective == "dpo" and self.verify_parity:
            raise ValueError("train.objective='dpo' reduces hidden states to per-document log-probabilities without "
                             "logits, so verify_parity cannot compare them; set verify_parity false")
        return self

    @model_validator(mode="after")
    def _fused_loss_has_no_logits(self) -> TrainSection:
        if self.fast_kernels == "liger" and self.verify_parity:
            raise ValueError("fast_kernels='liger' never materialises logits, so verify_parity cannot compare them; "
                             "set one of the two off")
        return self


class EvalTaskSpec(Section):
    """One lm-evaluation-harness task run on the exported model after training (training/benchmarks.py)."""

    task: str = Field(description="A harness task name, or the `task:` name of the local YAML task in `yaml`")
    yaml: str | None = Field(None, description="file:// or s3:// URI of a local YAML task (its data_files are "
                                                "resolved next to it); None: the harness's own task")
    num_fewshot: int = Field(0, ge=0, le=64)
    limit: int | None = Field(None, ge=1, description="Documents scored (None: all)")

    @field_validator("task")
    @classmethod
    def _task(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$", v):
            raise ValueError(f"{v!r}: a task name is letters, digits, '_', '-', '.'")
        return v

    @field_validator("yaml")
    @classmethod
    def _yaml(cls, v: str | None) -> str | None:
        return None if v is None else uris.require_uri(v, "release.eval_tasks[].yaml")


class PromoteMetric(Section):
    """A benchmark score promotion compares: the new model's may not be worse than the promoted one's by more than min_delta."""

    task: str
    metric: str = Field(description="The harness metric, e.g. 'acc' or 'acc_norm' (filter suffix optional: 'acc,none')")
    min_delta: float = Field(0.0, ge=0.0, description="Allowed drop (in the metric's units) before promotion is refused")
    higher_is_better: bool = True


class ReleaseSection(Section):
    """The gates between a dataset and a published model: a human approval before training
    (`require_approval`) and an evaluation before `models/LATEST` moves (docs/orchestration.md)."""

    require_approval: bool = execution(False, description="Wait for a human Approve/Reject (with the data report) before training")
    promote_tolerance: float = execution(
        0.0, ge=0.0, le=10.0,
        description="models/LATEST moves when the new val loss <= the current LATEST's on the same val rows + this")
    force_promote: bool = execution(False, description="Move models/LATEST even when the new model evaluates worse")
    eval_max_rows: int | None = execution(256, ge=1, description="Packed val rows both models are evaluated on (null = all)")
    eval_device: str = execution("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="Where the promotion eval runs")
    # --- deployment policy (issue 26.5): not trigger-overridable (params.OVERRIDABLE does not list them)
    max_order_key_ahead_s: float = execution(
        3600.0, ge=0, le=366 * 86_400,
        description="A run whose logical date (its models/LATEST order key) is more than this many seconds ahead "
                    "of now is refused by resolve and by the promotion: a date in 2100 would pin LATEST forever")

    # benchmarks after training and promotion on their scores (training/benchmarks.py, docs/evaluation.md)
    eval_tasks: list[EvalTaskSpec] = execution(
        default_factory=list, description="lm-evaluation-harness tasks run on the exported model (runs/<run>/eval/)")
    eval_batch_size: int = execution(8, ge=1, le=4096, description="Batch size of the harness's HF backend")
    promote_on: Literal["val_loss"] | list[PromoteMetric] = execution(
        "val_loss", description="val_loss (the new model's val loss vs LATEST's on the same rows), or benchmark "
        "metrics of release.eval_tasks that may not get worse than LATEST's by more than their min_delta")
    # MLflow model registry (training/tracking.py, docs/evaluation.md#tracking-mlflow): used when tracking.mlflow_uri is set
    registered_model: str = execution(
        "mistral-finetune", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$",
        description="MLflow registered model a promoted model becomes a version of (alias 'champion' moves forward)")

    @model_validator(mode="after")
    def _promote_on_tasks(self) -> ReleaseSection:
        if isinstance(self.promote_on, list):
            if not self.promote_on:
                raise ValueError("promote_on: give 'val_loss' or at least one {task, metric, min_delta}")
            tasks = {t.task for t in self.eval_tasks}
            missing = sorted({m.task for m in self.promote_on} - tasks)
            if missing:
                raise ValueError(f"promote_on names tasks {missing} that release.eval_tasks does not run; "
                                 f"add them to eval_tasks (it runs {sorted(tasks)})")
        return self


class TrackingSection(Section):
    """MLflow tracking of each run (training/tracking.py): never on the critical path; a failing
    server is logged, retried with backoff, then given up on without failing training or publish."""

    mlflow_uri: str | None = execution(
        None, description="MLflow tracking URI (http(s)://host:port or sqlite:///path); None: tracking off")
    experiment: str = execution("mistral-finetune", min_length=1, max_length=256,
                                description="MLflow experiment the runs are logged under")
    max_attempts: int = execution(4, ge=1, le=20, description="Attempts per tracking call before it is given up")
    backoff_s: float = execution(1.0, ge=0, le=60, description="First retry delay (doubles per attempt)")
    request_timeout_s: float = execution(10.0, gt=0, le=300, description="HTTP timeout of one tracking request")
    flush_timeout_s: float = execution(
        60.0, ge=0, le=3600, description="How long the end of a run waits for queued tracking calls before dropping them")

    @field_validator("mlflow_uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(https?://[^\s/]+|sqlite:///\S+|postgresql(\+\w+)?://\S+)", v):
            raise ValueError(f"{v!r}: expected http(s)://host:port, sqlite:///path or postgresql://...")
        return v


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    storage: StorageSection = Field(default_factory=StorageSection)
    enrich: EnrichSection = Field(default_factory=EnrichSection)
    filter: FilterSection = Field(default_factory=FilterSection)
    train: TrainSection = Field(default_factory=TrainSection)
    release: ReleaseSection = Field(default_factory=ReleaseSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)

    @model_validator(mode="after")
    def _one_objective(self) -> Config:
        got = {"enrich.objective": self.enrich.objective, "filter.objective": self.filter.objective,
               "train.objective": self.train.objective}
        if len(set(got.values())) > 1:
            raise ValueError(f"the objective must be the same in every stage, got {got}: set all three (the DAG's "
                             "'objective' param does)")
        return self

    def section_hash(self, name: str) -> str:
        """Short stable hash of one section: the `<cfg>` part of artifact paths."""
        return stable_hash(getattr(self, name).model_dump(mode="json"))[:12]

    def dump(self, path: str | Path) -> Path:
        """Write the resolved config: the one `--config FILE` every stage takes."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=True))
        os.replace(tmp, p)
        return p


def sections() -> dict[str, type[Section]]:
    """Config section name -> its class."""
    return {name: f.annotation for name, f in Config.model_fields.items()}  # type: ignore[misc]


def trigger_overridable() -> frozenset[str]:
    """`section.field` keys a trigger may set through `config_overrides` (declared with trigger=True)."""
    return frozenset(f"{name}.{f}" for name, cls in sections().items() for f in cls.trigger_fields())


def unclassified_fields() -> list[str]:
    """`section.field` keys declared without a role (must be empty: tests/test_config_registry.py)."""
    return [f"{name}.{f}" for name, cls in sections().items() for f in cls.model_fields if cls.role_of(f) is None]


def stable_hash(obj: Any) -> str:
    """sha256 of the canonical JSON form of `obj`."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Defaults < file < environment (`MFT__SECTION__FIELD`, default `os.environ`) < overrides
    (`{"section": {...}}` or `{"section.field": v}`); sections merge field by field."""
    try:
        return settings_loader.load(Config, _sources(path, overrides or {}, os.environ if env is None else env),
                                    depth=2)
    except SettingsSourceError as e:
        raise ConfigError(str(e)) from None
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def _sources(path: str | Path | None, overrides: Mapping[str, Any],
             env: Mapping[str, str]) -> Iterator[PydanticBaseSettingsSource]:
    """Lowest first; a generator, so each is read after those below it merged (the first error wins)."""
    yield ValuesSource(Config, _read_file(Path(uris.to_local_path(path) if uris.scheme_of(str(path)) else path))
                       if path is not None else {})
    yield PrefixedEnvSource(Config, env, ENV_PREFIX, depth=2, shape="<SECTION>__<FIELD>")
    yield ValuesSource(Config, _overrides(overrides))


def _read_file(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    text = p.read_text()
    loaded = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p}: expected a mapping of sections, got {type(loaded).__name__}")
    return loaded


def _overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`{"section": {...}}` / `{"section.field": v}` -> `{section: {field: v}}`."""
    data: dict[str, Any] = {}
    for key, value in overrides.items():
        for parts, v in ([([key, f], v) for f, v in value.items()] if isinstance(value, Mapping) and "." not in key
                         else [(key.split("."), value)]):
            if len(parts) != 2:
                raise ConfigError(f"config key {'.'.join(parts)!r}: expected <section>.<field>")
            settings_loader.put(data, parts, v)
    return data


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "<config>"
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{field}: {e['msg']}{got_s}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
