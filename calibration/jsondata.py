"""Dataclasses stored as JSON (profiles, efficiencies): one strict loader, so a typo'd or missing field
is an error that names it instead of a silent default."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, TypeVar

T = TypeVar("T")


def to_json(obj: Any) -> str:
    return json.dumps(dataclasses.asdict(obj), indent=2, sort_keys=True) + "\n"


def read_json(path: pathlib.Path, error: type[Exception] = ValueError) -> Any:
    """The file's JSON; a syntax error is ``error`` naming the file and line (an OSError stays one, for
    the caller to word)."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None


def from_dict(cls: type[T], data: Any, source: str, what: str) -> T:
    """``cls(**data)`` after checking ``data`` is an object with no unknown and no missing required field."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: {what} must be a JSON object")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"{source}: unknown {what} field(s) {unknown}")
    missing = sorted(f.name for f in fields if f.name not in data
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{source}: missing {what} field(s) {missing}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None
