"""The healer's /metrics: `megaheal_incidents_open{kind,severity}` (read from the store at scrape time, so
every replica reports the same numbers) and the healer's own counters, on an explicit registry."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError

from healer.errors import DatabaseError

log = logging.getLogger(__name__)


class OpenIncidents(Collector):
    """Open (not resolved) incidents by kind and severity; the family is left out when the database is down."""

    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        try:
            counts = self._counts()
        except (SQLAlchemyError, DatabaseError) as exc:
            log.warning("megaheal_incidents_open left out of this scrape: %s", exc)
            return
        family = GaugeMetricFamily("megaheal_incidents_open", "Incidents not yet resolved, by kind and severity.",
                                   labels=["kind", "severity"])
        for (kind, severity), n in sorted(counts.items()):
            family.add_metric([kind, severity], n)
        yield family


class HealerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.heartbeat_batches = Counter("megaheal_healer_heartbeat_batches", "Heartbeat batches accepted.", registry=r)
        self.heartbeat_records = Counter("megaheal_healer_heartbeat_records", "Rank entries in accepted batches.",
                                         registry=r)
        self.relay_batches = Counter("megaheal_healer_relay_batches", "Relay batches accepted (each carries many "
                                     "nodes' heartbeat batches, counted in heartbeat_batches).", registry=r)
        self.heartbeats_held = Counter("megaheal_healer_heartbeats_held_seconds", "Seconds heartbeat requests waited "
                                       "for a detection cycle to end (healer/service/detection_first.py).", registry=r)
        self.heartbeats_held_past_limit = Counter("megaheal_healer_heartbeats_held_past_limit", "Heartbeat requests "
                                                  "that waited their longest and went on while a cycle still ran.",
                                                  registry=r)
        self.rejected = Counter("megaheal_healer_requests_rejected", "Requests refused, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.alerts = Counter("megaheal_healer_alerts_received", "Alerts in Alertmanager webhooks, by status and "
                              "whether a rule matched.", ["status", "matched"], registry=r)
        self.signals = Counter("megaheal_healer_signals", "Faults recorded, by rule and outcome "
                               "(opened, joined, reopened).", ["rule", "outcome"], registry=r)
        self.transitions = Counter("megaheal_healer_transitions", "Incident transitions made by this healer.",
                                   ["from_state", "to_state"], registry=r)
        self.claims_lost = Counter("megaheal_healer_claims_lost", "Transitions another healer made first.", registry=r)
        self.evaluations = Counter("megaheal_healer_rule_evaluations", "Rule evaluations, by rule and result.",
                                   ["rule", "result"], registry=r)
        self.detection_cycle = Histogram("megaheal_healer_detection_cycle_seconds", "Time of one detection cycle "
                                         "over all ranks.", buckets=(.0005, .001, .002, .003, .005, .0075, .01, .015, .02,
                                                  .03, .05, .075, .1, .15, .25, .5, 1),
                                         registry=r)
        self.sink_deliveries = Counter("megaheal_healer_sink_deliveries", "Notifications, by sink and result.",
                                       ["sink", "result"], registry=r)
        self.db_up = Gauge("megaheal_healer_db_up", "1 when the database is reachable and at the newest revision.",
                           registry=r)
        self.tick_errors = Counter("megaheal_healer_tick_errors", "Scheduled ticks that failed, by tick.", ["tick"],
                                   registry=r)

    def track(self, tracked_ranks: Callable[[], int], open_counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        Gauge("megaheal_healer_tracked_ranks", "Ranks with a heartbeat in memory.",
              registry=self.registry).set_function(tracked_ranks)
        self.registry.register(OpenIncidents(open_counts))
