"""A job config read from YAML (a local path or any fsspec URI) and validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from pipeline.config.base import ConfigError
from pipeline.config.job import JobConfig
from pipeline.config.messages import config_error_lines
from pipeline.config.paths import _resolve_relative_paths


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
        raise ConfigError(
            f"{uri}: no such config file; give the path of a job YAML (jobs/configs/local.yaml is an example)"
        )
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
