"""The healer on a real PostgreSQL when what it is given does not fit, or the database misbehaves: values longer
than their columns and NUL characters are stored (made to fit), one alert the database refuses loses nothing else
of its batch, a lock held for ever costs a request its statement timeout (503) and not a worker for good, and a
frozen server fails /readyz instead of hanging it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
import sqlalchemy as sa

from healer.decide.rules import AlertCondition, Rule
from healer.decide.signals import from_rule
from healer.incidents import db
from healer.incidents.jobstore import JobStore
from healer.incidents.store import IncidentStore
from tests.healer.services import HealerProcess, Postgres, http, wait_for, webhook

pytestmark = pytest.mark.services

FAST = {"respond_interval": "200ms", "notify_interval": "200ms", "detect_interval": "200ms", "probe_interval": "500ms"}
RULES = ("- name: xid\n  when: {alert: GpuXid}\n  remediate: notify\n"
         "- name: stale\n  when: {detector: heartbeat_stale, after: 1s}\n  remediate: notify\n")


def _healer(tmp_path: Path, url: str, **config: Any) -> HealerProcess:
    (tmp_path / "rules.yaml").write_text(RULES)
    return HealerProcess(tmp_path, {"db": url, "rules": [str(tmp_path / "rules.yaml")], **FAST, **config})


def _rows(url: str, sql: str) -> list[Any]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql)).all())
    finally:
        engine.dispose()


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def test_it_stores_alerts_whose_labels_overflow_the_columns_or_hold_nul_and_the_rest_of_their_batch(
        tmp_path: Path, pg_url: str) -> None:
    healer = _healer(tmp_path, pg_url).start()
    try:
        alerts = webhook([
            {"status": "firing", "labels": {"alertname": "GpuXid", "job": "j" * 300, "node": "n" * 300}},
            {"status": "firing", "labels": {"alertname": "GpuXid", "node": "nul\u0000node", "job": "nul\u0000job"},
             "annotations": {"summary": "a NUL \u0000 in the summary"}},
            {"status": "firing", "labels": {"alertname": "GpuXid", "node": "plain"}},
        ])
        status, body = http("POST", f"{healer.url}/v1/alertmanager", alerts)
        assert (status, body["firing"], body["failed"]) == (200, 3, 0), body
        stored = healer.incidents()
        assert len(stored) == 3
        long_one = next(i for i in stored if i["node"].startswith("nnn"))
        assert len(long_one["job"]) == 200 and len(long_one["node"]) == 253 and long_one["job"].startswith("j" * 187)
        nul = next(i for i in stored if i["node"] == "nulnode")
        assert nul["job"] == "nuljob" and nul["summary"] == "a NUL  in the summary"
        assert nul["labels"]["node"] == "nul\u0000node"  # the JSON keeps it as sent (escaped)
        # Alertmanager resends the batch: joined, not duplicated, the long-named one included.
        assert http("POST", f"{healer.url}/v1/alertmanager", alerts)[0] == 200
        assert len(healer.incidents()) == 3
    finally:
        healer.stop()


def test_a_persons_name_is_refused_at_the_boundary_or_stored_whole(tmp_path: Path, pg_url: str) -> None:
    healer = _healer(tmp_path, pg_url).start()
    try:
        http("POST", f"{healer.url}/v1/alertmanager",
             webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n1"}}]))
        (incident,) = healer.incidents()
        ack = f"{healer.url}/v1/incidents/{incident['id']}/ack"
        status, body = http("POST", ack, {"by": "x" * 200})  # used to be "person:" + 200 characters: a 503
        assert status == 400 and body["field"] == "by"
        status, body = http("POST", ack, {"by": "y" * 128, "note": "n\u00e9e\n" * 900})
        assert status == 200 and body["acknowledged_by"] == "person:" + "y" * 128
    finally:
        healer.stop()


def test_heartbeats_of_a_job_whose_name_overflows_the_column_still_open_an_incident(tmp_path: Path,
                                                                                      pg_url: str) -> None:
    healer = _healer(tmp_path, pg_url).start()
    job = "job-" + "x" * 249  # 253 characters: a name the wire schema accepts, the jobs column holds 200
    beat = {"schema": 1, "node": "n9", "seq": 0, "sent_at": time.time(), "ranks": [
        {"job": job, "rank": 0, "pid": 100, "alive": True, "last_seen_age_s": 5.0, "step": 7}]}
    try:
        assert http("POST", f"{healer.url}/v1/heartbeats", beat)[0] == 202
        (incident,) = wait_for("the silent rank's incident", lambda: healer.incidents(), 20)
        assert incident["kind"] == "heartbeat_stale" and incident["job"].startswith("job-xxx")
        assert _rows(pg_url, "SELECT length(name) FROM jobs") == [(200,)]
    finally:
        healer.stop()
    assert "detection cycle failed" not in healer.log.read_text()


def test_values_clipped_on_the_way_in_still_find_their_rows(db_url: str) -> None:
    engine = db.make_engine(db_url)
    db.ensure_schema(engine)
    store, jobs = IncidentStore(engine, "a" * 300), JobStore(engine)
    rule = Rule(name="r", when=AlertCondition(alert="X"))
    long_a, long_b = "a" * 250 + "-one", "a" * 250 + "-two"  # the same first 200 characters
    for job in (long_a, long_b):
        store.record(from_rule(rule, {"job": job}, "summary \u0000 with NUL", job=job, node="n" * 300))
        jobs.touch_job(job)
    assert len(store.of_job(long_a)) == 1 and len(store.of_job(long_b)) == 1  # still two jobs, each found
    jobs.touch_job(long_a)  # an update, not a second row
    assert len(_rows(db_url, "SELECT name FROM jobs")) == 2
    engine.dispose()


def test_one_alert_the_database_refuses_loses_nothing_else_of_its_batch(tmp_path: Path, pg_url: str) -> None:
    healer = _healer(tmp_path, pg_url).start()
    # A real refusal by the database for one alert only (what a broken constraint or a bad value looks like).
    with psycopg.connect(_libpq(pg_url), autocommit=True) as conn:
        conn.execute("CREATE FUNCTION refuse_poison() RETURNS trigger AS $$ BEGIN IF NEW.node = 'poison' THEN "
                     "RAISE EXCEPTION 'poisoned row'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql")
        conn.execute("CREATE TRIGGER poison BEFORE INSERT ON incidents FOR EACH ROW EXECUTE FUNCTION refuse_poison()")
    try:
        alerts = webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": node}}
                          for node in ("before", "poison", "after")])
        status, body = http("POST", f"{healer.url}/v1/alertmanager", alerts)
        assert status == 200 and (body["firing"], body["failed"]) == (2, 1), body
        assert [(e["alert"], e["rule"]) for e in body["errors"]] == [(1, "xid")]
        assert sorted(i["node"] for i in healer.incidents()) == ["after", "before"]
        assert "poisoned row" in healer.log.read_text()  # why, for the operator
    finally:
        healer.stop()


def test_a_lock_held_for_ever_costs_a_request_its_statement_timeout_not_a_worker(tmp_path: Path, pg_url: str) -> None:
    healer = _healer(tmp_path, pg_url, db_timeout="1s").start()
    alerts = webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n1"}}])
    try:
        with psycopg.connect(_libpq(pg_url)) as locker:
            locker.execute("LOCK TABLE incidents IN ACCESS EXCLUSIVE MODE")  # held until this block ends
            for _ in range(3):
                started = time.monotonic()
                status, body = http("GET", f"{healer.url}/v1/incidents", token=None, timeout=8)
                assert status == 503 and time.monotonic() - started < 5, body
            status, body = http("POST", f"{healer.url}/v1/alertmanager", alerts, timeout=8)
            assert status == 503, body  # Alertmanager retries it later
        status, body = http("POST", f"{healer.url}/v1/alertmanager", alerts)
        assert status == 200 and body["firing"] == 1
        assert len(healer.incidents()) == 1
    finally:
        healer.stop()


@pytest.fixture
def own_postgres() -> Iterator[Postgres]:
    """A PostgreSQL of this test's own: it is frozen, which the session's shared one must never be."""
    pg = Postgres()
    pg.start()
    try:
        yield pg
    finally:
        _signal_all(pg, signal.SIGCONT)
        pg.stop()


def _signal_all(pg: Postgres, sig: int) -> None:
    pid_file = pg.dir / "data" / "postmaster.pid"
    if not pid_file.exists():
        return
    postmaster = psutil.Process(int(pid_file.read_text().split()[0]))
    for proc in [postmaster, *postmaster.children(recursive=True)]:
        proc.send_signal(sig)


def test_a_frozen_database_fails_readyz_and_the_api_answers_at_once(tmp_path: Path, own_postgres: Postgres) -> None:
    url = own_postgres.create_database("frozen")
    healer = _healer(tmp_path, url, db_timeout="1s").start()
    try:
        _signal_all(own_postgres, signal.SIGSTOP)  # the server hangs: no error, no answer, sockets stay open
        wait_for("/readyz to fail", lambda: http("GET", f"{healer.url}/readyz", token=None, timeout=5)[0] == 503, 15)
        started = time.monotonic()
        assert http("GET", f"{healer.url}/v1/incidents", token=None, timeout=5)[0] == 503
        assert time.monotonic() - started < 2
        status, body = http("GET", f"{healer.url}/readyz")
        assert "did not answer" in body["database"] or "has not answered" in body["database"], body
        _signal_all(own_postgres, signal.SIGCONT)
        wait_for("/readyz once it thaws", lambda: http("GET", f"{healer.url}/readyz", timeout=5)[0] == 200, 30)
        assert http("GET", f"{healer.url}/v1/incidents")[0] == 200
    finally:
        _signal_all(own_postgres, signal.SIGCONT)
        healer.stop()


def test_the_service_engine_sets_timeouts_and_keepalives(pg_url: str) -> None:
    engine = db.make_engine(pg_url, timeout=timedelta(seconds=3))
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "3s"
            assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "3s"
            params = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
        assert params["keepalives"] == "1" and params["tcp_user_timeout"] == "30000"
    finally:
        engine.dispose()
