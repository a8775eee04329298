"""Path rules of a config: no model hub, outputs never inside the input, relative paths from the config's folder."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any, Optional

from pipeline.config.base import ConfigError

MODEL_URI_HELP = (
    "A local folder (or one on the cluster's shared disk), or a folder in object storage (s3:// or any fsspec URI), "
    "which each node copies once into storage.model_cache_dir. Never a model hub."
)


# fsspec schemes of model hubs: models are read from the user's own storage only.
HUB_SCHEMES = ("hf",)


def _not_a_hub(value: Optional[str], field: str) -> None:
    if value and "://" in value and value.split("://", 1)[0] in HUB_SCHEMES:
        raise ValueError(
            f"{field}: {value!r} is a model hub URI; models come from a local folder or your own storage: copy the "
            f"model there and set {field} to that folder or s3:// URI"
        )


GLOB_CHARS = "*?["


def _comparable(uri: str) -> tuple[str, bool]:
    """(the path or URI normalized for prefix comparison, whether it reaches into subfolders).
    The query string and file:// are dropped, the scheme lowercased, `.`, `..`, doubled and
    trailing slashes resolved. A glob is cut to the folder above its first wildcard: every file
    it can match lies there, and in its subfolders only when the rest of the pattern has a `/`
    or `**`. A folder is read recursively."""
    uri = uri.split("?", 1)[0]
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    deep = True
    cut = min((uri.index(c) for c in GLOB_CHARS if c in uri), default=None)
    if cut is not None:
        folder = uri[:cut].rsplit("/", 1)[0] if "/" in uri[:cut] else ""
        rest = uri[len(folder) :].lstrip("/")
        deep = "/" in rest or "**" in rest
        uri = folder
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        rest = posixpath.normpath(rest) if rest.strip("/") else ""
        return f"{scheme.lower()}://{rest.strip('/')}", deep
    return os.path.normpath(os.path.abspath(uri or ".")), deep


def output_inside_input(input_uri: str, output_uri: str) -> Optional[str]:
    """ "is" or "is inside" when the job's outputs would land where its input is read from
    (local paths and URIs alike), else None. A job writes files in output_uri itself
    (_job.json) and Parquet files in its subfolders (outputs/, stats/, ...)."""
    (inp, deep), (out, _) = _comparable(input_uri), _comparable(output_uri)
    if ("://" in inp) != ("://" in out):
        return None
    if out == inp:
        return "is"
    return "is inside" if deep and out.startswith(inp.rstrip("/") + "/") else None


PATH_FIELDS = (("input_uri",), ("output_uri",), ("model", "path"), ("model", "tokenizer"), ("speculative", "drafter"))


def _resolve_relative_paths(data: dict[str, Any], folder: Optional[Path], source: str) -> None:
    """Relative local paths resolve against the config file's folder, never against the
    process's working directory (under `ray job submit` an uploaded package in Ray's temp
    folder). A config that is not a local file cannot have them."""
    for keys in PATH_FIELDS:
        parent = data
        for key in keys[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        value = parent.get(keys[-1]) if isinstance(parent, dict) else None
        if not isinstance(value, str) or "://" in value or Path(value).is_absolute():
            continue
        if folder is None:
            raise ConfigError(
                f"{source}: {'.'.join(keys)} = {value!r} is a relative path, and the config is not a local file it "
                "could be relative to; use an absolute path or a URI"
            )
        parent[keys[-1]] = os.path.normpath(folder / value)
    adapters = (data.get("lora") or {}).get("adapters") if isinstance(data.get("lora"), dict) else None
    for name, value in (adapters or {}).items() if isinstance(adapters, dict) else ():
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            if folder is None:
                raise ConfigError(
                    f"{source}: lora.adapters.{name} = {value!r} is a relative path, and the config is not a local "
                    "file it could be relative to; use an absolute path or a URI"
                )
            adapters[name] = os.path.normpath(folder / value)
