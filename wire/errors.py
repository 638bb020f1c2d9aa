"""Why bytes do not fit the wire schema, in words: the offending field and what it should have been.

msgspec says where decoding failed as a path (`$.ranks[3].alive`) and what it expected in its own type
names ("Expected `bool`, got `int`"). Where the field's type carries a description (`Meta(description=...)`
in wire/telemetry.py) the reason is told with it instead, e.g. ("ranks[3].alive", "expected true or false,
got an integer"), so that whoever reads a 400 or a sidecar's log sees what to send, not a regular expression
or a float bound. Everything else keeps msgspec's own words.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import msgspec
from msgspec import inspect as mi

_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_GOT = re.compile(r", got `(?P<got>\w+)`$")
_STEP = re.compile(r"\.(?P<name>\w+)|\[(?P<index>[^\]]*)\]")
_MALFORMED = re.compile(r"^JSON is malformed: (?P<why>.*) \(byte (?P<pos>\d+)\)$")
_LIMITS = ("gt", "ge", "lt", "le", "multiple_of", "min_length", "max_length", "pattern")
_KINDS: dict[type, str] = {mi.StrType: "a string", mi.IntType: "an integer", mi.FloatType: "a number",
                           mi.BoolType: "true or false", mi.NoneType: "null", mi.ListType: "a list",
                           mi.DictType: "an object", mi.StructType: "an object"}
_GOT_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "null": "null",
              "array": "a list", "object": "an object", "bytes": "bytes"}


class SchemaError(ValueError):
    """Bytes or an object that are not a valid record of a known schema version. `field` names the offending
    part as a path ("ranks[3].alive"; "" for the whole record), `reason` says what is wrong with it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.reason = field, reason


def explain(exc: msgspec.ValidationError, root: Any) -> SchemaError:
    """The SchemaError for `exc`, raised while decoding (or converting) into the type `root`."""
    match = _AT.match(str(exc))
    what, path = (match["what"], match["path"] or "") if match else (str(exc), "")
    if missing := _MISSING.match(what):
        field = f"{path}.{missing['name']}".lstrip(".")
        expected = describe(root, field)
        return SchemaError(field, f"missing: expected {expected}" if expected else "missing")
    field = path.lstrip(".")
    expected = describe(root, field)
    if expected is None:
        return SchemaError(field, what[:1].lower() + what[1:])
    got = _GOT.search(what)
    return SchemaError(field, f"expected {expected}" + (f", got {_GOT_WORDS.get(got['got'], got['got'])}" if got else ""))


def json_syntax_error(data: bytes, exc: msgspec.DecodeError) -> SchemaError:
    """The SchemaError for bytes that are not JSON at all, with the line and column where it went wrong."""
    try:
        data.decode()
    except UnicodeDecodeError as bad:
        return SchemaError("", f"not UTF-8: {bad.reason}")
    if malformed := _MALFORMED.match(str(exc)):
        pos = int(malformed["pos"])
        line, column = data.count(b"\n", 0, pos) + 1, pos - data.rfind(b"\n", 0, pos)
        return SchemaError("", f"invalid JSON at line {line} column {column}: {malformed['why']}")
    return SchemaError("", f"invalid JSON: {str(exc)[:1].lower() + str(exc)[1:]}")


def describe(root: Any, field: str) -> str | None:
    """The description of the type at `field` (a path as `explain` names it) under `root`, if it has one. Every
    member of a union is followed (the `body` of a rank record is a hello, a step or an event body)."""
    nodes: list[mi.Type] = [_info(root)]
    for step in _STEP.finditer(field if field.startswith("[") else f".{field}" if field else ""):
        nodes = [child for node in nodes for child in _children(node, step["name"])]
    return next((d for d in map(_description, nodes) if d is not None), None)


@functools.cache
def _info(root: Any) -> mi.Type:
    return mi.type_info(root)


def _alternatives(node: mi.Type) -> list[mi.Type]:
    """The concrete types `node` may be: through descriptions and the members of unions."""
    if isinstance(node, mi.Metadata):
        return _alternatives(node.type)
    if isinstance(node, mi.UnionType):
        return [alt for member in node.types for alt in _alternatives(member)]
    return [node]


def _children(node: mi.Type, name: str | None) -> list[mi.Type]:
    """The types one step down: a struct's field by its wire name, or (name None) a list's item or a dict's value."""
    found: list[mi.Type] = []
    for alt in _alternatives(node):
        if name is not None and isinstance(alt, mi.StructType):
            found += [f.type for f in alt.fields if f.encode_name == name]
        elif name is None and isinstance(alt, mi.ListType):
            found.append(alt.item_type)
        elif name is None and isinstance(alt, mi.DictType):
            found.append(alt.value_type)
    return found


def _description(node: mi.Type) -> str | None:
    """A field type in words: its own description, else its kind ("a string or null"). None for a constrained
    type without a description: its kind alone would hide the limit it broke, msgspec's words do not."""
    if isinstance(node, mi.Metadata):
        described = (node.extra_json_schema or {}).get("description")
        return described if isinstance(described, str) else _description(node.type)
    if isinstance(node, mi.UnionType):
        members = sorted(node.types, key=lambda t: isinstance(t, mi.NoneType))  # "... or null", null last
        named = [_description(t) for t in members]
        return None if None in named else " or ".join(d for d in named if d)
    if isinstance(node, mi.LiteralType):
        return " or ".join(map(repr, node.values))
    if any(getattr(node, limit, None) is not None for limit in _LIMITS):
        return None
    return _KINDS.get(type(node))
