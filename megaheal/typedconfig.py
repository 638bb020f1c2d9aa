"""Typed configs from plain mappings (YAML, --set overrides), with unknown keys as errors.

Every component owns a `@dataclass(kw_only=True, slots=True)` config and checks its own
values in `__post_init__`. This module only turns nested mappings into those dataclasses,
checking key names and value types, so a typo in a YAML key or a wrong type is reported
with the dotted path of the offending key instead of being silently dropped.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names where."""


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    """Build dataclass `cls` from `data`; `where` names the source (file and key path)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}: {exc}") from exc


def _coerce(hint: Any, value: Any, where: str) -> Any:
    """Check `value` against the type hint `hint`, converting only where it is lossless."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, where)
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
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
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


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`, naming the file in every error."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
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
