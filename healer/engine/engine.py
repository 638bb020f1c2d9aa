"""The healer: one engine for both front doors. Inputs (heartbeats, Alertmanager webhooks, the launcher's view of
the processes), and the ticks (detection, PromQL rules, responding to incidents, recovery, notifications,
housekeeping). Each tick is a small method that a scheduler (the service) or a loop (`megaheal run`) calls and a
test can call directly; decisions are pure (healer.decide.policy), writes go through the store, and acting on the
job goes through a Remediator (healer.ports) that carries orders out off the caller's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from healer.decide.promql import PromqlEvaluator
from healer.decide.rules import AlertCondition, DetectorCondition, PromqlCondition, Rule, RuleSet
from healer.decide.signals import Signal, from_rule
from healer.decide.states import IncidentState
from healer.detect.base import Detector, Evaluation
from healer.detect.registry import DetectorRegistry, default_registry
from healer.engine.recovery import recover, take_over
from healer.engine.respond import Responder
from healer.errors import HealerError
from healer.incidents.db import unreachable
from healer.incidents.jobstore import JobStore
from healer.incidents.metrics import HealerMetrics
from healer.incidents.store import IncidentStore, incident_dict
from healer.observe.heartbeats import HeartbeatTable
from healer.observe.history import HistoryPool
from healer.observe.jobview import TickView
from healer.oncall.alertmanager import INCIDENT_ALERTNAME, WebhookAlert, parse_webhook
from healer.oncall.sinks import Change, Sinks
from healer.ports import Diagnoser, JobState, Remediator

log = logging.getLogger(__name__)
S = IncidentState
AFTER_BLIND_S = 15.0
"""How long after a job's blindness ends its silence still counts for nothing: the first batches heard again may be
ones an agent buffered while cut off (their steps as old as the cut), and a hang's or a lost host's clock must not
run on those. One host_lost `after` (15 s shipped), ample for each host's fresh batch to arrive."""


