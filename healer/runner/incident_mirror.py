"""Self-healed incidents in the healer's database and Alertmanager.

`megaheal run` heals its job in-process and journals every incident event to `<run_dir>/incidents.jsonl`.
On-call does not read run directories: it reads the healer's incident list (`GET /v1/incidents`, the same
tables) and gets paged by Alertmanager. `IncidentMirror.record` copies each journal event into that database
through `healer.core.store.IncidentStore` (the same conditional transitions the healer service makes) and tells
Alertmanager through `healer.oncall.sinks.Sinks`, so a self-healed crash shows up beside the service's incidents
and an escalation pages.

Best effort by design: the journal stays the source of truth, and `record` never raises. A database that is
down or at another schema revision, or an Alertmanager that does not answer, is logged once per distinct
error (saying which event was lost) and training goes on.

One loop incident is one database incident. Its fingerprint is made of the job, the loop's incident id and its
detection time, which a healer that takes the run over reads back from the journal, so the new process finds
the incident by its active fingerprint and goes on with it. An event whose incident the database missed (it
was down at detection) opens the incident first.

`write_ledger` copies the run's goodput ledger (healer.core.goodput.intervals) and its restarts (healer.core.restarts)
into goodput_intervals and restarts, which the dashboards read (ETTR, per-incident detection and lost work, the
restarts table). It recomputes them from the run's files each time and replaces this run's rows, so it can be
called as often as wanted, and again by a healer that takes the run over.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from healer.core.db import ensure_schema, make_engine, safe_url
from healer.errors import HealerError, IllegalTransition
from healer.core.goodput import incidents, intervals
from healer.core.models import GoodputInterval, Incident, Restart
from healer.core.restarts import RestartRecord, restarts
from healer.core.signals import Signal
from healer.oncall.sinks import AlertmanagerSink, Change, Sink, Sinks
from healer.core.states import IncidentState
from healer.core.store import IncidentStore, incident_dict

log = logging.getLogger(__name__)
S = IncidentState

RULE_PREFIX = "selfheal-"
CRITICAL_KINDS = frozenset({"crash", "hang", "gpu_fault", "nonfinite"})
"""Faults that stop the job (or poison its weights); the others (stragglers, slow collectives, loss spikes) slow it."""
PAGE = "on-escalation"
"""The loop heals most faults within a minute; a person is needed (paged) only when it gives up."""
SAME_INCIDENT = timedelta(days=7)
"""The signals' cool-down: a stray event for a resolved incident reopens that incident instead of duplicating it."""
TARGETS = {"diagnosed": S.DIAGNOSING, "restarted": S.REMEDIATING, "escalated": S.ESCALATED,
           "recovered": S.RESOLVED, "notified": S.RESOLVED, "superseded": S.RESOLVED}
EVIDENCE = {
    "diagnosed": ("verdict", "diagnosis"), "decided": ("action", "plan"),
    "restarted": ("action", "plan", "resume_step", "attempt"), "escalated": ("action", "plan"),
    "recovered": ("resume_step", "first_step_after", "highest_step", "lost_steps"), "notified": ("action",),
    "taken-over": ("state", "taken_over_at"),
}
"""The loop incident's fields each event's database evidence carries (besides the event and its time)."""
EXPECTED_ERRORS = (SQLAlchemyError, HealerError, OSError)


