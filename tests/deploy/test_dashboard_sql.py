"""The dashboards' SQL (incident tables, stage times, MTTR, ETTR/goodput, annotations) run against a real
PostgreSQL migrated to the healer's newest schema, with Grafana's macros expanded the way Grafana does, on a
small ledger whose answers are known."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from dashboards.build import load, queries
from healer.incidents import db as dbmod
from healer.incidents.models import GoodputInterval, Incident, IncidentEvent, Remediation, Restart
from tests.healer.services import Postgres

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
FROM, TO = T0 - timedelta(hours=1), T0 + timedelta(hours=2)
JOB = "train-a"


def grafana_sql(sql: str, since: datetime = FROM, until: datetime = TO, job: str = JOB) -> str:
    """Expand the macros of Grafana's PostgreSQL datasource and the $job variable over [since, until]."""
    start, end = (f"'{t.strftime('%Y-%m-%dT%H:%M:%SZ')}'" for t in (since, until))
    sql = re.sub(r"\$__timeFilter\(([\w.]+)\)", rf"\1 BETWEEN {start} AND {end}", sql)
    sql = re.sub(r"\$__timeGroupAlias\(([\w.]+), 1h\)", r'floor(extract(epoch from \1)/3600)*3600 AS "time"', sql)
    sql = sql.replace("$__timeFrom()", start).replace("$__timeTo()", end).replace("$job", job)
    assert "$" not in sql, sql
    return sql


def _incident(**kw: Any) -> Incident:
    base = {"fingerprint": kw["rule"], "rule": kw["rule"], "kind": kw["rule"], "severity": "critical",
            "page": "false", "job": JOB, "node": "node-3", "summary": "Xid 79 on GPU 2", "labels": {}, "evidence": {},
            "occurrences": 1, "last_seen_at": kw["opened_at"], "state_since": kw["opened_at"]}
    return Incident(**{**base, **kw})


def seed(engine: Engine) -> None:
    """One incident resolved in 100 s (diagnosis 60 s, recovery 30 s; detection 5 s, 30 s of work lost), one
    still open, and a ledger of 1,015 s of which 900 productive and 60 checkpointing."""
    at = lambda s: T0 + timedelta(seconds=s)
    with Session(engine) as s:
        done = _incident(rule="gpu-critical-xid", state="resolved", opened_at=at(0), resolved_at=at(100))
        done.events = [IncidentEvent(at=at(10), kind="transition", from_state="open", to_state="diagnosing",
                                     actor="healer-1", evidence={}),
                       IncidentEvent(at=at(70), kind="transition", from_state="diagnosing", to_state="remediating",
                                     actor="healer-1", evidence={}),
                       IncidentEvent(at=at(100), kind="transition", from_state="remediating", to_state="resolved",
                                     actor="healer-1", evidence={})]
        still_open = _incident(rule="node-down", state="diagnosing", opened_at=at(500),
                               active_fingerprint="node-down")
        s.add_all([done, still_open])
        s.flush()
        s.add(Remediation(incident_id=done.id, action="exclude-node-and-restart", decided_at=at(70),
                          finished_at=at(100), outcome="ok", basis={}))
        s.add(Restart(job=JOB, incident_id=done.id, requested_at=at(70), resumed_at=at(95), from_step=1200,
                      resumed_step=1100, nodes=["node-1", "node-2"], excluded=["node-3"], outcome="ok"))
        ledger = [("productive", -900, 0, None), ("detection", 0, 5, done.id), ("restart", 5, 25, done.id),
                  ("lost", 25, 55, done.id), ("checkpointing", 55, 115, None)]
        s.add_all(GoodputInterval(job=JOB, kind=kind, started_at=at(a), ended_at=at(b), incident_id=inc)
                  for kind, a, b, inc in ledger)
        s.commit()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    pg = Postgres()
    pg.start()
    try:
        eng = dbmod.make_engine(pg.create_database("dashboards"))
        dbmod.upgrade(eng)
        seed(eng)
        yield eng
        eng.dispose()
    finally:
        pg.stop()


def sql_queries() -> dict[str, str]:
    return {where: q for board in load().values() for where, lang, q in queries(board) if lang == "sql"}


def test_every_dashboard_sql_runs_on_the_healer_schema(engine: Engine) -> None:
    found = sql_queries()
    assert len(found) >= 9
    with engine.connect() as conn:
        for where, sql in found.items():
            rows = conn.execute(text(grafana_sql(sql))).mappings().all()
            assert rows, f"{where}: no rows"


def _one(engine: Engine, title: str) -> list[dict[str, Any]]:
    (sql,) = [q for where, q in sql_queries().items() if f": {title} [" in where or where == title]
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(text(grafana_sql(sql))).mappings().all()]


def test_the_incident_panels_compute_the_stage_times_mttr_and_ettr(engine: Engine) -> None:
    timings = {r["incident"]: r for r in _one(engine, "Detection, diagnosis and recovery times")}
    resolved = timings[1]
    assert [float(resolved[k]) for k in ("detection", "diagnosis", "recovery", "time to resolve", "lost work")] == [
        5, 60, 30, 100, 30]
    assert timings[2]["time to resolve"] is None
    assert [r["incident"] for r in _one(engine, "Open incidents")] == [2]
    assert float(_one(engine, "MTTR")[0]["MTTR"]) == 100
    (ledger,) = _one(engine, "ETTR")
    # productive / wall, as the report computes it (healer/ledger/goodput.py); checkpointing beside it, not in it.
    assert float(ledger["ETTR"]) == pytest.approx(900 / 1015)
    assert float(ledger["Checkpointing"]) == pytest.approx(60 / 1015)
    (restart,) = _one(engine, "Restarts")
    assert restart["excluded nodes"] == '["node-3"]' and restart["resumed at step"] == 1100
    annotations = _one(engine, "megaheal-training: annotation Incidents")
    assert len(annotations) == 2 and annotations[0]["text"].startswith("#1 gpu-critical-xid [resolved]")
    assert annotations[0]["timeEnd"] == T0 + timedelta(seconds=100)
