"""Hypothesis strategies the fuzz tests share: YAML-shaped values, documents and text, and the mutation of a valid
document at one key path."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from hypothesis import strategies as st

# Scalars as YAML and the typed loaders meet them: what a person types, and what breaks naive code (NaN, infinities,
# huge integers, dates, durations, empty and odd text).
scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30)
           | st.sampled_from(["30s", "500ms", "2m", "1h", "7d", "1e-4", "1e400", "-0", "2024-06-01", "nan", ".inf",
                              "99999999999999999999999d", "auto", "cpu", "cuda", "bf16", "fp32", "adamw", "lamb"]))
# NOTE: mapping keys may be numbers, booleans or null beside text, as YAML allows.
keys = st.text(max_size=12) | st.integers(-5, 5) | st.booleans() | st.none()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(keys, inner, max_size=4), max_leaves=20)

# Text that YAML reads into something unusual: anchors and aliases (recursive data), tags, flow collections left
# open, dates the calendar does not have, and deep nesting.
YAML_TRICKS = ["&a [*a]", "&a {x: *a}", "!!python/object:os.system {}", "!!binary AAAA", "[1, 2", "{a: 1",
               "2024-02-30", "2024-06-01 25:61:00", "? [a]\n: b", "\x00", "\ufeff", "'unterminated", '"\\xZZ"',
               "[" * 2000 + "]" * 2000, "{a: " * 500 + "1" + "}" * 500, "- - - - -", "*undefined", "!!int x",
               "0b102", "0x", "0o9", "1_000", "~", "null", "", " ", "---\n---", "%YAML 9.9\n---\nx"]
yaml_text = st.sampled_from(YAML_TRICKS) | st.text(max_size=200)


def dump(value: Any) -> str:
    return yaml.safe_dump(value, allow_unicode=True, sort_keys=False)


@st.composite
def mutated(draw: st.DrawFn, document: dict[str, Any]) -> dict[str, Any]:
    """`document` with one value, at any depth, replaced by anything, or removed, or a key added beside it."""
    doc = copy.deepcopy(document)
    node: Any = doc
    while True:
        if isinstance(node, list) and node:
            key: Any = draw(st.integers(min_value=0, max_value=len(node) - 1))
        elif isinstance(node, dict) and node:
            key = draw(st.sampled_from(sorted(node, key=str)))
        else:
            return doc
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or draw(st.booleans()):
            break
        node = child
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete":
        del node[key]
    elif action == "add" and isinstance(node, dict):
        node[draw(keys)] = draw(values)
    else:
        node[key] = draw(values)
    return doc