class Healer:
    def __init__(self, *, store: IncidentStore, rules: list[Rule] | RuleSet, table: HeartbeatTable, sinks: Sinks,
                 metrics: HealerMetrics, promql: PromqlEvaluator | None = None, diagnoser: Diagnoser | None = None,
                 remediator: Remediator | None = None, detectors: DetectorRegistry | None = None,
                 resend: timedelta = timedelta(seconds=30), clock: Callable[[], float] = time.time) -> None:
        self.store, self.table, self.sinks, self.metrics = store, table, sinks, metrics
        self.promql, self.clock = promql, clock
        self.ruleset = rules if isinstance(rules, RuleSet) else RuleSet(list(rules))
        sinks.counter = metrics.sink_deliveries
        self.rules = {r.name: r for r in self.ruleset.rules}
        if promql is None and any(isinstance(r.condition, PromqlCondition) for r in self.ruleset.rules):
            raise ValueError("promql rules need a Prometheus URL (prometheus_url in the healer config)")
        registry = detectors or default_registry()
        self.detectors: list[tuple[Rule, Detector]] = [
            (r, registry.resolve(r.condition.detector)(r.condition.params))
            for r in self.ruleset.rules if isinstance(r.condition, DetectorCondition)]
        self.histories = HistoryPool.for_detectors([d for _, d in self.detectors])
        self.jobs = JobStore(store.engine, store.clock)
        self.responder = Responder(store=store, jobs=self.jobs, ruleset=self.ruleset, metrics=metrics,
                                   remediator=remediator, diagnoser=diagnoser, changed=self.changed)
        self.resend = resend
        self._known: dict[str, int] = {}
        self._fired: dict[tuple[str, str], str] = {}
        """(rule, detector key) -> the fingerprint it fired with (the key's attempt is part of it)."""
        self._dirty = True
        self._next_sync = 0.0
        self._blind_until: dict[str, float] = {}
        """job -> until when its silence counts for nothing (blind now, or just heard again: AFTER_BLIND_S)."""

    @property
    def remediator(self) -> Remediator | None:
        return self.responder.remediator

    def start(self) -> None:
        """Load the incidents already open (a restarted healer goes on with them)."""
        self._known = self.store.active_fingerprints()
        for incident in self.store.active():
            key = incident.evidence.get("key") if isinstance(incident.evidence, dict) else None
            if isinstance(key, str) and incident.active_fingerprint:
                self._fired[(incident.rule, key)] = incident.active_fingerprint

    # ---- inputs ----------------------------------------------------------------------------------------

    def ingest_heartbeats(self, body: Any, sender: str | None = None) -> int:
        taken = self.table.ingest(body, sender)
        self.metrics.heartbeat_batches.inc()
        self.metrics.heartbeat_records.inc(taken)
        return taken

    def ingest_relayed(self, body: bytes) -> tuple[int, int]:
        nodes, taken = self.table.ingest_relayed(body)
        self.metrics.relay_batches.inc()
        self.metrics.heartbeat_batches.inc(nodes)
        self.metrics.heartbeat_records.inc(taken)
        return nodes, taken

    def handle_alertmanager(self, body: Any) -> dict[str, Any]:
        """Match each alert against the alert rules: firing ones open or join incidents, resolved ones resolve.

        Each alert is stored on its own: one that the database refuses is counted under `failed` (which one in
        `errors`, why in the log) and the others still go in, since Alertmanager would resend the whole batch, for
        ever, if it were refused. A database that cannot be reached fails the request (503), and Alertmanager's
        retry then joins the incidents already stored instead of duplicating them."""
        counts: dict[str, Any] = {"firing": 0, "resolved": 0, "unmatched": 0, "ignored": 0, "failed": 0}
        errors: list[dict[str, Any]] = []
        for index, alert in enumerate(parse_webhook(body)):
            if alert.name == INCIDENT_ALERTNAME:
                counts["ignored"] += 1  # our own incidents routed back to us: never an incident about an incident
                continue
            rules = [r for r in self.rules.values() if _matches(r, alert)]
            self.metrics.alerts.labels(alert.status, "yes" if rules else "no").inc()
            if not rules:
                counts["unmatched"] += 1
            for rule in rules:
                try:
                    self._take_alert(rule, alert)
                except (SQLAlchemyError, HealerError) as exc:
                    if unreachable(exc):
                        raise
                    log.error("alert %d (%s) of rule %s not stored", index, alert.name, rule.name, exc_info=True)
                    counts["failed"] += 1
                    errors.append({"alert": index, "rule": rule.name, "error": type(exc).__name__})
                    continue
                counts[alert.status] += 1
        return {**counts, "errors": errors} if errors else counts

    def _take_alert(self, rule: Rule, alert: WebhookAlert) -> None:
        signal = _alert_signal(rule, alert)
        if alert.status == "firing":
            self._fire(signal)
        else:
            self._clear(signal.fingerprint, {"reason": "Alertmanager resolved the alert", "alert": alert.labels})

    # ---- ticks -----------------------------------------------------------------------------------------

    def evaluate_detectors(self) -> tuple[TickView, list[tuple[Rule, Evaluation]]]:
        """One detection cycle over this tick's view of the jobs, in memory only (timed into the cycle histogram).
        NOTE: the service runs it on a thread of its own, off the event loop: a cycle over 12,288 ranks takes long
        enough that heartbeats, /healthz and every other request would wait for it there. The database writes it
        leads to happen in `apply_detections`."""
        now = self.clock()
        started = time.perf_counter()
        view = TickView.of(self.table, self.histories)
        reporting: set[str] | None = None  # the jobs with a rank that reported a step: taken once, when first needed
        # NOTE: a host the healer left out of its job is known to be bad: its faults (a GPU that keeps its Xid) are
        # no longer the job's, and must not open an incident every cycle.
        state = self.remediator.state() if self.remediator is not None else None
        left_out = set(state.excluded) if state is not None else set()
        acting = _acted_on(state)
        evaluated = [(rule, detector, detector.evaluate(view, now)) for rule, detector in self.detectors]
        # NOTE: a job most of whose hosts the healer stopped hearing at once is the healer's blindness, not the hosts'
        # fault (healer/detect/blind.py): nothing is done on its silence.
        for job in {f.job for _, detector, result in evaluated if detector.blinds for f in result.firing}:
            if job is not None:
                self._blind_until[job] = now + AFTER_BLIND_S
        self._blind_until = {job: until for job, until in self._blind_until.items() if until > now}
        blind = set(self._blind_until)
        results = []
        for rule, detector, result in evaluated:
            kept = tuple(f for f in result.firing if f.node not in left_out)
            if kept and detector.measures_silence and blind:
                kept = tuple(f for f in kept if f.job not in blind)
            if kept and detector.measures_silence and acting is not None:
                # NOTE: while the healer stops, diagnoses or starts the job, its silence and its lack of progress are
                # the healer's own doing, not a fault of the attempt being replaced or of the one starting.
                kept = tuple(f for f in kept if f.job != acting)
            if kept and not detector.reads_processes:
                # NOTE: until a restarted job's new attempt reports a step, a heartbeat detector only remembers the
                # old attempt (its NaN, its slow phase table): it may not speak for the job then.
                if reporting is None:
                    reporting = {job for job, cols in view.job_columns.items() if (cols.step[cols.counts] >= 0).any()}
                kept = tuple(f for f in kept
                             if f.job is None or f.job in reporting or view.processes.attempt(f.job) is None)
            results.append((rule, Evaluation(firing=kept, healthy=result.healthy)))
        self.metrics.detection_cycle.observe(time.perf_counter() - started)
        return view, results

    def apply_detections(self, view: TickView, results: list[tuple[Rule, Evaluation]]) -> None:
        """Open or join incidents for what fires, resolve the ones whose thing is healthy again."""
        # NOTE: what fired is remembered only to resolve its incident when its key is healthy again; once that
        # incident is over (resolved by anyone, purged) the entry is of no use, and would grow with every job and
        # attempt ever seen. Pruned here, on the one thread that writes it.
        known = self._known
        self._fired = {k: fp for k, fp in self._fired.items() if fp in known}
        for rule, result in results:
            for f in result.firing:
                # NOTE: under a launcher the attempt is part of the identity: the same fault in a later attempt
                # (a second hang) is a new incident, not a reopened one.
                attempt = view.processes.attempt(f.job) if f.job else None
                signal = from_rule(rule, {"key": f.key}, f.summary, {**f.evidence, "key": f.key},
                                   labels={**f.labels, **{k: v for k, v in (("job", f.job), ("node", f.node)) if v}},
                                   job=f.job, node=f.node, attempt=attempt, suspects=f.suspects,
                                   first_bad_step=f.first_bad_step)
                self._fired[(rule.name, f.key)] = signal.fingerprint
                self._fire(signal)
            # NOTE: the keys of this rule that fired and are healthy now, by one set intersection: a rule's healthy
            # keys can be every GPU (131,072 at the largest), looked up one by one ~40 ms a cycle.
            fired = {key for (name, key) in self._fired if name == rule.name}
            for key in sorted(fired & result.healthy):
                fingerprint = self._fired[(rule.name, key)]
                if fingerprint in self._known:
                    self._clear(fingerprint, {"reason": f"{rule.name}: healthy again", "key": key})
            self.metrics.evaluations.labels(rule.name, "ok").inc()

    def tick_detect(self) -> TickView:
        view, results = self.evaluate_detectors()
        self.apply_detections(view, results)
        return view

    def tick_promql(self) -> None:
        if self.promql is None:
            return
        now = self.clock()
        for rule in [r for r in self.rules.values() if isinstance(r.condition, PromqlCondition)]:
            result = self.promql.evaluate(rule, now)
            if result.error:
                log.warning("rule %s: %s", rule.name, result.error)
                self.metrics.evaluations.labels(rule.name, "error").inc()
                continue
            self.metrics.evaluations.labels(rule.name, "ok").inc()
            for signal in result.firing:
                self._fire(signal)
            for fp in result.cleared:
                self._clear(fp, {"reason": f"{rule.name}: the expression no longer returns the series"})

    def tick_respond(self, limit: int = 50) -> bool:
        """Act on the incidents that are due; True when more were due than handled (more work)."""
        self._known = self.store.active_fingerprints()
        return self.responder.respond_due(limit, _utc(self.clock()))

    def tick_recovery(self, view: TickView) -> list[int]:
        """Incidents whose restart trained again are resolved (with the step it resumed at and the work lost)."""
        return recover(self.responder, view, _utc(self.clock()))

    def take_over(self, adopted: int | None = None) -> list[int]:
        """Go on with the incidents a healer that died left in flight (after the launcher adopted its running attempt,
        `adopted`, or stopped what was left of it)."""
        self.start()
        return take_over(self.responder, _utc(self.clock()), adopted)

    def tick_notify(self) -> None:
        self.sinks.flush()
        now = self.clock()
        if not (self._dirty or now >= self._next_sync):
            return
        resolved = self.store.resolved_unnotified()
        if self.sinks.sync(self.store.active(), resolved, _utc(now)):
            self.store.mark_resolved_notified([i.id for i in resolved])
            self._dirty = False
            self._next_sync = now + self.resend.total_seconds()

    def tick_housekeeping(self, retention: timedelta) -> None:
        purged = self.store.purge(retention)
        forgotten = self.table.forget_old()
        if purged or forgotten:
            log.info("housekeeping: %d resolved incidents older than %s deleted, %d silent ranks forgotten",
                     purged, retention, forgotten)

    def person_action(self, incident_id: int, new: IncidentState, by: str, note: str) -> dict[str, Any]:
        """A person acknowledges or resolves an incident (from whatever state it is in now)."""
        before = self.store.state_of(incident_id)
        done = self.store.act(incident_id, new, f"person:{by}", {"by": by, "note": note, "via": "api"})
        self.changed(incident_id, "transition", before.value, new.value)
        return done

    # ---- internals -------------------------------------------------------------------------------------

    def report(self, signal: Signal) -> None:
        """A fault found outside the detectors (a take-over that finds hosts of the last attempt lost with the
        healer before it): an incident like any detector's."""
        self._fire(signal)

    def _fire(self, signal: Signal) -> None:
        if signal.fingerprint in self._known:
            return  # still firing: the incident already exists
        incident_id, outcome = self.store.record(signal)
        self._known[signal.fingerprint] = incident_id
        self.metrics.signals.labels(signal.rule, outcome).inc()
        log.warning("incident %d %s: %s", incident_id, outcome, signal.summary)
        if outcome != "joined":
            self.responder.opened(incident_id, signal)
        self.changed(incident_id, outcome, None, S.OPEN.value if outcome != "joined" else None)

    def _clear(self, fingerprint: str, evidence: dict[str, Any]) -> None:
        incident_id = self._known.get(fingerprint)
        if incident_id is None:
            return
        if self.responder.restart_pending(incident_id):
            return  # its restart resolves it once the new attempt trains (tick_recovery), not the detector
        incident_id = self.store.resolve_fingerprint(fingerprint, evidence)
        self._known.pop(fingerprint, None)
        if incident_id is not None:
            log.info("incident %d resolved: %s", incident_id, evidence.get("reason"))
            self.metrics.transitions.labels("active", S.RESOLVED.value).inc()
            self.changed(incident_id, "transition", None, S.RESOLVED.value)

    def changed(self, incident_id: int, event: str, from_state: str | None, to_state: str | None) -> None:
        self._dirty = True
        if self.sinks.wants_changes():
            snapshot = incident_dict(self.store.row(incident_id))
            self.sinks.push(Change(event=event, incident=snapshot, from_state=from_state, to_state=to_state,
                                   at=_utc(self.clock()).isoformat()))


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def _acted_on(state: JobState | None) -> str | None:
    """The job whose attempt the healer is replacing now (an order in flight: a stop, a diagnosis with the job
    stopped, a restart; or the job stopped between two attempts), None when it is left to run."""
    if state is None or state.attempt is None:
        return None
    if state.busy or not (state.running or state.succeeded):
        return state.job
    return None


def _matches(rule: Rule, alert: WebhookAlert) -> bool:
    cond = rule.condition
    return (isinstance(cond, AlertCondition) and cond.alert == alert.name
            and all(alert.labels.get(k) == v for k, v in cond.labels.items()))


def _alert_signal(rule: Rule, alert: WebhookAlert) -> Signal:
    summary = alert.annotations.get("summary") or alert.annotations.get("description") or \
        f"{alert.name} " + ", ".join(f"{k}={v}" for k, v in sorted(alert.labels.items()) if k != "alertname")
    # NOTE: "Hostname" is dcgm-exporter's node label (4.x, and megaheal's GPU series); "hostname" its next spelling.
    node = (alert.labels.get("node") or alert.labels.get("Hostname") or alert.labels.get("hostname")
            or alert.labels.get("instance"))
    return from_rule(rule, dict(alert.labels), summary, {"alert": {"labels": alert.labels,
                                                                     "annotations": alert.annotations,
                                                                     "startsAt": alert.starts_at,
                                                                     "fingerprint": alert.fingerprint}},
                     job=alert.labels.get("job"), node=node)

