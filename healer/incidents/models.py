"""The healer's database: SQLAlchemy 2 models. The schema itself is owned by the migrations (migrations/);
a test checks that autogenerate finds no difference between these models and the newest migration.

Times are stored in UTC (`UTCDateTime` gives back aware datetimes on SQLite too). Evidence and
labels are JSON. Text columns are `Label(n)` and `Prose` (healer.incidents.columns): values are made to fit on the way
in, so no input can make PostgreSQL refuse a write. Incident state is a short string checked by `healer.decide.states`, not a database enum,
so adding a state later needs no type migration on PostgreSQL.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Index, Integer, MetaData, TypeDecorator, UniqueConstraint
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from healer.incidents.columns import Label, Prose

# NOTE: fixed constraint names, so migrations (and their downgrades) name the same objects on every backend.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite keeps no zone: it is added back on read)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the healer stores aware UTC times only")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    """A training job the healer has heard of (from heartbeats, alerts or rules)."""

    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(Label(200), unique=True)
    first_seen: Mapped[datetime]
    last_seen: Mapped[datetime]


class Node(Base):
    """A machine that ran ranks; kept across jobs so a node's incident history follows it. `excluded_*` is the
    newest time a healer left it out of a job and why (an incident's decision); a later job may still use it
    unless its lemon history (NodeIncident) says otherwise."""

    __tablename__ = "nodes"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(Label(253), unique=True)
    last_job: Mapped[str | None] = mapped_column(Label(200))
    first_seen: Mapped[datetime]
    last_seen: Mapped[datetime]
    ranks: Mapped[int] = mapped_column(Integer, default=0)
    excluded_at: Mapped[datetime | None]
    excluded_reason: Mapped[str | None] = mapped_column(Prose)
    excluded_by: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="SET NULL"))
    """The incident whose remediation left the node out."""


class NodeIncident(Base):
    """A node named by an incident of a kind that points at the node itself (the catalogue's `lemon` kinds):
    the history that makes a node a lemon, shared by every job on the same database."""

    __tablename__ = "node_incidents"
    __table_args__ = (UniqueConstraint("node", "job", "incident_ref"), Index("ix_node_incidents_node_at", "node", "at"))
    id: Mapped[int] = mapped_column(primary_key=True)
    node: Mapped[str] = mapped_column(Label(253))
    job: Mapped[str] = mapped_column(Label(200))
    incident_ref: Mapped[str] = mapped_column(Label(64))
    """Which incident of that job (its id in the database that recorded it; a label, not a key: history may be
    imported from elsewhere)."""
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="SET NULL"))
    kind: Mapped[str] = mapped_column(Label(100))
    at: Mapped[datetime]


class Incident(Base):
    """One fault, from detection to resolution. `active_fingerprint` equals `fingerprint` while the incident is
    not resolved and is NULL afterwards: its unique constraint makes two healers that see the same fault at once
    create one incident (the loser's INSERT fails and it joins the winner's)."""

    __tablename__ = "incidents"
    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint: Mapped[str] = mapped_column(Label(64), index=True)
    active_fingerprint: Mapped[str | None] = mapped_column(Label(64), unique=True)
    rule: Mapped[str] = mapped_column(Label(200))
    kind: Mapped[str] = mapped_column(Label(100))
    severity: Mapped[str] = mapped_column(Label(20))
    page: Mapped[str] = mapped_column(Label(20))
    state: Mapped[str] = mapped_column(Label(20), index=True)
    job: Mapped[str | None] = mapped_column(Label(200))
    node: Mapped[str | None] = mapped_column(Label(253))
    summary: Mapped[str] = mapped_column(Prose)
    labels: Mapped[dict[str, Any]]
    evidence: Mapped[dict[str, Any]]
    """For people: free-form (what the finding saw, what diagnosis added). Nothing is decided on it."""
    suspects: Mapped[list[Any]] = mapped_column(default=list)
    """Whom the finding blames, as healer/detect/suspects.py encodes them (`suspects_of` reads them back typed)."""
    first_bad_step: Mapped[int | None]
    """The first step the fault touched, for a rollback (its finding's; the ranks' own records may refine it)."""
    occurrences: Mapped[int] = mapped_column(Integer, default=1)
    opened_at: Mapped[datetime]
    last_seen_at: Mapped[datetime]
    state_since: Mapped[datetime]
    next_action_at: Mapped[datetime | None] = mapped_column(index=True)
    resolved_at: Mapped[datetime | None]
    owner: Mapped[str | None] = mapped_column(Label(200))
    acknowledged_by: Mapped[str | None] = mapped_column(Label(200))
    notified_resolved: Mapped[bool] = mapped_column(default=False)
    attempt: Mapped[int | None]
    """The job's attempt the fault happened in, when a launcher runs the job (None for the service alone)."""
    handler: Mapped[str | None] = mapped_column(Label(200), index=True)
    """Which healer acts on it: None for the service (any of its replicas), `run:JOB` for the healer embedded in
    `megaheal run` that started JOB (a service on the same database leaves those alone, and that run leaves the
    service's alone)."""
    events: Mapped[list[IncidentEvent]] = relationship(back_populates="incident", order_by="IncidentEvent.id",
                                                       cascade="all, delete-orphan", passive_deletes=True)


class IncidentEvent(Base):
    """One thing that happened to an incident: a transition (from_state -> to_state), a recurrence, a note."""

    __tablename__ = "incident_events"
    __table_args__ = (Index("ix_incident_events_incident_at", "incident_id", "at"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"))
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(Label(20))
    from_state: Mapped[str | None] = mapped_column(Label(20))
    to_state: Mapped[str | None] = mapped_column(Label(20))
    actor: Mapped[str] = mapped_column(Label(200))
    evidence: Mapped[dict[str, Any]]
    incident: Mapped[Incident] = relationship(back_populates="events")


class RunbookRun(Base):
    """A diagnostic runbook run for an incident, with its verdict and full result."""

    __tablename__ = "runbook_runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"), index=True)
    runbook: Mapped[str] = mapped_column(Label(200))
    nodes: Mapped[list[Any]]
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    verdict: Mapped[str | None] = mapped_column(Label(20))
    summary: Mapped[str | None] = mapped_column(Prose)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Remediation(Base):
    """An action the healer decided on for an incident, the basis of the decision and how it ended."""

    __tablename__ = "remediations"
    id: Mapped[int] = mapped_column(primary_key=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incidents.id", ondelete="CASCADE"), index=True)
    action: Mapped[str] = mapped_column(Label(100))
    decided_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    outcome: Mapped[str | None] = mapped_column(Label(20))
    basis: Mapped[dict[str, Any]]


class Restart(Base):
    """A restart of a job: when it was decided and started, from which checkpoint step, on which nodes, leaving
    out which, and how it ended (recovered: its attempt trained again; superseded: another attempt started first;
    failed: it could not be started). `cause` is `remediation` (spends the restart budget) or `take-over` (a healer
    that came back restarted what the dead one had started: the job's budget is not charged twice)."""

    __tablename__ = "restarts"
    id: Mapped[int] = mapped_column(primary_key=True)
    job: Mapped[str] = mapped_column(Label(200), index=True)
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="SET NULL"))
    requested_at: Mapped[datetime]
    resumed_at: Mapped[datetime | None]
    from_step: Mapped[int | None]
    resumed_step: Mapped[int | None]
    nodes: Mapped[list[Any]]
    excluded: Mapped[list[Any]]
    outcome: Mapped[str | None] = mapped_column(Label(20))
    cause: Mapped[str] = mapped_column(Label(20), default="remediation")
    attempt: Mapped[int | None]
    """The attempt this restart started (None until it started)."""
    started_at: Mapped[datetime | None]
    dp: Mapped[int | None]
    resume: Mapped[str | None] = mapped_column(Prose)
    """What the ranks were told to resume from: auto (the newest good checkpoint) or a checkpoint path."""
    skip_steps: Mapped[list[Any]]
    """Steps whose batches every later attempt passes over (a rollback's, accumulated)."""
    highest_step: Mapped[int | None]
    """The highest step the failed attempt finished (the work this restart puts at risk)."""
    mode: Mapped[str | None] = mapped_column(Label(20))
    """warm (the surviving ranks kept their processes and state) or cold (new processes, state from the disk);
    None until the restart started."""
    mode_why: Mapped[str | None] = mapped_column(Prose)
    """Why that mode: the policy's reason, or why a warm restart it asked for could not be made."""


class GoodputInterval(Base):
    """A stretch of a job's wall time and what it was spent on (productive, checkpointing, detection,
    diagnosis, restart, lost): the ledger goodput and ETTR are derived from."""

    __tablename__ = "goodput_intervals"
    __table_args__ = (UniqueConstraint("job", "kind", "started_at"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job: Mapped[str] = mapped_column(Label(200), index=True)
    kind: Mapped[str] = mapped_column(Label(20))
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime]
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="SET NULL"))
    steps: Mapped[int | None]


class HealerEpoch(Base):
    """The epoch of the healer that drives each job: claimed anew (a conditional UPDATE, healer/incidents/epochs.py)
    by every healer that starts driving it, a take-over's included, and carried in each of its orders; an agent
    refuses an order of an epoch below the highest it has taken, so an older healer that still runs cannot act on
    the job any more."""

    __tablename__ = "healer_epochs"
    job: Mapped[str] = mapped_column(Label(200), primary_key=True)
    epoch: Mapped[int]
    claimed_at: Mapped[datetime]
    claimed_by: Mapped[str] = mapped_column(Label(200))
    """Which healer claimed it (its store's owner: `megaheal-run:HOST:PID`), for people."""
