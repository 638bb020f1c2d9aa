"""Reading the append-only JSON-lines journals a supervised run leaves on disk (incidents, attempts, the ranks'
step records), for the goodput ledger and for a healer that takes a run over.

Every writer appends one object per line; a process killed while writing leaves its last line cut short.
Such a line (or anything that is not a JSON object) is skipped: the lines before and after it still count,
and the next append starts on a line of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every object in `path`, in order; [] when the file does not exist (yet)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def append_jsonl(path: Path, entry: dict[str, Any]) -> None:
    """Append `entry` as one line; after a line cut short (no newline at the end), on a fresh line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        f.seek(0, 2)
        torn = False
        if f.tell() > 0:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + (json.dumps(entry, default=str) + "\n").encode())
