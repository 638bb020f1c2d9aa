"""What the attempts' journal (wire/journal.py) names of an attempt's processes, found again on this machine: the
processes a healer that takes a run over may stop, because the journal says the dead healer's launcher started them
and they are still those processes."""

from __future__ import annotations

from ground import kill, procfs
from wire.journal import Event, Launched, Ranks


def targets(events: list[Event], run_id: str) -> list[kill.Target]:
    """The processes of one attempt that the journal names (its agents, its ranks and whatever they started) and
    that are still those processes: the run id, and the start time where the journal recorded one."""
    named: dict[int, float | None] = {}
    for e in events:
        if isinstance(e, Launched):  # each host's torchrun, as the coordinator started it
            named |= {pid: e.agents_started.get(node) for node, pid in e.agents.items() if isinstance(pid, int)}
        elif isinstance(e, Ranks):
            named |= {int(pid): e.started.get(pid) for pid in e.ranks if pid.isdecimal()}
    found = {t.pid: t for pid, at in named.items() if (t := kill.identify(pid, run_id, at)) is not None}
    for agent in list(found.values()):
        for pid in procfs.descendants(agent.pid):
            if pid not in found and (t := kill.identify(pid, run_id)) is not None:
                found[pid] = t
    return sorted(found.values(), key=lambda t: t.pid)
