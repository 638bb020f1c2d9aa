"""Check configs back to plain mappings, so a runbook step's typed config can cross a process boundary.

`ground.typedconfig` parses durations ("30s", "500ms", "2m") into `timedelta` on the way in;
`to_mapping` writes them as text that it reads back exactly on the way out (to the worker process).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any


def format_duration(value: timedelta) -> str:
    """Text that `parse_duration` reads back exactly ("1.5s", "0.25s"); timedelta resolves microseconds."""
    text = f"{value.total_seconds():.6f}".rstrip("0").rstrip(".")
    return f"{text}s"


def to_mapping(config: Any) -> dict[str, Any]:
    """A config dataclass as a JSON-able mapping that `from_mapping` reads back into an equal config."""
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
