"""Hypothesis strategies for what arrives over HTTP: any JSON value (big integers, NUL characters, deep-ish
nesting, long strings included), and a valid document with some of its values replaced by such values."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

# NOTE: text that PostgreSQL, the columns or a naive parser trip on, mixed into Hypothesis' own text.
NASTY_TEXT = st.sampled_from(["", "\x00", "a\x00b", "x" * 201, "y" * 300, "²", "١", "NaN", "-1", "9" * 5000,
                              "\u2028", "\ud7ff\ue000", "../../etc/passwd", "$(reboot)", "`id`"])
TEXT = st.one_of(st.text(max_size=40), NASTY_TEXT)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)

# Nesting deep enough to exhaust a recursive decoder's stack, bare or where a decoder skips an unknown field.
DEEP = st.tuples(st.integers(0, 200_000), st.sampled_from([b"%s", b'{"schema": 1, "version": "4", "x": %s}'])).map(
    lambda case: case[1] % (b"[" * case[0] + b"]" * case[0]))


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `doc` (keys of objects, indexes of lists), the root excluded."""
    found: list[tuple[Any, ...]] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for key, value in items:
        found.append((*prefix, key))
        found += paths(value, (*prefix, key))
    return found


@st.composite
def mutated(draw: st.DrawFn, valid: Any, max_changes: int = 3) -> tuple[Any, int]:
    """`valid` (a JSON document) with up to `max_changes` values replaced or removed; (document, changes made)."""
    doc = copy.deepcopy(valid)
    changes = draw(st.integers(0, max_changes))
    for _ in range(changes):
        targets = paths(doc)
        if not targets:
            break
        *parent_path, key = draw(st.sampled_from(targets))
        parent = doc
        for step in parent_path:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[key]
        else:
            parent[key] = draw(JSON)
    return doc, changes