class IncidentMirror:
    def __init__(self, store: IncidentStore, sinks: Sinks, job: str, runbook: str = "node-health") -> None:
        self.store, self.sinks, self.job, self.runbook = store, sinks, job, runbook
        self.lost = 0
        """Events (and the start-up schema check, and ledger writes) that failed against the database; the run's
        files keep them."""
        self._schema_ok = False
        self._seen_errors: set[str] = set()

    @classmethod
    def open(cls, db_url: str, job: str, alertmanager_url: str | None = None,
             base_url: str = "http://127.0.0.1:8470", *, runbook: str = "node-health",
             hold: timedelta = timedelta(hours=4)) -> IncidentMirror:
        """A mirror on `db_url`. An empty database is created through the migrations, like the healer service does;
        one that cannot be reached now is retried at each event. Raises DatabaseError only for a URL that can never
        work (malformed, unsupported driver). `hold`: how long Alertmanager keeps an incident's alert after the
        last event re-sent it (a healer service on the same database re-sends them while it runs)."""
        engine = make_engine(db_url)
        store = IncidentStore(engine, f"megaheal-run:{socket.gethostname()}:{os.getpid()}")
        # NOTE: the sink's endsAt lies 4 resends ahead; this process re-sends only when an event happens.
        sinks: list[Sink] = [AlertmanagerSink(alertmanager_url, base_url, hold / 4)] if alertmanager_url else []
        mirror = cls(store, Sinks(sinks), job, runbook)
        mirror._guarded("the start-up schema check", mirror._check_schema)
        return mirror

    def record(self, incident: dict[str, Any], event: str, at: float) -> None:
        """Mirror one journal event (`incident` is `asdict(IncidentRecord)`); logs and returns on any failure."""
        self._guarded(f"recording {event!r} of self-heal incident {incident.get('id')}",
                      lambda: self._record(incident, event, at))

    def write_ledger(self, run_dir: Path) -> None:
        """Replace this run's goodput intervals and restarts in the database with those its files give now, in one
        transaction (idempotent); logs and returns on any failure. Rows of an incident the database does not know
        (it was down then) have no incident. Rows of this job outside the run's wall time (another run of the same
        job name) are kept."""
        self._guarded(f"writing the goodput ledger of {run_dir}", lambda: self._write_ledger(run_dir))

    def close(self) -> None:
        self.store.engine.dispose()

    # ---- internals -------------------------------------------------------------------------------------

    def _guarded(self, what: str, action: Callable[[], None]) -> None:
        try:
            action()
        except EXPECTED_ERRORS as exc:
            self._lost(what, exc, unexpected=False)
        except Exception as exc:  # noqa: BLE001 - NOTE: a bug here must not stop a job that heals fine without this copy
            self._lost(what, exc, unexpected=True)

    def _lost(self, what: str, exc: BaseException, unexpected: bool) -> None:
        self.lost += 1
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if reason in self._seen_errors:
            log.debug("incident mirror: %s lost: %s", what, reason)
            return
        self._seen_errors.add(reason)
        log.warning("incident mirror: %s failed (database %s): %s; the event is lost there, the run's incidents.jsonl "
                    "has it (more failures for this reason are logged at debug level)", what,
                    safe_url(self.store.engine.url), reason, exc_info=unexpected)

    def _check_schema(self) -> None:
        if not self._schema_ok:
            ensure_schema(self.store.engine)
            self._schema_ok = True

    def _record(self, inc: dict[str, Any], event: str, at: float) -> None:
        self._check_schema()
        incident_id = self._incident_id(inc, at)
        evidence = _jsonable({"event": event, "at": at, "loop_incident": inc["id"],
                              **{k: inc.get(k) for k in EVIDENCE.get(event, ())}})
        if event == "diagnosed":
            self._runbook_run(incident_id, inc)
        if event == "decided":
            self.store.add_remediation(incident_id, str(inc.get("action")), _jsonable(inc.get("plan") or {}), "decided")
        target = TARGETS.get(event)
        if target is not None:
            self._move(incident_id, target, evidence, event)
        elif event != "detected":
            self.store.note(incident_id, evidence)
        self._notify()

    def _write_ledger(self, run_dir: Path) -> None:
        self._check_schema()
        spans = intervals(run_dir)
        if not spans:
            return  # the first attempt has not started yet
        since, until, incs, done = _utc(spans[0].start), _utc(spans[-1].end), incidents(run_dir), restarts(run_dir)
        with Session(self.store.engine) as session, session.begin():
            ids = self._database_ids(session, incs)
            # NOTE: an interval shorter than the database's microsecond is dropped: it could repeat a start.
            rows = [{"job": self.job, "kind": s.kind, "started_at": start, "ended_at": end,
                     "incident_id": ids.get(s.incident) if s.incident is not None else None, "steps": s.steps}
                    for s in spans if (start := _utc(s.start)) < (end := _utc(s.end))]
            # NOTE: the run's wall time only grows: rows outside it belong to other runs of the job name.
            session.execute(delete(GoodputInterval).where(GoodputInterval.job == self.job,
                                                          GoodputInterval.started_at.between(since, until)))
            if rows:
                session.execute(insert(GoodputInterval), rows)
            self._upsert_restarts(session, done, ids, since)

    def _database_ids(self, session: Session, incs: list[dict[str, Any]]) -> dict[int, int]:
        """Loop incident id -> database incident id, by fingerprint (resolved ones too), for those it knows."""
        by_fingerprint = {self._signal(inc, inc["detected_at"]).fingerprint: int(inc["id"]) for inc in incs}
        if not by_fingerprint:
            return {}
        found = session.execute(select(Incident.fingerprint, func.max(Incident.id))
                                .where(Incident.fingerprint.in_(by_fingerprint)).group_by(Incident.fingerprint))
        return {by_fingerprint[fp]: int(db_id) for fp, db_id in found}

    def _upsert_restarts(self, session: Session, records: list[RestartRecord], ids: dict[int, int],
                         since: datetime) -> None:
        """One row per restart, found again by its request time (a restart's journal entries never change it)."""
        existing = {r.requested_at: r for r in session.scalars(
            select(Restart).where(Restart.job == self.job, Restart.requested_at >= since))}
        for record in records:
            values = {"incident_id": ids.get(record.incident), "from_step": record.from_step,
                      "resumed_step": record.resumed_step, "nodes": record.nodes, "excluded": record.excluded,
                      "resumed_at": _utc(record.resumed_at) if record.resumed_at is not None else None,
                      "outcome": record.outcome}
            row = existing.get(_utc(record.requested_at))
            if row is None:
                row = Restart(job=self.job, requested_at=_utc(record.requested_at))
                session.add(row)
                existing[row.requested_at] = row
            for key, value in values.items():
                setattr(row, key, value)

    def _incident_id(self, inc: dict[str, Any], at: float) -> int:
        signal = self._signal(inc, at)
        found = self.store.active_fingerprints().get(signal.fingerprint)
        if found is not None:
            return found
        incident_id, how = self.store.record(signal)
        # NOTE: the store makes a new incident due at once for the healer service's respond tick; the loop drives this
        # one, so it is never due (a healer service on the same database would escalate it: its rule is not configured).
        self.store.set_next_action(incident_id, None)
        log.info("incident mirror: self-heal incident %s is database incident %d (%s)", inc["id"], incident_id, how)
        self._changed(incident_id, how, None, None if how == "joined" else S.OPEN.value)
        return incident_id

    def _signal(self, inc: dict[str, Any], at: float) -> Signal:
        kind = str(inc["kind"])
        identity = {"job": self.job, "incident": str(inc["id"]), "detected_at": f"{float(inc['detected_at']):.6f}"}
        nodes = ",".join(inc.get("suspect_nodes") or [])
        return Signal(rule=f"{RULE_PREFIX}{kind}", kind=kind, severity=severity_of(kind), page=PAGE,
                      cooldown=SAME_INCIDENT, identity=tuple(sorted(identity.items())), job=self.job,
                      node=nodes[:253] or None, summary=str(inc.get("summary", ""))[:2000],
                      evidence=_jsonable({"at": at, "attempt": inc.get("attempt"), "key": inc.get("key"),
                                          "suspect_nodes": inc.get("suspect_nodes"),
                                          "suspect_ranks": inc.get("suspect_ranks"), "detector": inc.get("evidence")}),
                      labels=identity)

    def _runbook_run(self, incident_id: int, inc: dict[str, Any]) -> None:
        diagnosis = list(inc.get("diagnosis") or [])
        run_id = self.store.start_runbook_run(incident_id, self.runbook, [str(d.get("node")) for d in diagnosis])
        summary = "; ".join(f"{d.get('node')}: {d.get('status')}: {d.get('summary')}" for d in diagnosis)
        # NOTE: before the move to diagnosing: finishing makes a diagnosing incident due for the service's tick.
        self.store.finish_runbook_run(run_id, incident_id, str(inc.get("verdict")), summary,
                                      _jsonable({"diagnosis": diagnosis}))

    def _move(self, incident_id: int, target: IncidentState, evidence: dict[str, Any], event: str) -> None:
        current = self.store.state_of(incident_id)
        if current is target:  # e.g. "restarted" again by a healer that took the run over
            self.store.note(incident_id, evidence)
            return
        try:
            moved = self.store.transition(incident_id, current, target, evidence, next_action_at=None)
        except IllegalTransition as exc:
            log.warning("incident mirror: %s of database incident %d skipped: %s", event, incident_id, exc)
            self.store.note(incident_id, {**evidence, "skipped": str(exc)})
            return
        if not moved:
            log.warning("incident mirror: %s of database incident %d skipped: it left %s meanwhile (a person acted?)",
                        event, incident_id, current.value)
            return
        self._changed(incident_id, "transition", current.value, target.value)

    def _changed(self, incident_id: int, event: str, from_state: str | None, to_state: str | None) -> None:
        if self.sinks.wants_changes():
            self.sinks.push(Change(event=event, incident=incident_dict(self.store.row(incident_id)),
                                   from_state=from_state, to_state=to_state, at=self.store.clock().isoformat()))

    def _notify(self) -> None:
        """Like the service's notify tick, for this job's self-heal incidents: Alertmanager gets the active ones and
        those resolved since it last took a sync (a failed sync is retried with the next event)."""
        if not self.sinks.sinks:
            return  # NOTE: resolved ones stay unnotified, for a healer service on this database to send
        self.sinks.flush()
        active = [i for i in self.store.active() if self._mine(i)]
        resolved = [i for i in self.store.resolved_unnotified() if self._mine(i)]
        if self.sinks.sync(active, resolved, self.store.clock()):
            self.store.mark_resolved_notified([i.id for i in resolved])

    def _mine(self, incident: Incident) -> bool:
        return incident.job == self.job and incident.rule.startswith(RULE_PREFIX)


