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
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from healer.alertmanager import AlertmanagerClient
from healer.models import Remediation
from healer.supervisor.incident_mirror import IncidentMirror, severity_of
from healer.supervisor.selfheal import IncidentRecord
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
    with caplog.at_level(logging.WARNING, logger="healer.supervisor.incident_mirror"):
        mirror = IncidentMirror.open(url, JOB)
        _play(mirror, _crash(), "detected", "diagnosed", "decided")
    assert mirror.lost == 4  # the schema check at start, then each event
    (warning,) = [r for r in caplog.records if r.name == "healer.supervisor.incident_mirror"]
    assert "incidents.jsonl has it" in warning.getMessage() and "Connection refused" in warning.getMessage()
