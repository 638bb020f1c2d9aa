"""The self-heal loop's incidents mirrored into the healer's database (real SQLite and PostgreSQL) and a real
Alertmanager: one database incident per loop incident, across a take-over by a new healer process; never an
exception into the training loop when the database or Alertmanager is away.

    .venv/bin/python -m pytest -q tests/selfheal/test_incident_mirror.py
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from dashboards.incidents import RESTARTS_SQL, TIMINGS_SQL
from dashboards.training import GOODPUT_SQL
from healer.oncall.alertmanager import AlertmanagerClient
from healer.jsonl import append_jsonl
from healer.core.models import GoodputInterval, Remediation, Restart
from healer.runner.incident_mirror import IncidentMirror, severity_of
from healer.runner.selfheal import IncidentRecord
from tests.deploy.test_dashboard_sql import grafana_sql
from tests.healer.services import Alertmanager
from tests.support import free_port, wait_for

JOB = "llama-8b"
T0 = 1_717_000_000.123456


def _crash(**kw: Any) -> IncidentRecord:
    fields: dict[str, Any] = {"id": 1, "kind": "crash", "key": "crash:0", "summary": "rank 3 exited with -9 on node-b",
                              "suspect_nodes": ["node-b"], "suspect_ranks": [3], "detected_at": T0, "attempt": 1,
                              "evidence": {"exitcode": -9, "suspect_node": "node-b"}}
    return IncidentRecord(**(fields | kw))


def _journalled(inc: IncidentRecord) -> dict[str, Any]:
    """The incident as a healer that took the run over reads it back from incidents.jsonl."""
    return dict(json.loads(json.dumps(asdict(inc), default=str)))


def _play(mirror: IncidentMirror, inc: IncidentRecord, *events: str) -> None:
    """Each event as the loop journals it: the record changed as SelfHealLoop changes it, then written."""
    for event in events:
        if event == "diagnosed":
            inc.diagnosed_at, inc.verdict = T0 + 5, "fail"
            inc.diagnosis = [{"node": "node-b", "status": "fail", "summary": "gpu 2: XID 79", "seconds": 4.2}]
        elif event == "decided":
            inc.action = "exclude_and_restart"
            inc.plan = {"remedy": "exclude_and_restart", "decision_basis": {"reason": "node-b failed node-health"},
                        "exclude": ["node-b"], "nodes": ["node-a", "node-c"], "dp": 2}
        elif event == "restarted":
            inc.state, inc.remediated_at, inc.resume_step = "remediating", T0 + 8, 40
        elif event in ("recovered", "notified", "superseded"):
            inc.state, inc.recovered_at = "resolved", T0 + 30
        elif event == "escalated":
            inc.state = "escalated"
        elif event == "taken-over":
            inc.taken_over_at = T0 + 20
        mirror.record(asdict(inc), event, T0 + 1)


def _only_incident(mirror: IncidentMirror) -> dict[str, Any]:
    (row,) = mirror.store.list_incidents()
    return mirror.store.get(row["id"])


def _transitions(incident: dict[str, Any]) -> list[tuple[str | None, str | None]]:
    return [(e["from"], e["to"]) for e in incident["events"] if e["kind"] == "transition"]


def _notes(incident: dict[str, Any]) -> list[str]:
    return [e["evidence"]["event"] for e in incident["events"] if e["kind"] == "note"]


def test_a_healed_crash_is_one_resolved_incident_with_its_diagnosis_and_remediation(db_url: str) -> None:
    mirror = IncidentMirror.open(db_url, JOB)
    try:
        _play(mirror, _crash(), "detected", "diagnosed", "decided", "restarted", "recovered")
        incident = _only_incident(mirror)
        assert mirror.lost == 0
        assert (incident["state"], incident["rule"], incident["kind"], incident["severity"], incident["page"]) == \
            ("resolved", "selfheal-crash", "crash", "critical", "on-escalation")
        assert (incident["job"], incident["node"]) == (JOB, "node-b")
        assert _transitions(incident) == [(None, "open"), ("open", "diagnosing"), ("diagnosing", "remediating"),
                                          ("remediating", "resolved")]
        assert _notes(incident) == ["decided"]
        (run,) = incident["runbook_runs"]
        assert (run["runbook"], run["nodes"], run["verdict"]) == ("node-health", ["node-b"], "fail")
        assert "XID 79" in run["summary"]
        with Session(mirror.store.engine) as session:
            (remediation,) = session.execute(select(Remediation)).scalars()
        assert remediation.action == "exclude_and_restart" and remediation.basis["exclude"] == ["node-b"]
    finally:
        mirror.close()


def test_a_healer_that_takes_the_run_over_goes_on_with_the_same_incident(db_url: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    inc = _crash()
    first = IncidentMirror.open(db_url, JOB)
    _play(first, inc, "detected", "diagnosed", "decided", "restarted")
    first.close()  # the healer process dies; a new one reads the incident back from the journal
    second = IncidentMirror.open(db_url, JOB)
    try:
        resumed = IncidentRecord(**_journalled(inc))
        with caplog.at_level(logging.WARNING):
            _play(second, resumed, "taken-over", "restarted", "recovered")
        incident = _only_incident(second)
        assert incident["state"] == "resolved" and incident["occurrences"] == 1
        assert _transitions(incident)[-1] == ("remediating", "resolved")
        assert _notes(incident) == ["decided", "taken-over", "restarted"]  # restarted again: already remediating
        assert second.lost == 0 and caplog.records == [], "a take-over is no refused transition"
    finally:
        second.close()


def test_the_same_loop_incident_id_in_another_run_of_the_job_is_another_incident(tmp_path: Path) -> None:
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    _play(mirror, _crash(), "detected", "decided", "escalated")
    _play(mirror, _crash(detected_at=T0 + 3600), "detected")  # a new `megaheal run` numbers its incidents from 1
    assert sorted(i["state"] for i in mirror.store.list_incidents()) == ["escalated", "open"]


def test_an_event_the_state_table_refuses_is_skipped_and_noted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    inc = _crash()
    _play(mirror, inc, "detected", "decided", "escalated")
    with caplog.at_level(logging.WARNING):
        mirror.record(asdict(inc), "restarted", T0 + 9)  # escalated -> remediating is not a transition
    incident = _only_incident(mirror)
    assert incident["state"] == "escalated" and mirror.lost == 0
    assert _notes(incident) == ["decided", "restarted"]
    assert any("skipped" in r.getMessage() for r in caplog.records)


def test_an_event_whose_detection_the_database_missed_opens_the_incident_first(tmp_path: Path) -> None:
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    _play(mirror, _crash(), "decided", "restarted")
    incident = _only_incident(mirror)
    assert _transitions(incident) == [(None, "open"), ("open", "remediating")]


def test_mirrored_incidents_are_never_due_for_a_healer_service_on_the_same_database(tmp_path: Path) -> None:
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    inc = _crash()
    for event in ("detected", "diagnosed", "decided", "restarted"):
        _play(mirror, inc, event)
        assert mirror.store.due() == [], f"after {event} the service's respond tick would act on the incident"


def test_non_finite_evidence_is_stored_as_text(db_url: str) -> None:
    mirror = IncidentMirror.open(db_url, JOB)
    try:
        _play(mirror, _crash(kind="nonfinite", evidence={"loss": math.nan, "grad_norm": math.inf, "first_step": 41}),
              "detected")
        incident = _only_incident(mirror)
        assert mirror.lost == 0
        assert incident["evidence"]["detector"] == {"loss": "NaN", "grad_norm": "Infinity", "first_step": 41}
    finally:
        mirror.close()


@pytest.mark.parametrize(("kind", "severity"), [("crash", "critical"), ("hang", "critical"), ("gpu_fault", "critical"),
                                                ("nonfinite", "critical"), ("straggler", "warning"),
                                                ("loss_spike", "warning"), ("collective_slowdown", "warning")])
def test_only_faults_that_stop_the_job_or_poison_its_weights_are_critical(kind: str, severity: str) -> None:
    assert severity_of(kind) == severity


def test_an_escalated_incident_pages_through_alertmanager(tmp_path: Path) -> None:
    am = Alertmanager(tmp_path / "am", f"http://127.0.0.1:{free_port()}/unused")
    am.start()
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB, am.url, "http://healer:8470")
    client = AlertmanagerClient(am.url)

    def paging() -> dict[str, str]:
        found = [a["labels"] for a in client.alerts(['alertname="MegahealIncident"'])
                 if a["status"]["state"] == "active"]
        return {labels["page"]: labels for labels in found}

    try:
        inc = _crash()
        _play(mirror, inc, "detected", "decided")
        assert wait_for("the open incident's alert", paging, 15).keys() == {"false"}
        _play(mirror, inc, "escalated")
        pages = wait_for("the escalated incident to page", lambda: (p := paging()).keys() == {"true"} and p, 15)
        db_id = str(mirror.store.list_incidents()[0]["id"])
        assert pages["true"] == {"alertname": "MegahealIncident", "incident": db_id, "kind": "crash",
                                 "severity": "critical", "job": JOB, "node": "node-b", "page": "true"}
        assert mirror.lost == 0
    finally:
        mirror.close()
        am.stop()


def test_an_alertmanager_that_does_not_answer_leaves_the_resolution_to_be_sent_again(tmp_path: Path) -> None:
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB, f"http://127.0.0.1:{free_port()}", "http://h")
    _play(mirror, _crash(), "detected", "decided", "notified")
    assert _only_incident(mirror)["state"] == "resolved"
    assert [i.id for i in mirror.store.resolved_unnotified()] != []


def test_a_database_that_cannot_be_reached_loses_events_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    url = f"postgresql+psycopg://megaheal@127.0.0.1:{free_port()}/healer"
    with caplog.at_level(logging.WARNING, logger="healer.runner.incident_mirror"):
        mirror = IncidentMirror.open(url, JOB)
        _play(mirror, _crash(), "detected", "diagnosed", "decided")
    assert mirror.lost == 4  # the schema check at start, then each event
    (warning,) = [r for r in caplog.records if r.name == "healer.runner.incident_mirror"]
    assert "incidents.jsonl has it" in warning.getMessage() and "Connection refused" in warning.getMessage()


# ---- the goodput ledger and the restarts ----------------------------------------------------------------------
# A crash healed by a restart, in seconds from the detection (T0): attempt 1 starts at -50, its steps 0..44 take
# 1 s each from -48 (step 39 saves: a 0.5 s stall); it dies after step 44 (-3) and is detected at 0, diagnosed
# at 5, decided at 6 (node-b excluded); attempt 2 starts at 8 from the checkpoint of step 40 (steps 40..44 are
# lost), its first step begins at 12, steps 40..59 end at 32, and it ends at 34. Wall 84 s: 59.5 productive,
# 0.5 checkpointing, 5 lost, 3 detection, 6 diagnosis, 2 restart, 6 startup, 2 other.
LEDGER = [("startup", -50, -48, False, None), ("productive", -48, -8.5, False, 40),
          ("checkpointing", -8.5, -8, False, None), ("lost", -8, -3, True, 5), ("detection", -3, 0, True, None),
          ("diagnosis", 0, 6, True, None), ("restart", 6, 8, True, None), ("startup", 8, 12, False, None),
          ("productive", 12, 32, False, 20), ("other", 32, 34, False, None)]


def _event(run_dir: Path, mirror: IncidentMirror | None, inc: IncidentRecord, event: str, at: float) -> None:
    """As SelfHealLoop._write: the journal first, then the mirror (None: the database missed the event)."""
    append_jsonl(run_dir / "incidents.jsonl", {"event": event, "at": at, "incident": asdict(inc)})
    if mirror is not None:
        mirror.record(asdict(inc), event, at)


def _attempt(run_dir: Path, event: str, attempt: int, at: float) -> None:
    append_jsonl(run_dir / "supervisor" / "attempts.jsonl", {"event": event, "attempt": attempt, "at": at,
                                                             **({"nodes": ["node-a", "node-c"], "dp": 2}
                                                                if event == "start" else {})})


def _steps(run_dir: Path, steps: range, first_ends_at: float) -> None:
    for n, step in enumerate(steps):
        append_jsonl(run_dir / "ranks" / "0.jsonl", {"step": step, "time": first_ends_at + n, "step_seconds": 1.0,
                                                     "phases": {"checkpoint": 0.5 if step == 39 else 1e-5}})


def _crashed_and_restarted(run_dir: Path, mirror: IncidentMirror | None, t0: float = T0) -> IncidentRecord:
    inc = _crash(detected_at=t0)
    _attempt(run_dir, "start", 1, t0 - 50)
    _steps(run_dir, range(45), t0 - 47)
    _event(run_dir, mirror, inc, "detected", t0)
    _attempt(run_dir, "end", 1, t0 + 1)
    inc.diagnosed_at, inc.verdict = t0 + 5, "fail"
    inc.diagnosis = [{"node": "node-b", "status": "fail", "summary": "gpu 2: XID 79", "seconds": 4.2}]
    _event(run_dir, mirror, inc, "diagnosed", t0 + 5)
    inc.action, inc.plan = "exclude_and_restart", {"remedy": "exclude_and_restart", "exclude": ["node-b"],
                                                   "nodes": ["node-a", "node-c"], "dp": 2}
    _event(run_dir, mirror, inc, "decided", t0 + 6)
    _attempt(run_dir, "start", 2, t0 + 8)
    inc.state, inc.remediated_at, inc.resume_step = "remediating", t0 + 8, 40
    _event(run_dir, mirror, inc, "restarted", t0 + 8)
    return inc


def _recovered(run_dir: Path, mirror: IncidentMirror | None, inc: IncidentRecord, t0: float = T0) -> None:
    _steps(run_dir, range(40, 60), t0 + 13)
    inc.state, inc.recovered_at, inc.first_step_after, inc.highest_step, inc.lost_steps = "resolved", t0 + 13, 40, 44, 5
    _event(run_dir, mirror, inc, "recovered", t0 + 13)
    _attempt(run_dir, "end", 2, t0 + 34)


def _ledger_rows(mirror: IncidentMirror, t0: float = T0) -> list[tuple[Any, ...]]:
    """(kind, start, end in seconds from t0, incident id, steps) of the job's goodput rows, in time order."""
    at = datetime.fromtimestamp(t0, UTC)
    with Session(mirror.store.engine) as session:
        rows = session.scalars(select(GoodputInterval).where(GoodputInterval.job == JOB)
                               .order_by(GoodputInterval.started_at)).all()
        return [(r.kind, round((r.started_at - at).total_seconds(), 3), round((r.ended_at - at).total_seconds(), 3),
                 r.incident_id, r.steps) for r in rows]


