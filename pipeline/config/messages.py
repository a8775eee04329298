"""pydantic's validation errors rewritten as a user reads them: the field by its YAML path, what is wrong,
what to do."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from pipeline.config.base import closest
from pipeline.config.job import JobConfig


def _keys(model: type[BaseModel]) -> list[str]:
    """The keys a section takes, as written in YAML (aliases where a field has one)."""
    return [field.alias or name for name, field in model.model_fields.items()]


def _field(model: type[BaseModel], key: str):
    return next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)


def _members(annotation: Any) -> list[Any]:
    """The types of a union (None left out), or [annotation]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _section(annotation: Any) -> Optional[type[BaseModel]]:
    members = _members(annotation)
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None


def _item(annotation: Any) -> Any:
    """What a list index or a dict key of `annotation` holds."""
    args = typing.get_args(_members(annotation)[0]) if len(_members(annotation)) == 1 else ()
    return args[-1] if args else None


def _locate(loc: tuple) -> tuple[list[str], Optional[type[BaseModel]], bool]:
    """(the path as the user wrote it, the section its last key belongs to, whether it went
    through a union member other than a section). pydantic puts a union member's tag in the
    location (`resources.replicas.function-after[_ordered(), ReplicaRange].max`); it is left out."""
    parts: list[str] = []
    current: Any = JobConfig
    owner: Optional[type[BaseModel]] = None
    scalar_member = False
    for seg in loc:
        section = _section(current)
        if section is not None and isinstance(seg, str):
            owner, field = section, _field(section, seg)
            parts.append(seg)
            current = field.annotation if field else None
            continue
        members = _members(current) if current is not None else []
        if len(members) > 1 and isinstance(seg, str):
            named = [m for m in members if re.search(rf"\b{re.escape(getattr(m, '__name__', str(m)))}\b", seg)]
            current = named[0] if named else None
            scalar_member = scalar_member or _section(current) is None
            continue
        parts.append(str(seg))
        owner, current = None, _item(current) if current is not None else None
    return parts, owner, scalar_member


def _sections(model: Optional[type[BaseModel]] = None, prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every section of the job config by its dotted path ("" for the top level)."""
    model = model or JobConfig
    found = {prefix: model}
    for name, field in model.model_fields.items():
        for member in _members(field.annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                found.update(_sections(member, f"{prefix}{field.alias or name}."))
    return found


def unknown_key_message(key: str, where: str, owner: type[BaseModel]) -> str:
    """`unknown key; did you mean 'max_num_seqs'?` for a typo of a key of this section, else the
    key's own section when it sits in another one (`max_tokens` under engine), else a looser
    match, else the keys this section takes."""
    typo = closest(key, _keys(owner), cutoff=0.8)
    if typo:
        return f"unknown key; did you mean {typo!r}?"
    elsewhere = [path + key for path, section in _sections().items() if key in _keys(section) and section is not owner]
    if elsewhere:
        return f"unknown key here; did you mean {elsewhere[0]!r}?"
    close = closest(key, _keys(owner))
    if close:
        return f"unknown key; did you mean {close!r}?"
    return f"unknown key; {where or 'the top level'} takes: {', '.join(_keys(owner))}"


def _error_line(err: dict) -> Optional[str]:
    parts, owner, _ = _locate(tuple(err["loc"]))
    path = ".".join(parts)
    if err["type"] == "extra_forbidden" and owner is not None:
        return f"{path}: {unknown_key_message(parts[-1], '.'.join(parts[:-1]), owner)}"
    if err["type"] == "missing":
        field = _field(owner, parts[-1]) if owner is not None else None
        about = f": {field.description}" if field is not None and field.description else ""
        return f"{path}: required, and not set{about}"
    message = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if not path or message.startswith(parts[0]):  # a rule across fields names them itself
        return message
    return f"{path}: {message}"


def config_error_lines(exc: ValidationError) -> list[str]:
    """One line per problem, each naming the field and what to do. A union's member that does not
    match what was given (an int where a mapping was written) is not reported beside the member
    that does."""
    errors = exc.errors()
    located = [(_locate(tuple(e["loc"])), e) for e in errors]
    section_paths = {tuple(parts[:-1]) for (parts, owner, scalar), _ in located if not scalar and owner is not None}
    lines: list[str] = []
    for (parts, owner, scalar), err in located:
        if scalar and isinstance(err.get("input"), dict) and tuple(parts) in section_paths:
            continue
        line = _error_line(err)
        if line and line not in lines:
            lines.append(line)
    return lines
