"""The restarts of a supervised run, read back from its journals (incidents.jsonl, supervisor/attempts.jsonl):
one per `restarted` event of the self-heal loop, with what came of it.

A restart's outcome:
- recovered: its attempt reported a step (resumed_at, resumed_step: the incident's recovery);
- superseded: another attempt started before that (its attempt failed first, or a healer that took the run
  over restarted the job again);
- escalated: an incident of its attempt escalated (the job was stopped for a person);
- None: still waiting for the attempt's first step (or the run ended without one).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from healer.jsonl import read_jsonl


@dataclass(frozen=True, slots=True)
class RestartRecord:
    incident: int
    """The loop incident whose remediation it was."""
    requested_at: float
    """The incident's decision; for a second restart of one incident (a take-over), the restart itself."""
    restarted_at: float
    """When the new attempt was started."""
    from_step: int | None
    """The checkpoint step the new attempt resumes from."""
    nodes: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    resumed_at: float | None = None
    resumed_step: int | None = None
    outcome: str | None = None


def restarts(run_dir: Path) -> list[RestartRecord]:
    """Pure over the files: the run's restarts in the order they happened."""
    entries = [e for e in read_jsonl(run_dir / "incidents.jsonl")
               if isinstance(e.get("incident"), dict) and "id" in e["incident"]]
    starts = sorted((a["at"], a["attempt"]) for a in read_jsonl(run_dir / "supervisor" / "attempts.jsonl")
                    if a.get("event") == "start")
    latest = {e["incident"]["id"]: e["incident"] for e in entries}
    decided: dict[int, float] = {}
    out = []
    for e in entries:
        inc = e["incident"]
        if e["event"] == "decided":
            decided[inc["id"]] = e["at"]
        elif e["event"] == "restarted":
            plan = inc.get("plan") or {}
            record = RestartRecord(incident=inc["id"], requested_at=decided.pop(inc["id"], e["at"]),
                                   restarted_at=e["at"], from_step=inc.get("resume_step"),
                                   nodes=list(plan.get("nodes") or []), excluded=list(plan.get("exclude") or []))
            out.append(_outcome(record, latest, starts))
    return out


def _outcome(r: RestartRecord, latest: dict[int, dict[str, Any]], starts: list[tuple[float, int]]) -> RestartRecord:
    attempt = _attempt_at(starts, r.restarted_at)
    inc = latest[r.incident]
    recovered = inc.get("recovered_at")
    if recovered is not None and recovered >= r.restarted_at and _attempt_at(starts, recovered) == attempt:
        return replace(r, resumed_at=recovered, resumed_step=inc.get("first_step_after"), outcome="recovered")
    if any(at > r.restarted_at for at, _ in starts):
        return replace(r, outcome="superseded")
    if attempt is not None and any(i.get("state") == "escalated" and i.get("attempt") == attempt
                                   for i in latest.values()):
        return replace(r, outcome="escalated")
    return r


def _attempt_at(starts: list[tuple[float, int]], at: float) -> int | None:
    """The attempt running at `at`: the last one started by then."""
    i = bisect.bisect_right(starts, at, key=lambda s: s[0])
    return starts[i - 1][1] if i else None