def _restart_rows(mirror: IncidentMirror) -> list[dict[str, Any]]:
    with Session(mirror.store.engine) as session:
        return [{c.name: getattr(r, c.name) for c in Restart.__table__.columns}
                for r in session.scalars(select(Restart).order_by(Restart.requested_at))]


def _expected(db_id: int | None) -> list[tuple[Any, ...]]:
    return [(kind, a, b, db_id if linked else None, steps) for kind, a, b, linked, steps in LEDGER]


def test_the_ledger_is_written_as_intervals_and_a_restart_linked_to_the_database_incident(db_url: str,
                                                                                         tmp_path: Path) -> None:
    mirror = IncidentMirror.open(db_url, JOB)
    try:
        run = tmp_path / "run"
        _recovered(run, mirror, _crashed_and_restarted(run, mirror))
        mirror.write_ledger(run)
        db_id = _only_incident(mirror)["id"]
        assert mirror.lost == 0
        assert _ledger_rows(mirror) == _expected(db_id)
        (restart,) = _restart_rows(mirror)
        at = datetime.fromtimestamp(T0, UTC)
        assert (restart["job"], restart["incident_id"], restart["from_step"], restart["resumed_step"],
                restart["nodes"], restart["excluded"], restart["outcome"]) == \
            (JOB, db_id, 40, 40, ["node-a", "node-c"], ["node-b"], "recovered")
        assert restart["requested_at"] - at == timedelta(seconds=6) and restart["resumed_at"] - at == timedelta(seconds=13)
    finally:
        mirror.close()


