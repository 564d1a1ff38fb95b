"""The one settings loader: pydantic-settings sources, merged later-wins, validated once.

Three settings objects use it: the pipeline `Config` (its file, `MFT__<SECTION>__<FIELD>`, Params
overrides; `pipeline_core.config.load_config`), the Airflow `DeploySettings` (`MFT_DEPLOY__<FIELD>`;
`plugins.mft_airflow.settings.load_settings`) and `ProcessSettings` below (`MFT_CODE_VERSION`, ...).
They stay plain pydantic models rather than `BaseSettings`: a `BaseSettings` reads `os.environ`
wherever it is constructed, here the environment is an argument (`env=`, default `os.environ`) read
only where a loader is called.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource, PydanticBaseSettingsSource
from pydantic_settings.sources.utils import parse_env_vars

M = TypeVar("M", bound=BaseModel)


class SettingsSourceError(ValueError):
    """A source cannot be read; the message names the variable, file or key."""


def yaml_value(raw: str) -> Any:
    """An environment value as YAML (`[chat, code]`, `true`, `0.25`); the empty string is None."""
    return yaml.safe_load(raw) if raw != "" else None


def put(data: dict[str, Any], parts: Sequence[str], value: Any) -> None:
    """`data[parts[0]]...[parts[-1]] = value`, creating the mappings on the way."""
    for name in parts[:-1]:
        data = data.setdefault(name, {})
        if not isinstance(data, dict):
            raise SettingsSourceError(f"config section {name!r} must be a mapping")
    data[parts[-1]] = value


class ValuesSource(PydanticBaseSettingsSource):
    """Values already in the model's shape: a config file's content, keyword overrides."""

    def __init__(self, settings_cls: type[BaseModel], values: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)  # type: ignore[arg-type]  # any model: only model_config is read
        self.values = dict(values)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return self.values


class PrefixedEnvSource(ValuesSource):
    """Every `<prefix>NAME[__NAME]` variable of `env` (the prefix matched case-sensitively, the names
    lower-cased), its value parsed by `parse` (YAML by default). `depth` names per variable
    (`MFT__SECTION__FIELD`: 2, split at `__`); None: the rest is one name (`MFT_DEPLOY__FIELD`). A
    variable of another shape is refused, naming it; a name the model lacks is refused by validation."""

    def __init__(self, settings_cls: type[BaseModel], env: Mapping[str, str], prefix: str, *,
                 depth: int | None = None, shape: str = "", parse: Callable[[str], Any] = yaml_value) -> None:
        values: dict[str, Any] = {}
        for key, raw in sorted(env.items()):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):].lower()
            parts = rest.split("__") if depth else [rest]
            if depth and (len(parts) != depth or not all(parts)):
                raise SettingsSourceError(f"environment variable {key}: expected {prefix}{shape}")
            try:
                value = parse(raw)
            except yaml.YAMLError as e:
                raise SettingsSourceError(f"environment variable {key}: {raw!r} is not YAML "
                                          f"({getattr(e, 'problem', None) or e})") from None
            put(values, parts, value)
        super().__init__(settings_cls, values)


def merge(into: dict[str, Any], new: Mapping[str, Any], depth: int) -> None:
    """`new` over `into`: mappings merge `depth` levels down (a config's sections: 2, so a file's
    section keeps the fields an override does not name); below that a value replaces (a dict field
    such as `enrich.spark_conf` is set whole, never merged key by key)."""
    for key, value in new.items():
        if depth > 1 and isinstance(value, Mapping) and key in into:
            if not isinstance(into[key], dict):
                raise SettingsSourceError(f"config section {key!r} must be a mapping")
            merge(into[key], value, depth - 1)
        elif depth > 1 and isinstance(value, Mapping):
            into[key] = {}
            merge(into[key], value, depth - 1)
        else:
            into[key] = value


def load(model: type[M], sources: Iterable[PydanticBaseSettingsSource], *, depth: int = 1) -> M:
    """`model` from `sources`, lowest precedence first (the model's defaults lie under them all).
    Raises SettingsSourceError (a source) or pydantic's ValidationError (the merged values)."""
    data: dict[str, Any] = {}
    for source in sources:
        merge(data, source(), depth)
    return model.model_validate(data)


class EnvMappingSource(EnvSettingsSource):
    """pydantic-settings' own environment source (only the model's field names, `<env_prefix><FIELD>`,
    values as text) reading a given mapping rather than `os.environ`."""

    def __init__(self, settings_cls: type[BaseModel], env: Mapping[str, str], **kw: Any) -> None:
        self._env = env
        super().__init__(settings_cls, **kw)  # type: ignore[arg-type]

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._env, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


class ProcessSettings(BaseModel):
    """The `MFT_<FIELD>` variables a stage process reads (set by images and launchers); unset or
    empty is None. Text as given: a commit id like `1234567` is not a number."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ENV_PREFIX: ClassVar[str] = "MFT_"

    code_version: str | None = None  # the image's commit: wins over `git rev-parse` (artifacts.code_version)
    checkpoint_hmac_key: SecretStr | None = None  # the checkpoint signing key itself
    checkpoint_hmac_key_file: str | None = None  # else a file holding it
    attempt_id: str | None = None  # the launcher's id of this Airflow try (training.lease.attempt_id)

    @classmethod
    def env_name(cls, field: str) -> str:
        """The variable a field is read from (`checkpoint_hmac_key` -> MFT_CHECKPOINT_HMAC_KEY)."""
        if field not in cls.model_fields:
            raise KeyError(field)
        return f"{cls.ENV_PREFIX}{field.upper()}"


def load_process_settings(env: Mapping[str, str] | None = None) -> ProcessSettings:
    """ProcessSettings from `env` (default: this process's environment)."""
    env = os.environ if env is None else env
    return load(ProcessSettings, [EnvMappingSource(ProcessSettings, env, env_prefix=ProcessSettings.ENV_PREFIX,
                                                   env_ignore_empty=True)])