def severity_of(kind: str) -> str:
    return "critical" if kind in CRITICAL_KINDS else "warning"


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON: what json cannot encode as text, NaN and infinities as strings (PostgreSQL's json
    type refuses them, and a nonfinite incident's evidence holds them)."""
    return json.loads(json.dumps(value, default=str), parse_constant=str)


class MirrorWorker:
    """Runs the mirror off the healing loop's thread, in order: each incident event as it comes (`record`), and
    the run's goodput ledger every `every`, after the events that change it, and soon after `poke()`.

    A database or Alertmanager that hangs (a host that drops packets: each call waits out its timeout, ~5 s)
    then delays the copy, never the healing; writing the ledger of a long run takes seconds too.
    """

    LEDGER_EVENTS = frozenset({"restarted", "recovered", "escalated", "notified"})
    """Events after which the ledger changes (the dashboards' ETTR, lost work and restarts follow them)."""
    _LEDGER = object()

    def __init__(self, mirror: IncidentMirror, run_dir: Path, every: timedelta = timedelta(seconds=30)) -> None:
        if every <= timedelta(0):
            raise ValueError(f"every must be > 0, got {every}")
        self._mirror, self._run_dir, self._every = mirror, run_dir, every.total_seconds()
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="megaheal-mirror", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def record(self, incident: dict[str, Any], event: str, at: float) -> None:
        """SelfHealLoop's on_event: queue the event (`incident` is a fresh `asdict` copy, safe to keep)."""
        self._queue.put((incident, event, at))

    def poke(self) -> None:
        self._queue.put(self._LEDGER)

    def stop(self) -> None:
        """Mirror every queued event, write the ledger once more, and stop."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=120)

    def _loop(self) -> None:
        due = time.monotonic() + self._every
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                item = self._LEDGER
            if isinstance(item, tuple):
                incident, event, at = item
                self._mirror.record(incident, event, at)  # never raises
                if event not in self.LEDGER_EVENTS:
                    continue
            self._mirror.write_ledger(self._run_dir)  # never raises
            due = time.monotonic() + self._every
            if item is None:
                return
