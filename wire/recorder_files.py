"""The files through which a node agent asks a rank for its flight recorder's dump (exporters/flight_recorder.py answers):
`<pid>.fr-request` in the phase directory (wire/phase_now.py), created by the asker, and `<pid>.fr.json`, the answer,
written whole by the rank (a temporary file renamed over it)."""

from __future__ import annotations

from pathlib import Path


def request_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.fr-request"


def answer_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.fr.json"
