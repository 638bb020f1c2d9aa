"""The supervisor's journal of attempts, `<run_dir>/supervisor/attempts.jsonl`: when each attempt started (its hosts,
dp degree, agents and their start times) and ended, and which rank processes it had. The goodput ledger takes its
clock from it, and a healer that takes over a run finds there what the dead one left running.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from healer.jsonl import read_jsonl
from healer.launchers import kill
from megaheal import procfs


def path(run_dir: Path) -> Path:
    return run_dir / "supervisor" / "attempts.jsonl"


def last_start(run_dir: Path) -> dict[str, Any] | None:
    """The journal's newest attempt start (its nodes, dp and resume), or None."""
    starts = [e for e in read_jsonl(path(run_dir)) if e.get("event") == "start"]
    return starts[-1] if starts else None


def unfinished(run_dir: Path) -> int | None:
    """The number of the journal's last attempt when it has no end (its healer died while it ran), else None."""
    entries = [e for e in read_jsonl(path(run_dir)) if isinstance(e.get("attempt"), int)]
    if not entries:
        return None
    last = max(e["attempt"] for e in entries)
    return None if any(e["event"] == "end" for e in entries if e["attempt"] == last) else int(last)


def targets(entries: list[dict[str, Any]], run_id: str) -> list[kill.Target]:
    """The processes of one attempt that the journal names (its agents, its ranks and whatever they started) and
    that are still those processes: the run id, and the start time where the journal recorded one."""
    named: dict[int, float | None] = {}
    for e in entries:
        if e["event"] in ("start", "launched"):  # launched: each host's torchrun, as the coordinator started it
            started = e.get("agents_started") or {}
            named |= {pid: started.get(node) for node, pid in (e.get("agents") or {}).items() if isinstance(pid, int)}
        elif e["event"] == "ranks":
            started = e.get("started") or {}
            named |= {int(pid): started.get(pid) for pid in (e.get("ranks") or {}) if str(pid).isdecimal()}
    found = {t.pid: t for pid, at in named.items() if (t := kill.identify(pid, run_id, at)) is not None}
    for agent in list(found.values()):
        for pid in procfs.descendants(agent.pid):
            if pid not in found and (t := kill.identify(pid, run_id)) is not None:
                found[pid] = t
    return sorted(found.values(), key=lambda t: t.pid)
