"""Stored baselines: what a healthy machine measured, keyed by measurement key, in one JSON file.

`megaheal diagnose --calibrate` writes them; checks read them and fail a value below
`fraction x baseline` (0.9 like nccl-tests' expected-minimum rule). The file is per machine:
bandwidth depends on the hardware, so it lives in the user's state directory by default.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from wire.verdict import Measurement

VERSION = 1


def default_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "megaheal" / "baselines.json"


class BaselineStore:
    """Baselines read from and written to `path` (missing file: no baselines)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._values: dict[str, float] = {}
        if self.path is not None and self.path.is_file():
            data = json.loads(self.path.read_text())
            if data.get("version") != VERSION:
                raise ValueError(f"{self.path}: baseline file version {data.get('version')!r}, expected {VERSION}")
            self._values = {k: float(v["value"]) for k, v in data["baselines"].items()}

    def get(self, key: str) -> float | None:
        return self._values.get(key)

    def __len__(self) -> int:
        return len(self._values)

    def update(self, runs: list[list[Measurement]]) -> dict[str, float]:
        """Store, for each key measured in `runs`, the median over the runs; returns what was stored."""
        if self.path is None:
            raise ValueError("no baseline file configured")
        by_key: dict[str, list[float]] = {}
        for run in runs:
            for m in run:
                if m.key is not None:
                    by_key.setdefault(m.key, []).append(m.value)
        stored = {key: statistics.median(values) for key, values in by_key.items()}
        existing = {}
        if self.path.is_file():
            existing = json.loads(self.path.read_text())["baselines"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for key, value in stored.items():
            existing[key] = {"value": value, "runs": len(by_key[key]), "measured_at": now}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Written to a temporary file and renamed, so a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".baselines-")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "baselines": existing}, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self.path)
        self._values.update(stored)
        return stored


def below_baseline(value: float, baseline: float | None, fraction: float) -> bool:
    """True when a higher-is-better `value` is under `fraction` x `baseline` (False without a baseline)."""
    return baseline is not None and value < fraction * baseline
