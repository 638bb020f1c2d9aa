"""Draining the hosts a restart leaves out, when the run allows it (`megaheal run --drain`, on by default under
Slurm): a host that failed its diagnosis, a host lost (silent while its peers stopped), a host convicted of silent
data corruption, or a lemon, is kept out of every other job's way too, with the incident as the reason (`sinfo -R`: "megaheal: incident 7: crash (failed node-health: disk: ...)"). A host left out for
any other reason (a rule that excludes the suspects of a fault on sight) is not drained: nothing proved it bad.

A host proven bad by its silence alone (host lost) is drained only once that is confirmed by two other witnesses:
its agent does not answer the healer's own call either, and the scheduler cannot run work there (Slurm: a step does
not start on it). Silence that several hosts fell into together is never enough: the healer's own link is then the
likelier fault. Each refusal says why in the incident's `drain` evidence.

The reason is built here from the incident's kind and the verdict of megaheal's own runbook, then cut to a safe
alphabet; it is an argument of scontrol, never a shell's. What happened goes into the incident's evidence
(`drain`: per host, the reason given, whether it was drained, and why not), an event of its timeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ground.slurm import SlurmError, safe_reason
from healer.decide.catalogue import fault
from healer.incidents.store import IncidentStore
from healer.incidents.timeline import IncidentTimeline, job_timelines
from healer.launchers.fleet import AgentFleet
from wire.verdict import Status

log = logging.getLogger(__name__)
WHY_MAX = 100
MEGAHEAL_REASON = "megaheal: "
"""How every drain reason megaheal gives begins (drain_reason, preflight_reason): what it may clear again."""
SILENT = "host lost"
"""How proven_bad begins the reason of a host proven bad by its silence alone."""
SHARED_WITHIN_S = 10.0
"""Hosts found lost within this long of each other fell silent together (one cause, the healer's side, is likelier
than several). NOTE: not longer: a host lost after another was already left out (a death, then a cut a minute later)
is a fault of its own, and is drained as one."""


def drain_reason(incident_id: int, kind: str, why: str) -> str:
    """"megaheal: incident N: KIND (WHY)", in the alphabet a drain reason may hold."""
    why = safe_reason(why)
    if len(why) > WHY_MAX:
        why = why[:WHY_MAX - 3].rstrip() + "..."
    return safe_reason(f"megaheal: incident {incident_id}: {kind} ({why})")


def preflight_reason(why: str) -> str:
    """"megaheal: preflight (WHY)", in the alphabet a drain reason may hold."""
    why = safe_reason(why)
    if len(why) > WHY_MAX:
        why = why[:WHY_MAX - 3].rstrip() + "..."
    return safe_reason(f"megaheal: preflight ({why})")


def proven_bad(timeline: IncidentTimeline, node: str) -> str | None:
    """Why the incident proved `node` bad (its diagnosis failed, it was lost, or it is a lemon), in a few words; None when it
    did not."""
    for host in timeline.diagnosis:
        if isinstance(host, dict) and host.get("node") == node and host.get("status") == Status.FAIL.value:
            return f"failed diagnosis: {host.get('summary') or 'no summary'}"
    kind = fault(timeline.kind)
    if kind.drains_suspects and node in timeline.suspect_nodes and kind.proof:
        return kind.proof
    if kind.drains_suspects and node in timeline.suspect_nodes:
        # Silent while its peers stopped: dead, cut off or its agent unable to run; nothing should land on it until
        # someone has looked (Slurm marks a host DOWN only when its slurmd is gone too, not when a link is).
        silent = timeline.evidence.get("silent_s")
        return f"{SILENT}: silent {silent:.0f} s" if isinstance(silent, (int, float)) else SILENT
    lemons = ((timeline.plan or {}).get("decision_basis") or {}).get("lemons") or {}
    if node in lemons:
        return f"lemon: named in {lemons[node]} incidents"
    return None


class Drainer:
    """Drains, through the launcher, the hosts an incident's restart left out and proved bad (when `drain`), and
    records in the incident what the scheduler says of every host it left out (`slurm`: state and reason), drained
    or not."""

    def __init__(self, fleet: AgentFleet, store: IncidentStore, job: str, drain: bool = True,
                 agent_answers: Callable[[str], bool] | None = None) -> None:
        """`agent_answers(node)`: whether the host's agent answers the healer's call now (None: not asked)."""
        self.fleet, self.store, self.job, self.drain = fleet, store, job, drain
        self.agent_answers = agent_answers
        self._witnesses = ThreadPoolExecutor(1, thread_name_prefix="megaheal-witness")

    def witness(self, incident_id: int) -> Future[dict[str, str | None]]:
        """Ask the witnesses about every host incident `incident_id` names by its silence, now, on a thread (the
        restart goes on meanwhile): by host, why its loss is not confirmed, or None. NOTE: asked when the healer acts,
        not after the restart: a link that comes back by then must not make a host cut off at the time look fine."""
        def ask() -> dict[str, str | None]:
            timeline = self._timeline(incident_id)
            if timeline is None or not fault(timeline.kind).drains_suspects or fault(timeline.kind).proof:
                return {}
            return {n: self._doubt(timeline, n) for n in timeline.suspect_nodes}
        return self._witnesses.submit(ask)

    def left_out(self, incident_id: int, nodes: Iterable[str],
                 doubts: Future[dict[str, str | None]] | None = None) -> dict[str, dict[str, Any]]:
        """Drain those of `nodes` that incident `incident_id` proved bad; what was done, by host (also recorded in
        the incident's evidence). `doubts`: what `witness` found when the healer acted (else they are asked now)."""
        nodes = sorted(nodes)
        timeline = self._timeline(incident_id) if nodes else None
        if timeline is None:
            return {}
        found = doubts.result(timeout=120) if doubts is not None else {}
        done: dict[str, dict[str, Any]] = {}
        for node in nodes if self.drain else ():
            why = proven_bad(timeline, node)
            if why is None:
                continue
            reason = drain_reason(incident_id, timeline.kind, why)
            doubt = (found[node] if node in found else self._doubt(timeline, node)) if why.startswith(SILENT) else None
            if doubt is not None:
                log.warning("not draining %s: %s", node, doubt)
                done[node] = {"reason": reason, "drained": False, "error": f"not confirmed: {doubt}"}
            else:
                done[node] = self._drain(node, reason)
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

    def screened_out(self, node: str, why: str) -> dict[str, Any]:
        """Drain `node`, which failed the preflight runbook (`why`: what failed), when the run drains; what was done."""
        reason = preflight_reason(why)
        if not self.drain:
            return {"reason": reason, "drained": False, "error": "the run does not drain (--no-drain)"}
        return self._drain(node, reason)

    def returned(self, node: str) -> dict[str, Any]:
        """`node` passed its screening again and is taken back: where the scheduler holds it drained with one of
        megaheal's reasons (this healer's or one before it on the same run: "megaheal: ..."), it is resumed there.
        A host drained by anyone else stays as they left it: their reason is not megaheal's to clear."""
        state = self.fleet.host_states([node]).get(node) or {}
        reason = state.get("reason") or ""
        if "DRAIN" not in str(state.get("state") or "").upper():
            return {"resumed": False, "why": "not drained in the scheduler" if state else "no scheduler to ask"}
        if not reason.startswith(MEGAHEAL_REASON):
            return {"resumed": False, "why": f"drained by someone else ({reason[:80]!r}): left as it is"}
        try:
            resumed = self.fleet.resume(node)
        except (SlurmError, OSError) as exc:
            log.warning("resuming %s failed: %s", node, exc)
            return {"resumed": False, "error": str(exc), "reason_was": reason}
        log.warning("resumed %s in the scheduler (it was drained: %s)", node, reason)
        return {"resumed": resumed, "reason_was": reason}

    def _timeline(self, incident_id: int) -> IncidentTimeline | None:
        return next((t for t in job_timelines(self.store.engine, self.job) if t.id == incident_id), None)

    def _doubt(self, timeline: IncidentTimeline, node: str) -> str | None:
        """Why the silence of `node` is not confirmed as its loss; None when it is (or no witness can be asked)."""
        shared = sorted({n for t in job_timelines(self.store.engine, self.job)
                         if t.kind == timeline.kind and t.id != timeline.id
                         and abs(t.detected_at - timeline.detected_at) <= SHARED_WITHIN_S
                         for n in t.suspect_nodes if n != node})
        if shared:
            return (f"{', '.join(shared)} fell silent within {SHARED_WITHIN_S:.0f} s of it: the healer's own link or "
                    "endpoint is the likelier fault")
        # NOTE: both witnesses at once, each bounded (a few seconds): they answer while the old attempt stops, before
        # a link that comes back later could make a host cut off when the healer acted look fine.
        with ThreadPoolExecutor(2, thread_name_prefix="megaheal-witness") as ask:
            agent = ask.submit(self.agent_answers, node) if self.agent_answers is not None else None
            scheduler = ask.submit(self.fleet.scheduler_reaches, node)
            if agent is not None and agent.result():
                return "its agent answers the healer's call: only its reports were lost"
            if scheduler.result():
                return "the scheduler still runs work there (a step started on it)"
        return None

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
