"""Node history across jobs: which nodes were named in incidents, so a node that keeps failing (a lemon) is
left out of the next job on sight instead of being rediscovered at the cost of another incident.

One JSON file shared by every healer on the host (default `$XDG_STATE_HOME/megaheal/node-history.json`),
read and rewritten under an exclusive flock, replaced atomically (temp file, fsync, rename), so two healers
finishing incidents at once lose nothing. Entries older than `keep` are dropped on each write.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any


def default_path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "megaheal" / "node-history.json"


@dataclass(frozen=True, slots=True)
class NodeEvent:
    node: str
    job: str
    kind: str
    incident: int
    at: datetime

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "job": self.job, "kind": self.kind, "incident": self.incident,
                "at": self.at.isoformat()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeEvent:
        return cls(node=str(d["node"]), job=str(d["job"]), kind=str(d["kind"]), incident=int(d["incident"]),
                   at=datetime.fromisoformat(d["at"]))


class NodeHistory:
    def __init__(self, path: Path | None = None, keep: timedelta = timedelta(days=30)) -> None:
        self.path = path or default_path()
        self.keep = keep

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> list[NodeEvent]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except json.JSONDecodeError as exc:
            # A torn or hand-edited file must not stop remediation; say so and start a new history.
            raise ValueError(f"{self.path}: not valid JSON ({exc}); move it away to start a new node history") from exc
        return [NodeEvent.from_json(d) for d in data.get("events", [])]

    def record(self, events: list[NodeEvent], now: datetime | None = None) -> None:
        now = now or datetime.now(UTC)
        with self._locked():
            kept = [e for e in self._read() if now - e.at < self.keep]
            seen = {(e.node, e.job, e.incident) for e in kept}
            kept += [e for e in events if (e.node, e.job, e.incident) not in seen]
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".node-history.")
            with os.fdopen(fd, "w") as f:
                json.dump({"events": [e.to_json() for e in kept]}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def counts(self, since: datetime) -> dict[str, int]:
        """Per node, the incidents (distinct job, incident) naming it since `since`."""
        with self._locked():
            events = self._read()
        out: dict[str, int] = {}
        for e in events:
            if e.at >= since:
                out[e.node] = out.get(e.node, 0) + 1
        return out
