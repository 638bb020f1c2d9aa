"""What the healer keeps about jobs and hosts besides incidents: the jobs it has heard of, each host's history
(the incidents that named it, who left it out and why), the restarts of each job and the goodput ledger.

Shared by every job on the same database: a host that failed in one job is known to the next (lemon hosts).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, delete, func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from healer.incidents.models import GoodputInterval, Incident, Job, Node, NodeIncident, Restart
from healer.incidents.store import utcnow


@dataclass(frozen=True, slots=True)
class IntervalRow:
    kind: str
    started_at: datetime
    ended_at: datetime
    incident_id: int | None = None
    steps: int | None = None


class JobStore:
    def __init__(self, engine: Engine, clock: Callable[[], datetime] = utcnow) -> None:
        self.engine, self.clock = engine, clock

    # ---- jobs and hosts --------------------------------------------------------------------------------------

    def touch_job(self, job: str) -> None:
        now = self.clock()
        with self.engine.begin() as conn:
            done = conn.execute(update(Job).where(Job.name == job).values(last_seen=now)).rowcount
            if not done:
                try:
                    with conn.begin_nested():
                        conn.execute(insert(Job).values(name=job, first_seen=now, last_seen=now))
                except IntegrityError:
                    pass  # another healer registered it a moment ago

    def touch_nodes(self, nodes: Iterable[str], job: str, ranks: int = 0) -> None:
        now = self.clock()
        with self.engine.begin() as conn:
            for node in nodes:
                done = conn.execute(update(Node).where(Node.name == node)
                                    .values(last_seen=now, last_job=job, ranks=ranks)).rowcount
                if not done:
                    try:
                        with conn.begin_nested():
                            conn.execute(insert(Node).values(name=node, last_job=job, first_seen=now, last_seen=now,
                                                             ranks=ranks))
                    except IntegrityError:
                        pass

    def record_node_incidents(self, nodes: Iterable[str], job: str, incident_ref: str, kind: str,
                              at: datetime | None = None, incident_id: int | None = None) -> None:
        """Host history: `nodes` were named by an incident of `kind` (a lemon kind of the catalogue)."""
        at = at or self.clock()
        with self.engine.begin() as conn:
            for node in nodes:
                try:
                    with conn.begin_nested():
                        conn.execute(insert(NodeIncident).values(node=node, job=job, incident_ref=incident_ref,
                                                                 incident_id=incident_id, kind=kind, at=at))
                except IntegrityError:
                    pass  # already recorded (a take-over records the same incident again)

    def node_incident_counts(self, since: datetime) -> dict[str, int]:
        """Per host, the incidents (distinct job and incident) naming it since `since`, across jobs."""
        with Session(self.engine) as session:
            rows = session.execute(select(NodeIncident.node, func.count()).where(NodeIncident.at >= since)
                                   .group_by(NodeIncident.node)).all()
        return {str(node): int(n) for node, n in rows}

    def exclude_nodes(self, nodes: Iterable[str], job: str, incident_id: int | None, reason: str) -> None:
        self.touch_nodes(nodes, job)
        with self.engine.begin() as conn:
            conn.execute(update(Node).where(Node.name.in_(list(nodes)))
                         .values(excluded_at=self.clock(), excluded_reason=reason[:2000], excluded_by=incident_id))

    def node(self, name: str) -> dict[str, Any] | None:
        with Session(self.engine) as session:
            row = session.execute(select(Node).where(Node.name == name)).scalar()
            if row is None:
                return None
            return {"name": row.name, "last_job": row.last_job, "excluded_at": row.excluded_at,
                    "excluded_reason": row.excluded_reason, "excluded_by": row.excluded_by}

    # ---- restarts --------------------------------------------------------------------------------------------

    def add_restart(self, *, job: str, incident_id: int | None, nodes: list[str], excluded: list[str], dp: int | None,
                    skip_steps: list[int], resume_step: int | None = None, cause: str = "remediation",
                    highest_step: int | None = None) -> int:
        """A restart ordered: `resume_step` None resumes from the newest good checkpoint (`resume` auto), a step
        from that checkpoint (a rollback); `restart_started` records what was really done."""
        with self.engine.begin() as conn:
            return int(conn.execute(insert(Restart).values(
                job=job, incident_id=incident_id, requested_at=self.clock(), nodes=nodes, excluded=excluded, dp=dp,
                skip_steps=skip_steps, cause=cause, highest_step=highest_step, from_step=resume_step,
                resume="auto" if resume_step is None else f"step {resume_step}").returning(Restart.id)).scalar_one())

    def restart_started(self, restart_id: int, attempt: int, started_at: datetime, from_step: int | None,
                        resume: str | None, highest_step: int | None = None, mode: str = "cold",
                        mode_why: str = "") -> None:
        """The restart's attempt started, warm or cold (`mode`, and why); `highest_step`: the stopped attempt's, read
        once its ranks were gone (None keeps the one read at the decision)."""
        extra: dict[str, Any] = {"mode": mode, "mode_why": mode_why[:4000] or None}
        if highest_step is not None:
            extra["highest_step"] = highest_step
        with self.engine.begin() as conn:
            conn.execute(update(Restart).where(Restart.id == restart_id).values(
                attempt=attempt, started_at=started_at, from_step=from_step, resume=resume, **extra))
            # An earlier restart of the job still waiting for its attempt will never see it: this one replaced it.
            job = select(Restart.job).where(Restart.id == restart_id).scalar_subquery()
            conn.execute(update(Restart).where(Restart.job == job, Restart.id < restart_id,
                                               Restart.outcome.is_(None)).values(outcome="superseded"))

    def restart_ended(self, restart_id: int, outcome: str, resumed_at: datetime | None = None,
                      resumed_step: int | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(Restart).where(Restart.id == restart_id, Restart.outcome.is_(None))
                         .values(outcome=outcome, resumed_at=resumed_at, resumed_step=resumed_step))

    def pending_restart(self, incident_id: int) -> Restart | None:
        """The incident's newest restart that has not ended (started or still to start), or None."""
        with Session(self.engine, expire_on_commit=False) as session:
            return session.execute(select(Restart).where(Restart.incident_id == incident_id,
                                                         Restart.outcome.is_(None))
                                   .order_by(Restart.id.desc()).limit(1)).scalar()

    def restarts(self, job: str) -> list[Restart]:
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.execute(select(Restart).where(Restart.job == job).order_by(Restart.id)).scalars())

    def restart_times(self, job: str, since: datetime,
                      kinds: Collection[str] | None = None) -> tuple[datetime, ...]:
        """When the job was restarted by a remediation (what the restart budget counts); `kinds`: only for incidents
        of those kinds. NOTE: not a replica group replaced while the others trained on (mode `replica`): that stops
        no job, and a large job of groups loses one every half hour; a host that keeps failing is bounded by the
        lemon limit instead."""
        query = select(Restart.requested_at).where(
            Restart.job == job, Restart.cause == "remediation", Restart.requested_at >= since,
            or_(Restart.mode.is_(None), Restart.mode != "replica"))
        if kinds is not None:
            query = query.join(Incident, Incident.id == Restart.incident_id).where(Incident.kind.in_(list(kinds)))
        with Session(self.engine) as session:
            return tuple(session.execute(query.order_by(Restart.requested_at)).scalars())

    # ---- goodput ---------------------------------------------------------------------------------------------

    def replace_intervals(self, job: str, since: datetime, until: datetime, rows: list[IntervalRow]) -> None:
        """Replace the job's intervals within [since, until] (one run's wall time) by `rows`, in one transaction.
        Rows of the job outside that span belong to other runs of the same job name and are kept."""
        with self.engine.begin() as conn:
            conn.execute(delete(GoodputInterval).where(GoodputInterval.job == job,
                                                       GoodputInterval.started_at.between(since, until)))
            if rows:
                conn.execute(insert(GoodputInterval), [
                    {"job": job, "kind": r.kind, "started_at": r.started_at, "ended_at": r.ended_at,
                     "incident_id": r.incident_id, "steps": r.steps} for r in rows])

    def intervals(self, job: str) -> list[GoodputInterval]:
        with Session(self.engine, expire_on_commit=False) as session:
            return list(session.execute(select(GoodputInterval).where(GoodputInterval.job == job)
                                        .order_by(GoodputInterval.started_at)).scalars())
