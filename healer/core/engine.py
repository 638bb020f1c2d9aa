"""The healer's core: inputs (heartbeats, Alertmanager webhooks) and the scheduled ticks (detection, PromQL
rules, responding to incidents, notifications, housekeeping). Each tick is a small method that the
scheduler calls and a test can call directly; the decisions are in healer.core.decisions, the writes in
healer.core.store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from healer.oncall.alertmanager import INCIDENT_ALERTNAME, WebhookAlert, parse_webhook
from healer.core.decisions import Action, IncidentFacts, decide
from healer.core.detectors.base import Detector, Evaluation
from healer.core.detectors.registry import DetectorRegistry, default_registry
from healer.service.diagnosis import Diagnoser
from healer.core.heartbeats import HeartbeatTable
from healer.core.metrics import HealerMetrics
from healer.core.models import Incident
from healer.core.promql import PromqlEvaluator
from healer.core.rules import AlertCondition, DetectorCondition, PromqlCondition, Rule
from healer.core.signals import Signal, from_rule
from healer.oncall.sinks import Change, Sinks
from healer.core.states import IncidentState
from healer.core.store import IncidentStore, incident_dict

log = logging.getLogger(__name__)
S = IncidentState
RETRY_AFTER = timedelta(seconds=30)


class Healer:
    def __init__(self, *, store: IncidentStore, rules: list[Rule], table: HeartbeatTable, sinks: Sinks,
                 metrics: HealerMetrics, promql: PromqlEvaluator | None = None, diagnoser: Diagnoser | None = None,
                 detectors: DetectorRegistry | None = None, resend: timedelta = timedelta(seconds=30),
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.table, self.sinks, self.metrics = store, table, sinks, metrics
        self.promql, self.diagnoser, self.clock = promql, diagnoser, clock
        sinks.counter = metrics.sink_deliveries
        self.rules = {r.name: r for r in rules}
        if promql is None and any(isinstance(r.condition, PromqlCondition) for r in rules):
            raise ValueError("promql rules need a Prometheus URL (prometheus_url in the healer config)")
        registry = detectors or default_registry()
        self.detectors: list[tuple[Rule, Detector]] = [
            (r, registry.resolve(r.condition.detector)(r.condition.params))
            for r in rules if isinstance(r.condition, DetectorCondition)]
        self.resend = resend
        self._known: dict[str, int] = {}
        self._dirty = True
        self._next_sync = 0.0

    def start(self) -> None:
        """Load the fingerprints of the incidents already open (a restarted healer goes on with them)."""
        self._known = self.store.active_fingerprints()

    # ---- inputs ----------------------------------------------------------------------------------------

    def ingest_heartbeats(self, body: Any) -> int:
        taken = self.table.ingest(body)
        self.metrics.heartbeat_batches.inc()
        self.metrics.heartbeat_records.inc(taken)
        return taken

    def handle_alertmanager(self, body: Any) -> dict[str, int]:
        """Match each alert against the alert rules: firing ones open or join incidents, resolved ones resolve."""
        counts = {"firing": 0, "resolved": 0, "unmatched": 0, "ignored": 0}
        for alert in parse_webhook(body):
            if alert.name == INCIDENT_ALERTNAME:
                counts["ignored"] += 1  # our own incidents routed back to us: never an incident about an incident
                continue
            rules = [r for r in self.rules.values() if _matches(r, alert)]
            self.metrics.alerts.labels(alert.status, "yes" if rules else "no").inc()
            if not rules:
                counts["unmatched"] += 1
            for rule in rules:
                signal = _alert_signal(rule, alert)
                if alert.status == "firing":
                    self._fire(signal)
                else:
                    self._clear(signal.fingerprint, {"reason": "Alertmanager resolved the alert", "alert": alert.labels})
                counts[alert.status] += 1
        return counts

    # ---- ticks -----------------------------------------------------------------------------------------

    def evaluate_detectors(self) -> list[tuple[Rule, Evaluation]]:
        """One detection cycle over the heartbeat table, in memory only (timed into the cycle histogram).
        NOTE: the service runs this on the event loop that also ingests heartbeats, so it never waits for the
        GIL behind a busy ingest thread; the database writes it leads to happen in `apply_detections`."""
        now = self.clock()
        started = time.perf_counter()
        results = [(rule, detector.evaluate(self.table, now)) for rule, detector in self.detectors]
        self.metrics.detection_cycle.observe(time.perf_counter() - started)
        return results

    def apply_detections(self, results: list[tuple[Rule, Evaluation]]) -> None:
        """Open or join incidents for what fires, resolve the ones whose thing is healthy again."""
        for rule, result in results:
            for f in result.firing:
                self._fire(from_rule(rule, {"key": f.key}, f.summary, f.evidence,
                                     labels={**f.labels, **{k: v for k, v in (("job", f.job), ("node", f.node)) if v}},
                                     job=f.job, node=f.node))
            for key in result.healthy:
                fingerprint = self._detector_fingerprint(rule, key)
                if fingerprint in self._known:
                    self._clear(fingerprint, {"reason": f"{rule.name}: healthy again", "key": key})
            self.metrics.evaluations.labels(rule.name, "ok").inc()

    def tick_detect(self) -> None:
        self.apply_detections(self.evaluate_detectors())

    def _detector_fingerprint(self, rule: Rule, key: str) -> str:
        return from_rule(rule, {"key": key}, "").fingerprint

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
        due = self.store.due(limit)
        for incident in due:
            try:
                self._respond(incident)
            except Exception:
                # NOTE: push the incident back before re-raising, so one bad incident cannot stall the others forever.
                self.store.set_next_action(incident.id, _utc(self.clock()) + RETRY_AFTER)
                raise
        return len(due) == limit

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
        self._changed(incident_id, "transition", before.value, new.value)
        return done

    # ---- internals -------------------------------------------------------------------------------------

    def _fire(self, signal: Signal) -> None:
        if signal.fingerprint in self._known:
            return  # still firing: the incident already exists
        incident_id, outcome = self.store.record(signal)
        self._known[signal.fingerprint] = incident_id
        self.metrics.signals.labels(signal.rule, outcome).inc()
        log.info("incident %d %s: %s", incident_id, outcome, signal.summary)
        self._changed(incident_id, outcome, None, S.OPEN.value if outcome != "joined" else None)

    def _clear(self, fingerprint: str, evidence: dict[str, Any]) -> None:
        if fingerprint not in self._known:
            return
        incident_id = self.store.resolve_fingerprint(fingerprint, evidence)
        self._known.pop(fingerprint, None)
        if incident_id is not None:
            log.info("incident %d resolved: %s", incident_id, evidence.get("reason"))
            self.metrics.transitions.labels("active", S.RESOLVED.value).inc()
            self._changed(incident_id, "transition", None, S.RESOLVED.value)

    def _respond(self, incident: Incident) -> None:
        state = S(incident.state)
        rule = self.rules.get(incident.rule)
        facts = IncidentFacts(
            incident_id=incident.id, state=state, state_since=incident.state_since, now=_utc(self.clock()), rule=rule,
            verdict=self.store.latest_verdict(incident.id) if state is S.DIAGNOSING else None,
            diagnosis_available=self.diagnoser is not None)
        decision = decide(facts)
        if decision.action is Action.WAIT or decision.to_state is None:
            self.store.set_next_action(incident.id, decision.next_action_at)
            return
        payload = decision.to_payload()
        if not self.store.transition(incident.id, state, decision.to_state, {"decision": payload},
                                     next_action_at=decision.next_action_at):
            self.metrics.claims_lost.inc()
            return
        self.metrics.transitions.labels(state.value, decision.to_state.value).inc()
        log.info("incident %d: %s -> %s (%s)", incident.id, state.value, decision.to_state.value,
                 decision.basis.get("reason"))
        self._changed(incident.id, "transition", state.value, decision.to_state.value)
        if decision.action is Action.DIAGNOSE and rule is not None and rule.runbook and self.diagnoser is not None:
            self._diagnose(incident, rule.runbook)
        elif decision.action in (Action.REMEDIATE, Action.ESCALATE):
            action = rule.remediate if rule is not None and decision.action is Action.REMEDIATE else "escalate"
            self.store.add_remediation(incident.id, action, payload, outcome="done")

    def _diagnose(self, incident: Incident, runbook: str) -> None:
        assert self.diagnoser is not None
        nodes = [incident.node] if incident.node else []
        # A runbook given as a file path is stored by its name (the column is short; the result holds the rest).
        name = Path(runbook).stem if runbook.endswith((".yaml", ".yml")) else runbook
        run_id = self.store.start_runbook_run(incident.id, name, nodes)

        def done(verdict: str, summary: str, result: dict[str, Any] | None) -> None:
            self.store.finish_runbook_run(run_id, incident.id, verdict, summary, result)
            log.info("incident %d: runbook %s: %s", incident.id, runbook, summary)

        self.diagnoser.submit(runbook, nodes, done)

    def _changed(self, incident_id: int, event: str, from_state: str | None, to_state: str | None) -> None:
        self._dirty = True
        if self.sinks.wants_changes():
            snapshot = incident_dict(self.store.row(incident_id))
            self.sinks.push(Change(event=event, incident=snapshot, from_state=from_state, to_state=to_state,
                                   at=_utc(self.clock()).isoformat()))


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def _matches(rule: Rule, alert: WebhookAlert) -> bool:
    cond = rule.condition
    return (isinstance(cond, AlertCondition) and cond.alert == alert.name
            and all(alert.labels.get(k) == v for k, v in cond.labels.items()))


def _alert_signal(rule: Rule, alert: WebhookAlert) -> Signal:
    summary = alert.annotations.get("summary") or alert.annotations.get("description") or \
        f"{alert.name} " + ", ".join(f"{k}={v}" for k, v in sorted(alert.labels.items()) if k != "alertname")
    node = alert.labels.get("node") or alert.labels.get("hostname") or alert.labels.get("instance")
    return from_rule(rule, dict(alert.labels), summary, {"alert": {"labels": alert.labels,
                                                                     "annotations": alert.annotations,
                                                                     "startsAt": alert.starts_at,
                                                                     "fingerprint": alert.fingerprint}},
                     job=alert.labels.get("job"), node=node)
