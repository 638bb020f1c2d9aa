"""The composition root of the healer: what both front doors run, wired in one place. The service (`megaheal
healer`, healer/service/app.py) composes it with no hands (it notifies) and schedules its ticks; `megaheal run`
(healer/runner/build.py) composes it with a launcher's hands and drives it from its run loop. Either way it is the
same store, heartbeat table, engine and HTTP API (healer/service/api.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.engine import Engine
from starlette.applications import Starlette

from healer.decide.promql import PromqlEvaluator
from healer.decide.rules import RuleSet
from healer.engine.engine import Healer
from healer.incidents.db import ensure_schema
from healer.incidents.metrics import HealerMetrics
from healer.incidents.store import IncidentStore
from healer.observe.heartbeats import HeartbeatTable
from healer.oncall.sinks import Sinks
from healer.ports import Diagnoser, Remediator
from healer.service.api import create_app
from healer.service.detection_first import DetectionFirst
from healer.service.health import Readiness

Hands = Callable[[IncidentStore, HeartbeatTable], Remediator]
"""Builds a front door's hands from the store (drains record into incidents) and the table (whose process view the
coordinator reports into)."""


@dataclass(frozen=True, slots=True)
class Composed:
    db: Engine
    store: IncidentStore
    table: HeartbeatTable
    metrics: HealerMetrics
    healer: Healer
    readiness: Readiness
    app: Starlette
    """The one HTTP API: heartbeats, Alertmanager, incidents, health, metrics."""


def compose(*, db: Engine, store: IncidentStore, rules: RuleSet, token: str, sinks: Sinks, hands: Hands | None = None,
            diagnoser: Diagnoser | None = None, promql: PromqlEvaluator | None = None,
            resend: timedelta = timedelta(seconds=30), db_timeout: timedelta = timedelta(seconds=10),
            max_body: int = 1 << 20, detection_first: DetectionFirst | None = None,
            metrics: HealerMetrics | None = None) -> Composed:
    """The healer over `db` (its schema checked by the readiness probe, which the caller runs), with `hands` where
    it acts on a job (None: it notifies and escalates only). `metrics`: the registry's counters, when the caller
    needs them before (the service's detection gate counts into them); else new ones."""
    metrics = metrics or HealerMetrics()
    table = HeartbeatTable()
    remediator = hands(store, table) if hands is not None else None
    healer = Healer(store=store, rules=rules, table=table, sinks=sinks, metrics=metrics, remediator=remediator,
                    diagnoser=diagnoser, resend=resend, promql=promql)
    readiness = Readiness(lambda: ensure_schema(db), timeout=db_timeout)
    metrics.track(lambda: len(table), store.open_counts)
    metrics.db_up.set_function(lambda: 1.0 if readiness.ready else 0.0)
    app = create_app(healer, readiness, token, max_body, detection_first=detection_first)
    return Composed(db=db, store=store, table=table, metrics=metrics, healer=healer, readiness=readiness, app=app)
