"""Write the configuration reference, docs/configuration.md, from the job config's pydantic
models (pipeline/config/): per section a table of key, type, default and description.

    python -m pipeline.tools.config_reference            # rewrites docs/configuration.md
    python -m pipeline.tools.config_reference --out -    # prints it

tests/test_readme.py regenerates it in memory and fails when the committed file differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from pipeline.config import JobConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m pipeline.tools.config_reference"

HEADER = f"""\
# Configuration reference

<!-- Generated from pipeline/config/ by `{COMMAND}`; do not edit by hand. -->

A job config is one YAML file (`specbatch run job.yaml`), validated when it is loaded: an
unknown key is an error naming it, and so is a value out of range. Relative local paths
resolve against the config file's folder. Credentials are never part of it: they come from
the environment or the cloud identity. A key marked **required** has no default; a section
(a mapping of its own keys) left out takes the defaults of its keys.

Examples: `jobs/configs/local.yaml` (the embedded default: CPU, tiny models) and
`jobs/configs/gpu-cluster.yaml`.
"""


def _is_section(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (also through Optional or a union), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _is_section(arg)
        if found:
            return found
    return None


def type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(named) + (" \\| null" if type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin is dict:
        return f"map {type_name(args[0])} → {type_name(args[1])}"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {str: "string", int: "int", float: "float", bool: "bool"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections(
    model: type[BaseModel], prefix: str = ""
) -> list[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]]:
    """(dotted name, model, its fields) for the model and every section under it, depth first."""
    out = [(prefix, model, list(model.model_fields.items()))]
    for name, field in model.model_fields.items():
        sub = _is_section(field.annotation)
        if sub is not None:
            out += sections(sub, f"{prefix}{field.alias or name}.")
    return out


def render() -> str:
    lines = [HEADER]
    for prefix, model, fields in sections(JobConfig):
        title = prefix.rstrip(".") or "top level"
        lines.append(f"\n## {title}\n")
        doc = (model.__doc__ or "").strip() if prefix else ""
        if doc and not doc.startswith(model.__name__ + "("):  # pydantic's generated docstrings name the class
            lines.append(" ".join(doc.split()) + "\n")
        lines.append("| key | type | default | description |")
        lines.append("| --- | --- | --- | --- |")
        for name, field in fields:
            key = f"{prefix}{field.alias or name}"
            sub = _is_section(field.annotation)
            description = _cell(field.description or "")
            if sub is not None:
                anchor = key.replace(".", "").lower()
                description = f"{description} See [{key}](#{anchor}).".strip()
            lines.append(f"| `{key}` | {type_name(field.annotation)} | {default_text(field)} | {description} |")
    return "\n".join(lines) + "\n"


def undescribed() -> list[str]:
    """Keys without a description: every key should say what it does."""
    return [
        f"{prefix}{field.alias or name}"
        for prefix, _, fields in sections(JobConfig)
        for name, field in fields
        if not (field.description or "").strip()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  {COMMAND}",
    )
    parser.add_argument("--out", default=str(DOC), help=f"where to write it ('-': stdout; default {DOC})")
    args = parser.parse_args(argv)
    text = render()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