def test_writing_the_ledger_again_replaces_the_run_s_rows_and_then_leaves_them_as_they_are(db_url: str,
                                                                                          tmp_path: Path) -> None:
    mirror = IncidentMirror.open(db_url, JOB)
    try:
        run = tmp_path / "run"
        inc = _crashed_and_restarted(run, mirror)
        mirror.write_ledger(run)  # while attempt 2 starts up: the wall ends at its start, the restart is pending
        assert _ledger_rows(mirror)[-1][:3] == ("restart", 6, 8)
        (pending,) = _restart_rows(mirror)
        assert pending["outcome"] is None and pending["resumed_at"] is None
        _recovered(run, mirror, inc)
        mirror.write_ledger(run)
        first = (_ledger_rows(mirror), _restart_rows(mirror))
        mirror.write_ledger(run)
        assert (_ledger_rows(mirror), _restart_rows(mirror)) == first
        assert first[0] == _expected(_only_incident(mirror)["id"])
        assert [r["id"] for r in first[1]] == [pending["id"]] and first[1][0]["outcome"] == "recovered"
        assert mirror.lost == 0
    finally:
        mirror.close()


def test_ledger_rows_of_an_incident_the_database_missed_have_no_incident(tmp_path: Path) -> None:
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    run = tmp_path / "run"
    _recovered(run, None, _crashed_and_restarted(run, None))
    mirror.write_ledger(run)
    assert mirror.lost == 0 and mirror.store.list_incidents() == []
    assert _ledger_rows(mirror) == _expected(None)
    assert [r["incident_id"] for r in _restart_rows(mirror)] == [None]


