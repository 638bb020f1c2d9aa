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
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
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


def _origin(data: Mapping[Any, Any], key: Any) -> str:
    """Where the value of `key` came from: " (from --set ITEM)" for a command-line override, else its line."""
    item = getattr(data.get(key), "item", None) if key is not None else None
    return f" (from --set {_shown(item)})" if isinstance(item, str) else line_of(data, key)


def _origin_of(data: Mapping[Any, Any], dotted: str) -> str:
    """_origin of the value a dotted key path names, as deep as the mappings go (the mapping's line if none)."""
    node, key = data, None
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part not in node:
            break
        key, child = part, node[part]
        if i + 1 == len(parts) or not isinstance(child, Mapping) or parts[i + 1] not in child:
            break
        node, key = child, None
    return _origin(node, key)


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
            + _origin(data, unknown[0])
        )
    kwargs = {name: _coerce(hints[name], value, f"{where}.{name}", line_of(data, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # NOTE: __post_init__ messages start with the field they are about ("severity must be ...", or a dotted path
        # into a nested section, "model.norm_eps must be ..."): point at where its value came from.
        raise ConfigError(f"{where}: {exc}{_origin_of(data, str(exc).split(' ', 1)[0].rstrip(':'))}") from exc


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
    raise ConfigError(f"{where}: expected a duration such as 30s, 500ms, 2m, 1h or 7d, got {_shown_value(value)}")


def _seconds(seconds: float, given: Any, where: str) -> timedelta:
    try:
        return timedelta(seconds=seconds)
    except (OverflowError, ValueError):  # NaN, infinities, or past timedelta's 999,999,999 days
        raise ConfigError(
            f"{where}: expected a finite duration shorter than 999,999,999 days, got {_shown_value(given)}"
        ) from None


def _coerce(hint: Any, value: Any, where: str, line: str = "") -> Any:
    """Check `value` against the type hint `hint`, converting only where it is lossless.

    `line` is " (line N)" of the key that holds `value`, when known, appended to errors about it."""
    if isinstance(value, Override):
        # The file's line of the key says nothing about a value given on the command line: name the item instead.
        try:
            return _coerce_value(hint, value, where, "")
        except ConfigError as exc:
            if f"--set {_shown(value.item)}" in str(exc):
                raise
            raise ConfigError(f"{exc} (from --set {_shown(value.item)})") from exc
    try:
        return _coerce_value(hint, value, where, line)
    except ConfigError as exc:
        if line and "(line " not in str(exc) and "(from --set " not in str(exc):
            raise ConfigError(f"{exc}{line}") from exc
        raise


def _coerce_value(hint: Any, value: Any, where: str, line: str) -> Any:
    if isinstance(value, Override):
        value = value.resolve(hint)
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
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {_shown_value(value)} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_shown_value(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]", line_of(v) or line) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]", line_of(v) or line) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {_shown_value(value)}")
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
    raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {_shown_value(value)}")


def read_yaml(path: str | Path) -> Any:
    """Read any YAML document from `path` (mappings as `LineDict`s), naming the file in every error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    try:
        return yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {_yaml_problem(exc)}") from exc
    # NOTE: ValueError: a date YAML recognises that the calendar has not (2024-02-30); RecursionError: PyYAML
    # recurses once per nesting level.
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid YAML value: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from exc


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line, where in the file first: `invalid YAML at line 3, column 9: expected ',' or '}', but
    got ':' (in a flow mapping that starts at line 2, column 9)`. Its own text names "<unicode string>" instead of
    the file and runs over several lines, with the offending line quoted."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"invalid YAML: {' '.join(str(exc).split())}"
    mark = exc.problem_mark
    text = f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {exc.problem or 'cannot parse'}"
    verb, _, context = (exc.context or "").removeprefix("while ").partition(" ")
    if verb in ("parsing", "scanning") and not context.startswith("for "):  # "scanning for the next token": no place
        context = f"in {context}"
        where = exc.context_mark
        text += f" ({context}" + (f" that starts at line {where.line + 1}, column {where.column + 1})"
                                  if where is not None and where.line != mark.line else ")")
    return text


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
    """Apply `key.sub=value` strings to a nested mapping. Each value is kept as an `Override`: read as YAML for a
    field that is not a string (steps=6, model.window=null, skip_steps=[3, 4]), taken as typed for one that is
    (job=2024-06-01 stays that text, where YAML would make it a date)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {_shown(item)}: expected KEY=VALUE, e.g. steps=6 or parallel.dp=2")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, _OverrideMapping(item))
            if isinstance(child, Override):  # a whole section set before (parallel={dp: 2}): go on inside it
                child = node[part] = child.section()
            if not isinstance(child, dict):
                raise ConfigError(f"--set {_shown(item)}: {part!r} is not a section")
            node = child
        node[parts[-1]] = Override(item, raw)
    return data


# ---- --set values: typed by the field they set --------------------------------------------------------------


class Override:
    """One `--set` value, its text kept as typed until the type of the field it sets is known (see `resolve`).

    NOTE: reading every value as YAML up front is what made `--set job=2024-06-01` a date, `job=123` an int and
    `job=yes` a bool: the text is only read as YAML where the field wants something other than text."""

    __slots__ = ("item", "raw")

    def __init__(self, item: str, raw: str | None) -> None:
        self.item, self.raw = item, raw

    def __repr__(self) -> str:
        return f"Override({_shown(self.item)})"

    def resolve(self, hint: Any) -> Any:
        """The value for a field of type `hint`. A string field takes a YAML scalar's text (quotes are YAML's; None
        for `null`, `~` or nothing when the field may be unset), or the text as typed when YAML reads something else
        into it (`0:` is a mapping to YAML). Sequences and mappings are resolved item by item; anything else is what
        YAML reads."""
        # NOTE: an item of a sequence or mapping has no text of its own to fall back on (raw is None).
        wants_str = _accepts(hint, lambda h: h is str)
        as_typed = wants_str and self.raw is not None
        try:
            node = self.node()
        except ConfigError:
            if as_typed:
                return self.raw
            raise
        if isinstance(node, yaml.ScalarNode) and wants_str:
            if node.tag == "tag:yaml.org,2002:null" and _accepts(hint, lambda h: h is type(None)):
                return None
            return node.value
        if isinstance(node, yaml.SequenceNode) and _accepts(hint, lambda h: typing.get_origin(h) in (list, tuple)):
            return [_Child(self.item, child) for child in node.value]
        if isinstance(node, yaml.MappingNode) and _accepts(
                hint, lambda h: dataclasses.is_dataclass(h) or typing.get_origin(h) is dict):
            return _override_mapping(self.item, node)
        if as_typed:
            return self.raw
        return _construct(self.item, node)

    def node(self) -> yaml.Node:
        try:
            node = yaml.compose(self.raw or "", Loader=yaml.SafeLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {_shown(self.item)}: value is not valid YAML: {exc}") from exc
        except RecursionError as exc:  # PyYAML's composer recurses once per nesting level
            raise ConfigError(f"--set {_shown(self.item)}: value is nested too deeply") from exc
        # Nothing after "=": YAML's null (or, for a string field, the empty text: see resolve).
        return node if node is not None else yaml.ScalarNode("tag:yaml.org,2002:null", "")

    def section(self) -> Any:
        """This value as a section that later items set keys in, when it is a mapping; else itself."""
        try:
            node = self.node()
        except ConfigError:
            return self
        return _override_mapping(self.item, node) if isinstance(node, yaml.MappingNode) else self


class _Child(Override):
    """An item of a sequence or mapping given on the command line: already a YAML node."""

    __slots__ = ("_node",)

    def __init__(self, item: str, node: yaml.Node) -> None:
        super().__init__(item, None)
        self._node = node

    def node(self) -> yaml.Node:
        return self._node


class _OverrideMapping(dict):  # type: ignore[type-arg]
    """A section given on the command line; `item` names the `--set` it came from."""

    __slots__ = ("item",)

    def __init__(self, item: str) -> None:
        super().__init__()
        self.item = item


def _override_mapping(item: str, node: yaml.MappingNode) -> dict[Any, Any]:
    out = _OverrideMapping(item)
    for key_node, value_node in node.value:
        key = _construct(item, key_node)
        if not isinstance(key, typing.Hashable):
            raise ConfigError(f"--set {_shown(item)}: a mapping key must be a plain value, got {_shown_value(key)}")
        out[key] = _Child(item, value_node)
    return out


def _construct(item: str, node: yaml.Node) -> Any:
    try:
        return yaml.SafeLoader("").construct_document(node)
    # NOTE: ValueError: a date YAML recognises but the calendar has not (2024-02-30).
    except (yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"--set {_shown(item)}: value is not valid YAML: {exc}") from exc


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 8


def _shown_value(value: Any) -> str:
    """A value as errors quote it: bounded in size and depth, so a huge or self-referencing one (YAML aliases can
    build either) cannot flood or hang the message."""
    return _REPR.repr(value)


def _shown(item: str) -> str:
    """A `--set` item as errors quote it: cut short, so a huge value cannot flood the message."""
    return repr(item if len(item) <= 80 else item[:77] + "...")


def _accepts(hint: Any, test: Callable[[Any], bool]) -> bool:
    """Whether `hint`, or one of the types of a union `hint`, passes `test`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(test(a) for a in typing.get_args(hint))
    return bool(test(hint))
