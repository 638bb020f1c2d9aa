"""A supervised run's directory, read for the pages: the attempts' journal (when each started and
ended, on which hosts, which rank ran where) and every rank's step records.

    <run_dir>/launcher/attempts.jsonl     start / ranks / end of each attempt (wire/journal.py)
    <run_dir>/ranks/<rank>.jsonl          one object per step of that rank, every attempt appended (train/)

Nothing here writes. Torn last lines (a rank killed mid-write) are skipped, as everywhere else (ground/jsonl.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ground.jsonl import read_jsonl
from wire.journal import End, Journal, Ranks
from wire.run_paths import RunPaths

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclass(frozen=True, slots=True)
class Attempt:
    number: int
    started_at: float
    ended_at: float | None
    nodes: tuple[str, ...]
    dp: int | None
    resume: str | None
    exit_codes: dict[str, int]
    stopped: bool | None
    ranks: int
    """How many ranks the launcher found running (0 when none started)."""
    rank_nodes: dict[int, str] = field(default_factory=dict)
    """The host of each rank (journals written before the launcher recorded it: empty)."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    rank: int
    step: int
    time: float
    """When the step ended (the rank's wall clock)."""
    step_seconds: float
    loss: float | None
    """None when the record has none; NaN stays NaN."""
    phases: dict[str, float]
    stage: int
    """The rank's pipeline stage (its mesh `pp` coordinate)."""
    node: str | None


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.paths = RunPaths(path)
        self._attempts: list[Attempt] | None = None
        self._records: dict[int, list[StepRecord]] = {}

    def exists(self) -> bool:
        return self.paths.journal.is_file()

    def job(self) -> str | None:
        """The job the run ran, from its journal."""
        return Journal.of(self.paths.journal).job()

    def attempts(self) -> list[Attempt]:
        if self._attempts is None:
            self._attempts = _attempts(Journal.of(self.paths.journal))
        return self._attempts

    def attempt(self, number: int | None) -> Attempt | None:
        return next((a for a in self.attempts() if a.number == number), None)

    def attempt_at(self, t: float) -> Attempt | None:
        """The attempt that had started last at time `t`."""
        started = [a for a in self.attempts() if a.started_at <= t]
        return max(started, key=lambda a: a.started_at) if started else None

    def rank_numbers(self) -> list[int]:
        return sorted(int(p.stem) for p in self.paths.ranks.glob("*.jsonl") if p.stem.isdigit())

    def records(self, rank: int) -> list[StepRecord]:
        """The rank's step records in the order written (redone steps appear again, after a restart)."""
        if rank not in self._records:
            self._records[rank] = [r for r in (_record(rank, e) for e in read_jsonl(self.paths.rank_records(rank)))
                                   if r is not None]
        return self._records[rank]

    def node_of(self, rank: int, attempt: Attempt | None) -> str | None:
        """The host `rank` ran on in `attempt`: the journal's, else what the rank's own records say."""
        if attempt is not None and rank in attempt.rank_nodes:
            return attempt.rank_nodes[rank]
        recs = self.records(rank)
        return recs[-1].node if recs else None


def find_run_dir(roots: list[Path], job: str) -> RunDir | None:
    """The run directory of `job` under one of `roots` (a run directory is named after its job, as `megaheal run`
    names it, and its journal must say the same job). NOTE: the job name comes from the database, where any
    heartbeat or alert may have put it: only a plain file name is looked up, never a path."""
    if not _JOB_NAME.match(job) or job in (".", ".."):
        return None
    for root in roots:
        run = RunDir(root / job)
        if run.exists() and run.job() == job:
            return run
    return None


# ---- parsing ----------------------------------------------------------------------------------------------------

def _attempts(past: Journal) -> list[Attempt]:
    out = []
    for start in sorted({s.attempt: s for s in past.starts}.values(), key=lambda s: s.attempt):
        events = past.of_attempt(start.attempt)
        end = next((e for e in events if isinstance(e, End)), None)
        pids: set[str] = set()
        rank_nodes: dict[int, str] = {}
        for e in events:
            if isinstance(e, Ranks):
                pids.update(e.ranks)
                rank_nodes.update({int(r): n for r, n in e.nodes.items() if r.isdigit()})
        out.append(Attempt(number=start.attempt, started_at=start.at, ended_at=end.at if end else None,
                           nodes=tuple(start.nodes), dp=start.dp, resume=start.resume,
                           exit_codes=dict(end.exit_codes) if end else {}, stopped=end.stopped if end else None,
                           ranks=len(pids), rank_nodes=rank_nodes))
    return out


def _record(rank: int, e: dict[str, Any]) -> StepRecord | None:
    try:
        loss = e.get("loss")
        return StepRecord(rank=rank, step=int(e["step"]), time=float(e["time"]),
                          step_seconds=float(e["step_seconds"]),
                          loss=float(loss) if isinstance(loss, (int, float)) or loss in ("NaN", "nan") else None,
                          phases={str(k): float(v) for k, v in (e.get("phases") or {}).items()
                                  if isinstance(v, (int, float)) and math.isfinite(v)},
                          stage=int((e.get("mesh") or {}).get("pp", 0)), node=e.get("node"))
    except (KeyError, TypeError, ValueError):
        return None  # not a step record (or one from an older trainer without timings)