def test_another_run_of_the_same_job_keeps_its_ledger(tmp_path: Path) -> None:
    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    earlier, later = tmp_path / "earlier", tmp_path / "later"
    _recovered(earlier, mirror, _crashed_and_restarted(earlier, mirror))
    mirror.write_ledger(earlier)
    _recovered(later, mirror, _crashed_and_restarted(later, mirror, T0 + 3600), T0 + 3600)
    mirror.write_ledger(later)
    mirror.write_ledger(earlier)
    first, second = sorted(i["id"] for i in mirror.store.list_incidents())
    assert _ledger_rows(mirror)[:len(LEDGER)] == _expected(first)
    assert _ledger_rows(mirror, T0 + 3600)[len(LEDGER):] == _expected(second)
    assert [r["incident_id"] for r in _restart_rows(mirror)] == [first, second]


def test_a_ledger_the_database_cannot_take_is_lost_without_raising(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _recovered(run, None, _crashed_and_restarted(run, None))
    mirror = IncidentMirror.open(f"postgresql+psycopg://megaheal@127.0.0.1:{free_port()}/healer", JOB)
    mirror.write_ledger(run)
    assert mirror.lost == 2  # the schema check at start, then the ledger


def test_the_dashboards_read_ettr_detection_lost_work_and_the_restart_from_the_written_ledger(
        pg_url: str, tmp_path: Path) -> None:
    mirror = IncidentMirror.open(pg_url, JOB)
    try:
        run = tmp_path / "run"
        _recovered(run, mirror, _crashed_and_restarted(run, mirror))
        mirror.write_ledger(run)
        db_id = _only_incident(mirror)["id"]
        since, until = datetime.fromtimestamp(T0 - 3600, UTC), datetime.now(UTC) + timedelta(hours=1)

        def query(sql: str) -> list[dict[str, Any]]:
            with mirror.store.engine.connect() as conn:
                return [dict(r) for r in conn.execute(text(grafana_sql(sql, since, until, JOB))).mappings()]

        (ledger,) = query(GOODPUT_SQL)
        assert float(ledger["ETTR"]) == pytest.approx(60 / 84) and float(ledger["Goodput"]) == pytest.approx(59.5 / 84)
        (timings,) = query(TIMINGS_SQL)
        assert timings["incident"] == db_id
        assert float(timings["detection"]) == pytest.approx(3) and float(timings["lost work"]) == pytest.approx(5)
        (restart,) = query(RESTARTS_SQL)
        assert (restart["incident"], restart["from step"], restart["resumed at step"], restart["excluded nodes"],
                restart["outcome"]) == (db_id, 40, 40, '["node-b"]', "recovered")
    finally:
        mirror.close()


def test_the_ledger_writer_writes_when_poked_and_once_more_when_it_stops(tmp_path: Path) -> None:
    from healer.runner.incident_mirror import MirrorWorker

    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    writer = MirrorWorker(mirror, tmp_path / "run", every=timedelta(hours=1))  # only pokes and the stop write
    try:
        run = tmp_path / "run"
        inc = _crashed_and_restarted(run, mirror)
        writer.start()
        writer.poke()
        wait_for("the poked write", lambda: _restart_rows(mirror), 10)
        assert _restart_rows(mirror)[0]["outcome"] is None  # not recovered yet
        _recovered(run, mirror, inc)
        writer.stop()  # the final write sees the recovery
        assert _restart_rows(mirror)[0]["outcome"] == "recovered" and mirror.lost == 0
    finally:
        writer.stop()
        mirror.close()


def test_events_given_to_the_worker_reach_the_database_in_order_off_the_caller_s_thread(tmp_path: Path) -> None:
    from healer.runner.incident_mirror import MirrorWorker

    mirror = IncidentMirror.open(f"sqlite:///{tmp_path / 'h.db'}", JOB)
    worker = MirrorWorker(mirror, tmp_path / "run", every=timedelta(hours=1))
    try:
        inc = _crash()
        for event in ("detected", "diagnosed", "decided", "restarted", "recovered"):
            worker.record(_journalled(inc), event, 100.0)  # returns at once: nothing is written yet
        assert mirror.store.list_incidents() == []
        worker.start()
        worker.stop()  # drains the queue first
        incident = _only_incident(mirror)
        assert incident["state"] == "resolved" and mirror.lost == 0
        assert [to for _, to in _transitions(incident) if to] == ["open", "diagnosing", "remediating", "resolved"]
    finally:
        worker.stop()
        mirror.close()
