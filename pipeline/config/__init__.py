"""Job configuration: a YAML file validated by pydantic on load.

Unknown keys are errors and every message names the field. Credentials are not part of the
configuration: they come from the environment or the cloud identity (see storage.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from pipeline.config.base import ConfigError, Section, closest
from pipeline.config.input_rows import InputRowsConfig, TemplateMessage
from pipeline.config.job import JobConfig
from pipeline.config.messages import config_error_lines, unknown_key_message
from pipeline.config.paths import PATH_FIELDS, _resolve_relative_paths, output_inside_input
from pipeline.config.resources import LeaseConfig, ReplicaRange, ResourcesConfig, RetriesConfig
from pipeline.config.rows import (
    JOB_ONLY_SAMPLING,
    MAX_LOGPROBS,
    MAX_SAMPLES,
    ChatConfig,
    JsonSchemaFormat,
    LoraConfig,
    ResponseFormat,
    SamplingConfig,
    speculation_conflicts,
)
from pipeline.config.sections import (
    ACCEPTANCE_FLOOR,
    EngineConfig,
    GuardConfig,
    ModelConfig,
    ProbeConfig,
    SpeculativeConfig,
    StorageConfig,
    validate_check_names,
)

__all__ = [
    "ACCEPTANCE_FLOOR",
    "JOB_ONLY_SAMPLING",
    "MAX_LOGPROBS",
    "MAX_SAMPLES",
    "PATH_FIELDS",
    "ChatConfig",
    "ConfigError",
    "EngineConfig",
    "GuardConfig",
    "InputRowsConfig",
    "JobConfig",
    "JsonSchemaFormat",
    "LeaseConfig",
    "LoraConfig",
    "ModelConfig",
    "ProbeConfig",
    "ReplicaRange",
    "ResourcesConfig",
    "ResponseFormat",
    "RetriesConfig",
    "SamplingConfig",
    "Section",
    "SpeculativeConfig",
    "StorageConfig",
    "TemplateMessage",
    "closest",
    "config_error_lines",
    "load_config",
    "output_inside_input",
    "parse_config",
    "speculation_conflicts",
    "unknown_key_message",
    "validate_check_names",
]


def parse_config(data: dict[str, Any], source: str = "<config>") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: invalid job config"] + [f"  {line}" for line in config_error_lines(exc)]
        raise ConfigError("\n".join(lines)) from None


def load_config(uri: str, overrides: Optional[dict[str, Any]] = None) -> JobConfig:
    """Load a YAML job config from a local path or any fsspec URI; `overrides` are applied
    on top at the top level (e.g. {"output_uri": ...} for a dated output prefix)."""
    import fsspec

    if Path(uri).exists():
        text = Path(uri).read_text()
    elif "://" not in uri:
        raise ConfigError(f"{uri}: no such config file; give the path of a job YAML (jobs/configs/local.yaml is an example)")
    else:
        try:
            with fsspec.open(uri, "r") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"{uri}: no such config file; give the URI of a job YAML") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{uri}, line {mark.line + 1}, column {mark.column + 1}" if mark else uri
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc}); fix it there") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{uri}: a job config is a YAML mapping (`input_uri: ...`, `output_uri: ...`, `model: {{path: ...}}`), "
            f"got {type(data).__name__}"
        )
    _resolve_relative_paths(data, Path(uri).resolve().parent if Path(uri).exists() else None, uri)
    data.update(overrides or {})
    return parse_config(data, source=uri)


# Local paths of a config; a relative one is relative to the config file's folder. A URI
# (anything with "://": s3://, gs://, file://) is left as it is.
