"""Typed configs from plain mappings (YAML, --set overrides), with unknown keys as errors.

Every component owns a `@dataclass(kw_only=True, slots=True)` config and checks its own
values in `__post_init__`. This module only turns nested mappings into those dataclasses,
checking key names and value types, so a typo in a YAML key or a wrong type is reported
with the dotted path of the offending key instead of being silently dropped.

YAML read here keeps the line of every key (`LineDict`), so errors about a file's content also
say "(line N)". Durations ("30s", "500ms", "2m", "1h", or seconds) load into `timedelta` fields.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names where."""


class LineDict(dict):  # type: ignore[type-arg]
    """A YAML mapping that remembers where it is: `line` of the mapping, `key_lines` of each key (1-based)."""

    __slots__ = ("line", "key_lines")

    def __init__(self, *args: Any, line: int | None = None, key_lines: dict[Any, int] | None = None) -> None:
        super().__init__(*args)
        self.line = line
        self.key_lines = key_lines or {}


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings are `LineDict`s."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> LineDict:  # type: ignore[override]
        plain = super().construct_mapping(node, deep=deep)
        key_lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable):
                key_lines[key] = key_node.start_mark.line + 1
        return LineDict(plain, line=node.start_mark.line + 1, key_lines=key_lines)


def _construct_line_dict(loader: _LineLoader, node: yaml.MappingNode) -> Any:
    # NOTE: a generator like SafeConstructor's own, so anchors and aliases (recursive data) still resolve.
    data = LineDict(line=node.start_mark.line + 1)
    yield data
    built = loader.construct_mapping(node)
    data.update(built)
    data.key_lines = built.key_lines


_LineLoader.add_constructor("tag:yaml.org,2002:map", _construct_line_dict)
# LineDicts dump like the plain mappings they are.
yaml.SafeDumper.add_representer(LineDict, yaml.representer.SafeRepresenter.represent_dict)


def line_of(data: Any, key: Any = None) -> str:
    """" (line N)" for `key` of a LineDict (or the mapping itself when key is None); "" when unknown."""
    if not isinstance(data, LineDict):
        return ""
    line = data.line if key is None else data.key_lines.get(key, data.line)
    return f" (line {line})" if line else ""


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    """Build dataclass `cls` from `data`; `where` names the source (file and key path)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(sorted(fields))}"
            + line_of(data, unknown[0])
        )
    kwargs = {name: _coerce(hints[name], value, f"{where}.{name}", line_of(data, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # NOTE: __post_init__ messages start with the field they are about ("severity must be ..."): point at its line.
        about = next((k for k in data if isinstance(k, str) and str(exc).startswith((f"{k} ", f"{k}:"))), None)
        raise ConfigError(f"{where}: {exc}{line_of(data, about)}") from exc


_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")


def parse_duration(value: Any, where: str) -> timedelta:
    """A duration from "30s", "500ms", "2m", "1h", "7d", a number of seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _seconds(value, value, where)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return _seconds(float(match.group(1)) * _UNITS[match.group(2)], value, where)
    raise ConfigError(f"{where}: expected a duration such as 30s, 500ms, 2m, 1h or 7d, got {value!r}")


def _seconds(seconds: float, given: Any, where: str) -> timedelta:
    try:
        return timedelta(seconds=seconds)
    except (OverflowError, ValueError):  # NaN, infinities, or past timedelta's 999,999,999 days
        raise ConfigError(f"{where}: expected a finite duration shorter than 999,999,999 days, got {given!r}") from None


def _coerce(hint: Any, value: Any, where: str, line: str = "") -> Any:
    """Check `value` against the type hint `hint`, converting only where it is lossless.

    `line` is " (line N)" of the key that holds `value`, when known, appended to errors about it."""
    try:
        return _coerce_value(hint, value, where, line)
    except ConfigError as exc:
        if line and "(line " not in str(exc):
            raise ConfigError(f"{exc}{line}") from exc
        raise


def _coerce_value(hint: Any, value: Any, where: str, line: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce_value(option, value, where, line)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]", line_of(v) or line) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]", line_of(v) or line) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_hint, value_hint = args if args else (Any, Any)
        return {_coerce_value(key_hint, k, f"{where} key", line): _coerce(value_hint, v, f"{where}.{k}", line_of(value, k))
                for k, v in value.items()}
    if hint is Any:
        return value
    if hint is timedelta:
        return parse_duration(value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # NOTE: PyYAML reads "1e-4" (no dot) as a string; accept it as the float it means.
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(hint, type) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def read_yaml(path: str | Path) -> Any:
    """Read any YAML document from `path` (mappings as `LineDict`s), naming the file in every error."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`, naming the file in every error."""
    path = Path(path)
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` strings to a nested mapping; values are parsed as YAML scalars."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. steps=6 or parallel.dp=2")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: value is not valid YAML: {exc}") from exc
    return data
