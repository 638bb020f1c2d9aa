"""The incident store: every write that changes an incident's state is a conditional UPDATE
(`... WHERE id = :id AND state = :old`) whose row count says whether this healer won, so several healer
processes on one database never act on an incident twice. Each transition is stored with its time, actor
and evidence in the same transaction.

Deduplication: `active_fingerprint` is unique and set only while an incident is not resolved, so a second
INSERT of the same fault fails and the caller joins the incident that won.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from healer.decide.signals import Signal
from healer.decide.states import ACTIVE_STATES, HEALER_OWNED, IncidentState, check_transition
from healer.detect.suspects import Suspects, encode, shown
from healer.errors import DatabaseError, IllegalTransition, NotFound
from healer.incidents.models import Incident, IncidentEvent, Remediation, RunbookRun

log = logging.getLogger(__name__)
S = IncidentState
_UNSET: Any = object()


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class IncidentStore:
    def __init__(self, engine: Engine, actor: str, clock: Callable[[], datetime] = utcnow,
                 handler: str | None = None) -> None:
        """`handler`: the healer this store acts for (None: the service; `run:JOB`: the healer embedded in a
        `megaheal run`): the incidents it opens are marked so, and only those are due for it."""
        self.engine = engine
        self.actor = actor
        self.clock = clock
        self.handler = handler

    # ---- signals -> incidents ----------------------------------------------------------------------------

    def record(self, signal: Signal) -> tuple[int, str]:
        """Open an incident for `signal`, join the active one with its fingerprint, or reopen one resolved within
        the cool-down. Returns (incident id, "opened" | "joined" | "reopened")."""
        for _ in range(3):
            found = self._join(signal)
            if found is not None:
                return found, "joined"
            try:
                found = self._reopen(signal)
                if found is not None:
                    return found, "reopened"
                return self._insert(signal), "opened"
            except IntegrityError:
                continue  # another healer opened the same fault a moment ago: join theirs
        raise DatabaseError(f"could not record signal {signal.fingerprint} of rule {signal.rule} (kept conflicting)")

    def _join(self, signal: Signal) -> int | None:
        now = self.clock()
        with self.engine.begin() as conn:
            row = conn.execute(
                update(Incident).where(Incident.active_fingerprint == signal.fingerprint)
                .values(occurrences=Incident.occurrences + 1, last_seen_at=now).returning(Incident.id)).first()
            if row is None:
                return None
            conn.execute(insert(IncidentEvent).values(
                incident_id=row.id, at=now, kind="recurred", from_state=None, to_state=None, actor=self.actor,
                evidence=jsonable({"summary": signal.summary, **signal.evidence})))
            return int(row.id)

    def _reopen(self, signal: Signal) -> int | None:
        now = self.clock()
        with Session(self.engine) as session:
            recent = session.execute(
                select(Incident.id).where(Incident.fingerprint == signal.fingerprint, Incident.state == S.RESOLVED.value,
                                          Incident.resolved_at >= now - signal.cooldown)
                .order_by(Incident.resolved_at.desc()).limit(1)).scalar()
        if recent is None:
            return None
        won = self.transition(recent, S.RESOLVED, S.OPEN, {"reason": "recurred within the cool-down",
                                                           "summary": signal.summary, **signal.evidence},
                              # NOTE: what it says now, with whom it blames now: a reopened incident kept its first
                              # summary while its suspects were the new signal's (a hang named again by another
                              # rank said the old rank). The first opening's words stay in its events.
                              next_action_at=now, values={"active_fingerprint": signal.fingerprint,
                                                          "summary": signal.summary, "node": signal.node,
                                                          "labels": signal.labels,
                                                          "evidence": jsonable(signal.evidence),
                                                          "suspects": encode(signal.suspects),
                                                          "first_bad_step": signal.first_bad_step,
                                                          "resolved_at": None, "last_seen_at": now, "owner": None,
                                                          "occurrences": Incident.occurrences + 1})
        return recent if won else None

    def _insert(self, signal: Signal) -> int:
        now = self.clock()
        with self.engine.begin() as conn:
            new_id = conn.execute(insert(Incident).values(
                fingerprint=signal.fingerprint, active_fingerprint=signal.fingerprint, rule=signal.rule,
                kind=signal.kind, severity=signal.severity, page=signal.page, state=S.OPEN.value, job=signal.job,
                node=signal.node, summary=signal.summary, labels=signal.labels, evidence=jsonable(signal.evidence),
                suspects=encode(signal.suspects), first_bad_step=signal.first_bad_step, occurrences=1, opened_at=now, last_seen_at=now, state_since=now, next_action_at=now,
                notified_resolved=False, attempt=signal.attempt, handler=self.handler).returning(Incident.id)).scalar_one()
            conn.execute(insert(IncidentEvent).values(
                incident_id=new_id, at=now, kind="transition", from_state=None, to_state=S.OPEN.value,
                actor=self.actor, evidence=jsonable({"summary": signal.summary, **signal.evidence})))
        return int(new_id)

    # ---- transitions --------------------------------------------------------------------------------------

    def transition(self, incident_id: int, old: IncidentState, new: IncidentState, evidence: dict[str, Any],
                   actor: str | None = None, next_action_at: datetime | None = _UNSET,
                   values: dict[str, Any] | None = None) -> bool:
        """Move old -> new if the incident is still in `old`; False when another actor moved it first.
        Raises IllegalTransition when the table forbids old -> new."""
        check_transition(old, new)
        now = self.clock()
        actor = actor or self.actor
        changes: dict[str, Any] = {"state": new.value, "state_since": now}
        if new is S.RESOLVED:
            changes.update(resolved_at=now, active_fingerprint=None, next_action_at=None, notified_resolved=False)
        elif new in (S.ESCALATED, S.ACKNOWLEDGED):
            changes["next_action_at"] = None
        if new is S.ACKNOWLEDGED:
            changes["acknowledged_by"] = actor
        if new is S.DIAGNOSING:
            changes["owner"] = actor
        if next_action_at is not _UNSET:
            changes["next_action_at"] = next_action_at
        changes.update(values or {})
        with self.engine.begin() as conn:
            result = conn.execute(update(Incident).where(Incident.id == incident_id, Incident.state == old.value)
                                  .values(**changes))
            if result.rowcount != 1:
                return False
            conn.execute(insert(IncidentEvent).values(incident_id=incident_id, at=now, kind="transition",
                                                      from_state=old.value, to_state=new.value, actor=actor,
                                                      evidence=jsonable(evidence)))
        return True

    def act(self, incident_id: int, new: IncidentState, actor: str, evidence: dict[str, Any]) -> dict[str, Any]:
        """A person's ack or resolve: from whatever state the incident is in now. Raises NotFound, IllegalTransition."""
        for _ in range(5):
            current = self.state_of(incident_id)
            check_transition(current, new)
            if self.transition(incident_id, current, new, evidence, actor=actor):
                return self.get(incident_id)
        raise IllegalTransition(f"incident {incident_id} kept changing state; try again")

    def resolve_fingerprint(self, fingerprint: str, evidence: dict[str, Any]) -> int | None:
        """Resolve the active incident with this fingerprint (its condition cleared); its id, or None."""
        for _ in range(5):
            with Session(self.engine) as session:
                row = session.execute(select(Incident.id, Incident.state)
                                      .where(Incident.active_fingerprint == fingerprint)).first()
            if row is None:
                return None
            if self.transition(row.id, S(row.state), S.RESOLVED, evidence):
                return int(row.id)
        return None

    def note(self, incident_id: int, evidence: dict[str, Any], kind: str = "note") -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(IncidentEvent).values(incident_id=incident_id, at=self.clock(), kind=kind,
                                                      from_state=None, to_state=None, actor=self.actor,
                                                      evidence=jsonable(evidence)))

    def set_next_action(self, incident_id: int, at: datetime | None) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(Incident).where(Incident.id == incident_id).values(next_action_at=at))

    # ---- runbook runs and remediations --------------------------------------------------------------------

    def start_runbook_run(self, incident_id: int, runbook: str, nodes: list[str]) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(insert(RunbookRun).values(incident_id=incident_id, runbook=runbook, nodes=nodes,
                                                              started_at=self.clock()).returning(RunbookRun.id)).scalar_one())

    def finish_runbook_run(self, run_id: int, incident_id: int, verdict: str, summary: str,
                           result: dict[str, Any] | None) -> None:
        """Store the verdict and make the incident due now, so the next tick decides with it."""
        now = self.clock()
        with self.engine.begin() as conn:
            conn.execute(update(RunbookRun).where(RunbookRun.id == run_id)
                         .values(finished_at=now, verdict=verdict, summary=summary, result=result))
            conn.execute(update(Incident).where(Incident.id == incident_id, Incident.state == S.DIAGNOSING.value)
                         .values(next_action_at=now))

    def latest_verdict(self, incident_id: int) -> str | None:
        run = self.latest_run(incident_id)
        return run.verdict if run is not None else None

    def latest_run(self, incident_id: int) -> RunbookRun | None:
        """The incident's newest finished runbook run (detached), or None."""
        with Session(self.engine, expire_on_commit=False) as session:
            return session.execute(select(RunbookRun).where(RunbookRun.incident_id == incident_id,
                                                            RunbookRun.finished_at.is_not(None))
                                   .order_by(RunbookRun.id.desc()).limit(1)).scalar()

    def add_remediation(self, incident_id: int, action: str, basis: dict[str, Any], outcome: str,
                        finished: bool = True) -> int:
        now = self.clock()
        with self.engine.begin() as conn:
            return int(conn.execute(insert(Remediation).values(
                incident_id=incident_id, action=action, decided_at=now, finished_at=now if finished else None,
                outcome=outcome, basis=basis).returning(Remediation.id)).scalar_one())

    def finish_remediation(self, remediation_id: int, outcome: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(Remediation).where(Remediation.id == remediation_id)
                         .values(finished_at=self.clock(), outcome=outcome))

    def update_evidence(self, incident_id: int, evidence: dict[str, Any], summary: str | None = None,
                        suspects: Suspects | None = None, first_bad_step: int | None = None) -> None:
        """Merge `evidence` into the incident's (a finding made more precise after detection, e.g. the crash's
        exit status once the agent reported it); the change is an event too. `suspects` and `first_bad_step`, when
        given, replace the incident's (a closer look named whom to blame, or the true first bad step) and are shown
        in its evidence as a finding's are."""
        if first_bad_step is not None:
            evidence = {**evidence, "first_step": first_bad_step}
        if suspects is not None:
            evidence = {**evidence, **shown(suspects)}
        with Session(self.engine) as session, session.begin():
            incident = session.get(Incident, incident_id)
            if incident is None:
                raise NotFound(f"no incident {incident_id}")
            incident.evidence = jsonable({**incident.evidence, **evidence})
            if suspects is not None:
                incident.suspects = encode(suspects)
            if first_bad_step is not None:
                incident.first_bad_step = first_bad_step
            if summary is not None:
                incident.summary = summary
            session.add(IncidentEvent(incident_id=incident_id, at=self.clock(), kind="evidence", from_state=None,
                                      to_state=None, actor=self.actor,
                                      evidence=jsonable({"summary": summary, **evidence} if summary else evidence)))

    # ---- reads ----------------------------------------------------------------------------------------------

    def state_of(self, incident_id: int) -> IncidentState:
        with Session(self.engine) as session:
            state = session.execute(select(Incident.state).where(Incident.id == incident_id)).scalar()
        if state is None:
            raise NotFound(f"no incident {incident_id}")
        return S(state)

    def row(self, incident_id: int) -> Incident:
        with Session(self.engine, expire_on_commit=False) as session:
            incident = session.get(Incident, incident_id)
        if incident is None:
            raise NotFound(f"no incident {incident_id}")
        return incident

    def get(self, incident_id: int) -> dict[str, Any]:
        with Session(self.engine) as session:
            incident = session.execute(select(Incident).options(selectinload(Incident.events))
                                       .where(Incident.id == incident_id)).scalar()
            if incident is None:
                raise NotFound(f"no incident {incident_id}")
            runs = session.execute(select(RunbookRun).where(RunbookRun.incident_id == incident_id)
                                   .order_by(RunbookRun.id)).scalars().all()
            out = incident_dict(incident)
            out["events"] = [event_dict(e) for e in incident.events]
            out["runbook_runs"] = [{"id": r.id, "runbook": r.runbook, "nodes": r.nodes, "verdict": r.verdict,
                                    "summary": r.summary, "started_at": _iso(r.started_at),
                                    "finished_at": _iso(r.finished_at)} for r in runs]
            return out

    def list_incidents(self, states: list[IncidentState] | None = None, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        query = select(Incident).order_by(Incident.id.desc()).limit(limit).offset(offset)
        if states:
            query = query.where(Incident.state.in_([s.value for s in states]))
        with Session(self.engine) as session:
            return [incident_dict(i) for i in session.execute(query).scalars()]

    def due(self, limit: int = 100) -> list[Incident]:
        """Incidents the healer should look at now (detached rows)."""
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.execute(
                select(Incident).where(Incident.state.in_([s.value for s in HEALER_OWNED]),
                                       Incident.next_action_at <= self.clock(),
                                       Incident.handler.is_(None) if self.handler is None
                                       else Incident.handler == self.handler)
                .order_by(Incident.next_action_at).limit(limit)).scalars())

    def of_job(self, job: str, states: frozenset[IncidentState] | None = None) -> list[Incident]:
        """The job's incidents (detached), oldest first; only those in `states` when given."""
        query = select(Incident).where(Incident.job == job).order_by(Incident.id)
        if states is not None:
            query = query.where(Incident.state.in_([s.value for s in states]))
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.execute(query).scalars())

    def active(self) -> list[Incident]:
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.execute(select(Incident).where(
                Incident.state.in_([s.value for s in ACTIVE_STATES]))).scalars())

    def active_fingerprints(self) -> dict[str, int]:
        with Session(self.engine) as session:
            rows = session.execute(select(Incident.active_fingerprint, Incident.id)
                                   .where(Incident.active_fingerprint.is_not(None))).all()
        return {str(fp): int(i) for fp, i in rows}

    def open_counts(self) -> dict[tuple[str, str], int]:
        with Session(self.engine) as session:
            rows = session.execute(select(Incident.kind, Incident.severity, func.count())
                                   .where(Incident.state.in_([s.value for s in ACTIVE_STATES]))
                                   .group_by(Incident.kind, Incident.severity)).all()
        return {(kind, severity): int(n) for kind, severity, n in rows}

    def resolved_unnotified(self, limit: int = 500) -> list[Incident]:
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.execute(select(Incident).where(
                Incident.state == S.RESOLVED.value, Incident.notified_resolved.is_(False)).limit(limit)).scalars())

    def mark_resolved_notified(self, ids: list[int]) -> None:
        if ids:
            with self.engine.begin() as conn:
                conn.execute(update(Incident).where(Incident.id.in_(ids), Incident.state == S.RESOLVED.value)
                             .values(notified_resolved=True))

    def purge(self, older_than: timedelta) -> int:
        """Delete incidents resolved more than `older_than` ago (their events and runs go with them)."""
        with self.engine.begin() as conn:
            result = conn.execute(delete(Incident).where(Incident.state == S.RESOLVED.value,
                                                         Incident.resolved_at < self.clock() - older_than))
        return int(result.rowcount or 0)


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: what json cannot encode as text, NaN and infinities as strings (PostgreSQL's json type
    refuses them, and a NaN incident's evidence may hold them)."""
    return json.loads(json.dumps(value, default=str), parse_constant=str)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def incident_dict(i: Incident) -> dict[str, Any]:
    return {"id": i.id, "rule": i.rule, "kind": i.kind, "severity": i.severity, "page": i.page, "state": i.state,
            "job": i.job, "node": i.node, "summary": i.summary, "labels": i.labels, "evidence": i.evidence,
            "suspects": i.suspects, "occurrences": i.occurrences, "fingerprint": i.fingerprint, "opened_at": _iso(i.opened_at),
            "last_seen_at": _iso(i.last_seen_at), "state_since": _iso(i.state_since),
            "resolved_at": _iso(i.resolved_at), "owner": i.owner, "acknowledged_by": i.acknowledged_by}


def event_dict(e: IncidentEvent) -> dict[str, Any]:
    return {"at": _iso(e.at), "kind": e.kind, "from": e.from_state, "to": e.to_state, "actor": e.actor,
            "evidence": e.evidence}
