"""An incident's story read back from the store: its stages and their times, the diagnosis, the decision and the
restart it led to, in one record. The goodput ledger, the run report, `megaheal run`'s live view and the tests
read incidents this way; nothing here writes.

Stages, from the incident's events: detected (opened), diagnosed (a runbook's verdict), decided (the policy's
transition; then notified, escalated or superseded, by what was decided), restarted (the new attempt started),
recovered (it trained again), taken-over (a healer went on with it after the one handling it died), resolved (its
condition cleared, or a person resolved it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from healer.decide.states import IncidentState
from healer.detect.suspects import decode
from healer.detect.suspects import nodes as suspect_nodes
from healer.detect.suspects import ranks as suspect_ranks
from healer.incidents.models import Incident, Restart, RunbookRun

S = IncidentState


@dataclass(slots=True)
class IncidentTimeline:
    id: int
    kind: str
    rule: str
    summary: str
    state: str
    attempt: int | None
    suspect_nodes: list[str]
    suspect_ranks: list[int]
    evidence: dict[str, Any]
    """The detector's evidence (made more precise later, e.g. the first bad step from the ranks' records)."""
    detected_at: float
    stages: list[str] = field(default_factory=list)
    diagnosed_at: float | None = None
    verdict: str | None = None
    """The newest diagnosis's worst status (pass, degraded, fail, error); None: not diagnosed."""
    diagnosis: list[dict[str, Any]] = field(default_factory=list)
    """Per host: node, status, summary, seconds."""
    decided_at: float | None = None
    action: str | None = None
    """The remedy decided: restart, exclude-node-and-restart, rollback-and-skip, notify, escalate (or resolve:
    superseded by another incident's restart)."""
    plan: dict[str, Any] | None = None
    """The plan's payload (remedy, decision_basis, exclude, nodes, dp, resume_step, skip_steps)."""
    remediated_at: float | None = None
    """When the restart's new attempt was started."""
    resume_step: int | None = None
    restart_mode: str | None = None
    """warm (the survivors kept their processes, the state came from memory) or cold (new processes, the state from
    the disk); None: no restart was started for it."""
    restart_why: str | None = None
    """Why that mode (healer.decide.plans.restart_mode, or why a warm restart fell back cold)."""
    resumed_from: str | None = None
    """Where the restart's ranks took their state: memory, or the disk (auto, or a checkpoint's path)."""
    recovered_at: float | None = None
    first_step_after: int | None = None
    highest_step: int | None = None
    lost_steps: int | None = None
    taken_over_at: float | None = None
    resolved_at: float | None = None

    def to_payload(self) -> dict[str, Any]:
        return asdict(self)


def job_timelines(engine: Any, job: str, ids: Collection[int] | None = None) -> list[IncidentTimeline]:
    """Every incident of `job`, oldest first; `ids`: only those of them (a page of one incident reads its own)."""
    query = select(Incident).options(selectinload(Incident.events)).where(Incident.job == job)
    if ids is not None:
        query = query.where(Incident.id.in_(list(ids)))
    with Session(engine) as session:
        incidents = session.execute(query.order_by(Incident.id)).scalars().all()
        found = [i.id for i in incidents]
        # NOTE: grouped once: a comprehension per incident over all of them was incidents x runs.
        runs: defaultdict[int | None, list[RunbookRun]] = defaultdict(list)
        restarts: defaultdict[int | None, list[Restart]] = defaultdict(list)
        if found:
            for run in session.execute(select(RunbookRun).where(RunbookRun.incident_id.in_(found),
                                                                RunbookRun.finished_at.is_not(None))
                                       .order_by(RunbookRun.id)).scalars():
                runs[run.incident_id].append(run)
            for restart in session.execute(select(Restart).where(Restart.incident_id.in_(found))
                                           .order_by(Restart.id)).scalars():
                restarts[restart.incident_id].append(restart)
        return [_timeline(i, runs[i.id], restarts[i.id]) for i in incidents]


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def suspects(incident_id: int, named: Any, node: str | None) -> tuple[list[int], list[str]]:
    """The ranks and hosts an incident names: its suspects column (healer/detect/suspects.py) and its node."""
    kept = decode(named, f"incident {incident_id}")
    return suspect_ranks(kept), sorted({*suspect_nodes(kept), *([node] if node else [])})


def _timeline(i: Incident, runs: list[RunbookRun], restarts: list[Restart]) -> IncidentTimeline:
    ev = i.evidence if isinstance(i.evidence, dict) else {}
    ranks, nodes = suspects(i.id, i.suspects, i.node)
    t = IncidentTimeline(id=i.id, kind=i.kind, rule=i.rule, summary=i.summary, state=i.state, attempt=i.attempt,
                         suspect_nodes=nodes, suspect_ranks=ranks, evidence=ev,
                         detected_at=i.opened_at.timestamp(), resolved_at=_ts(i.resolved_at))
    if runs:
        t.verdict = runs[-1].verdict
        t.diagnosis = list((runs[-1].result or {}).get("diagnosis") or [])
    for e in i.events:
        _apply(t, e.kind, e.from_state, e.to_state, e.at.timestamp(), e.evidence or {})
    started = [r for r in restarts if r.started_at is not None]
    if started and t.resume_step is None:
        t.resume_step = started[-1].from_step
    if started:
        t.restart_mode, t.restart_why, t.resumed_from = started[-1].mode, started[-1].mode_why, started[-1].resume
    return t


def _apply(t: IncidentTimeline, kind: str, old: str | None, new: str | None, at: float, ev: dict[str, Any]) -> None:
    if kind == "transition" and old is None and new == S.OPEN.value:
        t.stages.append("detected")
    elif kind == "transition" and old == S.RESOLVED.value:
        t.stages.append("reopened")
    elif kind == "diagnosed":
        t.diagnosed_at = at if t.diagnosed_at is None else t.diagnosed_at
        t.stages.append("diagnosed")
    elif kind == "restarted":
        t.remediated_at = at if t.remediated_at is None else t.remediated_at
        t.resume_step = ev.get("resume_step", t.resume_step)
        t.stages.append("restarted")
    elif kind == "taken-over":
        t.taken_over_at = at if t.taken_over_at is None else t.taken_over_at
        t.stages.append("taken-over")
    elif kind == "transition" and "decision" in ev and new != S.DIAGNOSING.value:
        _decided(t, at, new, ev["decision"])
    elif kind == "transition" and new == S.RESOLVED.value:
        if str(ev.get("reason", "")).startswith("recovered"):
            t.recovered_at, t.first_step_after = at, ev.get("first_step_after")
            t.highest_step, t.lost_steps = ev.get("highest_step"), ev.get("lost_steps")
            t.stages.append("recovered")
        else:
            t.stages.append("resolved")
    elif kind == "transition" and new == S.ESCALATED.value:
        t.stages.append("escalated")


def _decided(t: IncidentTimeline, at: float, new: str | None, decision: dict[str, Any]) -> None:
    plan = decision.get("plan")
    t.decided_at = at if t.decided_at is None else t.decided_at
    t.plan = plan if plan is not None else t.plan
    t.action = plan["remedy"] if plan else ("resolve" if new == S.RESOLVED.value else decision.get("action"))
    t.stages.append("decided")
    if new == S.ESCALATED.value:
        t.stages.append("escalated")
    elif new == S.RESOLVED.value:
        t.stages.append("superseded")
    elif plan and plan.get("remedy") == "notify":
        t.stages.append("notified")
