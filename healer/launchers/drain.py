"""Draining the hosts a restart leaves out, when the run allows it (`megaheal run --drain`, on by default under
Slurm): a host that failed its diagnosis, a host lost (silent while its peers stopped), or a lemon, is kept out of every other job's way too, with the incident
as the reason (`sinfo -R`: "megaheal: incident 7: crash (failed node-health: disk: ...)"). A host left out for
any other reason (a rule that excludes the suspects of a fault on sight) is not drained: nothing proved it bad.

The reason is built here from the incident's kind and the verdict of megaheal's own runbook, then cut to a safe
alphabet; it is an argument of scontrol, never a shell's. What happened goes into the incident's evidence
(`drain`: per host, the reason given, whether it was drained, and why not), an event of its timeline.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ground.slurm import SlurmError, safe_reason
from healer.decide.catalogue import fault
from healer.incidents.store import IncidentStore
from healer.incidents.timeline import IncidentTimeline, job_timelines
from healer.launchers.fleet import AgentFleet
from wire.verdict import Status

log = logging.getLogger(__name__)
WHY_MAX = 100


def drain_reason(incident_id: int, kind: str, why: str) -> str:
    """"megaheal: incident N: KIND (WHY)", in the alphabet a drain reason may hold."""
    why = safe_reason(why)
    if len(why) > WHY_MAX:
        why = why[:WHY_MAX - 3].rstrip() + "..."
    return safe_reason(f"megaheal: incident {incident_id}: {kind} ({why})")


def proven_bad(timeline: IncidentTimeline, node: str) -> str | None:
    """Why the incident proved `node` bad (its diagnosis failed, it was lost, or it is a lemon), in a few words; None when it
    did not."""
    for host in timeline.diagnosis:
        if isinstance(host, dict) and host.get("node") == node and host.get("status") == Status.FAIL.value:
            return f"failed diagnosis: {host.get('summary') or 'no summary'}"
    if fault(timeline.kind).drains_suspects and node in timeline.suspect_nodes:
        # Silent while its peers stopped: dead, cut off or its agent unable to run; nothing should land on it until
        # someone has looked (Slurm marks a host DOWN only when its slurmd is gone too, not when a link is).
        silent = timeline.evidence.get("silent_s")
        return f"host lost: silent {silent:.0f} s" if isinstance(silent, (int, float)) else "host lost"
    lemons = ((timeline.plan or {}).get("decision_basis") or {}).get("lemons") or {}
    if node in lemons:
        return f"lemon: named in {lemons[node]} incidents"
    return None


class Drainer:
    """Drains, through the launcher, the hosts an incident's restart left out and proved bad (when `drain`), and
    records in the incident what the scheduler says of every host it left out (`slurm`: state and reason), drained
    or not."""

    def __init__(self, fleet: AgentFleet, store: IncidentStore, job: str, drain: bool = True) -> None:
        self.fleet, self.store, self.job, self.drain = fleet, store, job, drain

    def left_out(self, incident_id: int, nodes: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Drain those of `nodes` that incident `incident_id` proved bad; what was done, by host (also recorded in
        the incident's evidence)."""
        nodes = sorted(nodes)
        timeline = next((t for t in job_timelines(self.store.engine, self.job) if t.id == incident_id), None) \
            if nodes else None
        if timeline is None:
            return {}
        done: dict[str, dict[str, Any]] = {}
        for node in nodes if self.drain else ():
            why = proven_bad(timeline, node)
            if why is not None:
                done[node] = self._drain(node, drain_reason(incident_id, timeline.kind, why))
        evidence: dict[str, Any] = {}
        if done:
            evidence["drain"] = {**(self.store.row(incident_id).evidence.get("drain") or {}), **done}
        # NOTE: asked after the drain, so the state shows it (IDLE+DRAIN) as `sinfo` would.
        states = self.fleet.host_states(nodes)
        if states:
            evidence["slurm"] = {**(self.store.row(incident_id).evidence.get("slurm") or {}), **states}
        if evidence:
            self.store.update_evidence(incident_id, evidence)
        return done

    def _drain(self, node: str, reason: str) -> dict[str, Any]:
        try:
            drained = self.fleet.drain(node, reason)
        except (SlurmError, OSError) as exc:
            log.warning("draining %s failed: %s", node, exc)
            return {"reason": reason, "drained": False, "error": str(exc)}
        if not drained:
            return {"reason": reason, "drained": False, "error": "the launcher has no scheduler to drain in"}
        log.warning("drained %s: %s", node, reason)
        return {"reason": reason, "drained": True}
