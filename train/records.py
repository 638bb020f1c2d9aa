"""Where each rank's step records go: one JSON object per line, and rank 0's readable table.

The JSON lines in `<run_dir>/ranks/<rank>.jsonl` are the trainer's own account of every
step; telemetry (a later layer) reads the same records but training never depends on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from wire.run_paths import RunPaths

# Columns of rank 0's table: (header, width, how to render one record).
_COLUMNS: list[tuple[str, int, Any]] = [
    ("step", 6, lambda r: f"{r['step']}"),
    ("loss", 8, lambda r: f"{r['loss']:.4f}"),
    ("gnorm", 7, lambda r: f"{r['grad_norm']:.3f}"),
    ("lr", 9, lambda r: f"{r['lr']:.2e}"),
    ("tok/s", 9, lambda r: f"{r['tokens_per_second']:.0f}"),
    ("step s", 7, lambda r: f"{r['step_seconds']:.3f}"),
    ("MFU %", 6, lambda r: f"{100 * r['mfu']:.2f}"),
    ("data", 6, lambda r: f"{r['phases'].get('data_wait', 0.0):.3f}"),
    ("fwd+bwd", 7, lambda r: f"{r['phases'].get('forward_backward', 0.0):.3f}"),
    ("pp-wait", 7, lambda r: f"{r['phases'].get('pp_wait', 0.0):.3f}"),
    ("dp-red", 6, lambda r: f"{r['phases'].get('dp_reduce', 0.0):.3f}"),
    ("clip", 6, lambda r: f"{r['phases'].get('grad_norm_clip', 0.0):.3f}"),
    ("optim", 6, lambda r: f"{r['phases'].get('optimizer', 0.0):.3f}"),
    ("ckpt", 6, lambda r: f"{r['phases'].get('checkpoint', 0.0):.3f}"),
]


class StepRecordWriter:
    """Appends one JSON line per step to this rank's file, flushed so a crash loses at most one step."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = RunPaths(run_dir).rank_records(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class StepTable:
    """Rank 0's live per-step table on stdout."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self._out = out
        self._printed_header = False

    def row(self, record: dict[str, Any]) -> None:
        if not self._printed_header:
            self._out.write(" ".join(h.rjust(w) for h, w, _ in _COLUMNS) + "\n")
            self._printed_header = True
        self._out.write(" ".join(fmt(record).rjust(w) for _, w, fmt in _COLUMNS) + "\n")
        self._out.flush()


def read_records(path: Path) -> list[dict[str, Any]]:
    """All step records of one rank file, naming the file and line of any malformed line."""
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a JSON step record: {exc.msg}") from exc
    return records
