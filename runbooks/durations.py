"""Durations in runbook YAML: "30s", "500ms", "2m", "1h" (or a bare number of seconds) as `timedelta`.

`megaheal.typedconfig` checks key names and plain types; it has no notion of durations. Before a
mapping goes to `from_mapping`, `coerce_durations` converts the values of every field typed
`timedelta` (also nested dataclasses and `timedelta | None`), so the dataclasses themselves only
ever hold `timedelta`s. A value that is not a duration is left alone for typedconfig to reject
with the file and key in the message.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from datetime import timedelta
from typing import Any

from megaheal.typedconfig import ConfigError

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")


def parse_duration(value: Any, where: str) -> timedelta:
    """A duration from "30s", "500ms", "2m", "1h", a number of seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    raise ConfigError(f"{where}: expected a duration such as 30s, 500ms, 2m or 1h, got {value!r}")


def format_duration(value: timedelta) -> str:
    """Text that `parse_duration` reads back exactly ("1.5s", "0.25s"); timedelta resolves microseconds."""
    text = f"{value.total_seconds():.6f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _is_timedelta(hint: Any) -> bool:
    if hint is timedelta:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return timedelta in typing.get_args(hint)
    return False


def coerce_durations(cls: type, data: Any, where: str) -> Any:
    """A copy of mapping `data` for dataclass `cls` with duration-typed values turned into timedelta."""
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    out = copy.copy(data)  # keeps the mapping's type: a loader may record key lines on it
    for f in dataclasses.fields(cls):
        if f.name not in out:
            continue
        hint = hints[f.name]
        value = out[f.name]
        if _is_timedelta(hint) and value is not None:
            out[f.name] = parse_duration(value, f"{where}.{f.name}")
        elif dataclasses.is_dataclass(hint):
            out[f.name] = coerce_durations(hint, value, f"{where}.{f.name}")
    return out


def to_mapping(config: Any) -> dict[str, Any]:
    """A config dataclass as a JSON-able mapping that `coerce_durations` + `from_mapping` read back."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        if isinstance(value, timedelta):
            value = format_duration(value)
        elif dataclasses.is_dataclass(value):
            value = to_mapping(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out
