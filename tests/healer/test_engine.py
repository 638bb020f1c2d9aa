"""The healer's core, in process: heartbeats -> heartbeat_stale -> incidents, Alertmanager webhooks, responding
(diagnosis with real runbooks, deadlines), and the webhook sink."""

from __future__ import annotations

from pathlib import Path

import pytest

from healer.decide.states import IncidentState
from healer.detect.heartbeat_stale import HeartbeatStale
from healer.engine.engine import AFTER_BLIND_S
from healer.errors import BadRequest
from healer.observe.heartbeats import HeartbeatTable
from healer.oncall.sinks import WebhookSink
from healer.service.diagnosis import LocalRunbookDiagnoser
from tests.healer.helpers import RUNBOOKS, ManualClock, Receiver, batch, make_healer
from tests.healer.services import wait_for, webhook

pytestmark = pytest.mark.unit

STALE = "- name: stale\n  when: {detector: heartbeat_stale, after: 30s}\n  severity: critical\n"


def test_heartbeat_stale_fires_per_node_and_sees_healthy_nodes() -> None:
    clock = ManualClock()
    table = HeartbeatTable(clock=clock)
    table.ingest(batch("n1", [0, 1, 2, 3]))
    table.ingest(batch("n2", [4, 5, 6, 7], age=40.0))  # the sidecar lives, its ranks went silent 40 s ago
    detector = HeartbeatStale(HeartbeatStale.Config())
    result = detector.evaluate(table, clock.now)
    assert [f.key for f in result.firing] == ["job/n2"] and result.healthy == {"job/n1"}
    assert result.firing[0].evidence["stale_ranks"] == 4 and "4 of 4 ranks on n2" in result.firing[0].summary
    clock.now += 31  # now n1's sidecar has been silent too
    assert {f.key for f in detector.evaluate(table, clock.now).firing} == {"job/n1", "job/n2"}
    picky = HeartbeatStale(HeartbeatStale.Config(min_ranks=5))
    assert picky.evaluate(table, clock.now).firing == ()


def test_a_silent_node_opens_one_incident_that_resolves_when_it_reports_again(tmp_path: Path) -> None:
    clock = ManualClock()
    healer = make_healer(tmp_path, STALE, clock)
    healer.ingest_heartbeats(batch("n1", [0, 1]))
    healer.tick_detect()
    assert healer.store.list_incidents() == []
    clock.now += 45
    for _ in range(3):  # still silent on every cycle: still one incident, no recurrence
        healer.tick_detect()
    (incident,) = healer.store.list_incidents()
    assert (incident["kind"], incident["node"], incident["state"], incident["occurrences"]) == (
        "heartbeat_stale", "n1", "open", 1)
    healer.ingest_heartbeats(batch("n1", [0, 1], seq=1))
    healer.tick_detect()
    got = healer.store.get(incident["id"])
    assert got["state"] == "resolved" and got["events"][-1]["evidence"]["reason"] == "stale: healthy again"


BLIND = ("- name: lost\n  when: {detector: host_lost, after: 15s}\n"
         "- name: stale\n  when: {detector: heartbeat_stale, after: 30s}\n"
         "- name: blind\n  when: {detector: healer_blind, after: 8s}\n")


def test_a_healer_that_hears_from_no_host_says_so_once_and_names_no_host(tmp_path: Path) -> None:
    # Three hosts of a launched job fall silent together (the healer's own link was cut, say) for a minute: each
    # would be a lost host and a stale node. One blind incident is opened instead, none against a host; once two
    # of them are heard again, the third, still silent, is a lost host as before, after AFTER_BLIND_S (the first
    # batches heard again may be ones buffered while cut off).
    clock = ManualClock()
    healer = make_healer(tmp_path, BLIND, clock)
    nodes = ("n1", "n2", "n3")
    healer.table.processes.started("job", 0, nodes, clock.now)
    for i, node in enumerate(nodes):
        healer.ingest_heartbeats(batch(node, [i]))
    healer.tick_detect()
    for _ in range(12):
        clock.now += 5
        healer.tick_detect()
    (blind,) = healer.store.list_incidents()
    assert (blind["kind"], blind["node"], blind["state"]) == ("healer_blind", None, "open"), blind
    assert "heard from 0 of 3 hosts" in blind["summary"]
    for seq, node in enumerate(("n1", "n2"), start=1):
        healer.ingest_heartbeats(batch(node, [nodes.index(node)], seq=seq))
    healer.tick_detect()
    assert healer.store.get(blind["id"])["state"] == "resolved"
    seq = 3
    for _ in range(3):
        assert not [i for i in healer.store.list_incidents() if i["kind"] == "host_lost"], "within AFTER_BLIND_S"
        clock.now += AFTER_BLIND_S / 3
        for node in ("n1", "n2"):
            healer.ingest_heartbeats(batch(node, [nodes.index(node)], seq=seq))
            seq += 1
        healer.tick_detect()
    lost = [i for i in healer.store.list_incidents() if i["kind"] == "host_lost"]
    assert [i["node"] for i in lost] == ["n3"], lost


def test_alert_rules_match_by_name_and_labels_and_resolve_with_the_alert(tmp_path: Path) -> None:
    healer = make_healer(tmp_path, '- name: xid\n  when: {alert: GpuXid, labels: {xid: "79"}}\n  severity: critical\n')
    firing = {"status": "firing", "labels": {"alertname": "GpuXid", "xid": "79", "node": "n3", "job": "j"},
              "annotations": {"summary": "GPU fell off the bus"}}
    other = {"status": "firing", "labels": {"alertname": "GpuXid", "xid": "13", "node": "n3"}}
    own = {"status": "firing", "labels": {"alertname": "MegahealIncident", "incident": "1"}}
    assert healer.handle_alertmanager(webhook([firing, other, own])) == {
        "firing": 1, "resolved": 0, "unmatched": 1, "ignored": 1, "failed": 0}
    healer.handle_alertmanager(webhook([firing]))  # Alertmanager repeats itself: no second incident
    (incident,) = healer.store.list_incidents()
    assert (incident["summary"], incident["node"], incident["job"]) == ("GPU fell off the bus", "n3", "j")
    healer.handle_alertmanager(webhook([{**firing, "status": "resolved"}]))
    assert healer.store.get(incident["id"])["state"] == "resolved"
    with pytest.raises(BadRequest, match=r"alerts\[0\]\.labels\.xid: expected a string"):
        healer.handle_alertmanager(webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "xid": 79}}]))


def test_it_diagnoses_with_a_real_runbook_then_remediates(tmp_path: Path) -> None:
    rules = (f"- name: xid\n  when: {{alert: GpuXid}}\n  runbook: {RUNBOOKS / 'host-no-space.yaml'}\n"
             "  recovery_deadline: 1h\n")
    diagnoser = LocalRunbookDiagnoser(workers=1)
    healer = make_healer(tmp_path, rules, diagnoser=diagnoser)
    try:
        healer.handle_alertmanager(webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "node-7"}}]))
        healer.tick_respond()
        (incident,) = healer.store.list_incidents()
        assert incident["state"] == "diagnosing"
        wait_for("the runbook's verdict", lambda: healer.store.get(incident["id"])["runbook_runs"][0]["verdict"], 60)
        healer.tick_respond()
        got = healer.store.get(incident["id"])
    finally:
        diagnoser.shutdown()
    run = got["runbook_runs"][0]
    assert (run["runbook"], run["nodes"], run["verdict"]) == ("host-no-space", ["node-7"], "fail")
    assert [(e["kind"], e["to"]) for e in got["events"]] == [
        ("transition", "open"), ("transition", "diagnosing"), ("diagnosed", None), ("transition", "remediating")]
    assert got["events"][-1]["evidence"]["decision"]["basis"]["verdict"] == "fail"


def test_deadlines_escalate_and_a_second_healer_on_the_same_database_does_not_act_twice(tmp_path: Path) -> None:
    clock = ManualClock()
    rules = "- name: xid\n  when: {alert: GpuXid}\n  recovery_deadline: 60s\n"
    a = make_healer(tmp_path, rules, clock)
    b = make_healer(tmp_path, rules, clock)  # same file, same rules: a second replica
    a.handle_alertmanager(webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n1"}}]))
    b.handle_alertmanager(webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n1"}}]))
    (incident,) = a.store.list_incidents()
    assert incident["occurrences"] == 2  # b joined a's incident
    stale = a.store.due()  # both replicas read the same due incident ...
    a.tick_respond()
    b.responder.respond(stale[0], stale[0].next_action_at)  # ... and b acts on its stale copy after a did
    assert b.metrics.claims_lost._value.get() == 1
    assert [e["to"] for e in a.store.get(incident["id"])["events"] if e["kind"] == "transition"] == ["open", "remediating"]
    clock.now += 61
    a.tick_respond()
    assert a.store.get(incident["id"])["state"] == IncidentState.ESCALATED.value


def test_the_webhook_sink_gets_every_change_and_retries_transient_failures(tmp_path: Path) -> None:
    receiver = Receiver(status=503)
    try:
        healer = make_healer(tmp_path, "- name: xid\n  when: {alert: GpuXid}\n", sinks=[WebhookSink(receiver.url, "s3cret")])
        healer.handle_alertmanager(webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n1"}}]))
        healer.tick_respond()
        healer.tick_notify()
        assert len(receiver.bodies) == 2 and healer.sinks.delivered[("webhook", "retry")] == 2
        receiver.status = 200
        healer.tick_notify()
        events = [(b["event"], b["to"]) for b in receiver.bodies[2:]]
        assert events == [("opened", "open"), ("transition", "remediating")]
        assert receiver.headers[-1]["Authorization"] == "Bearer s3cret"
        assert receiver.bodies[-1]["incident"]["node"] == "n1"
    finally:
        receiver.close()


def test_one_silent_node_among_twelve_thousand_ranks_is_the_only_incident(tmp_path: Path) -> None:
    clock = ManualClock()
    healer = make_healer(tmp_path, STALE, clock)
    for node in range(1536):
        healer.ingest_heartbeats(batch(f"n{node}", list(range(node * 8, node * 8 + 8))))
    healer.tick_detect()
    clock.now += 20
    for node in range(1536):
        if node != 700:
            healer.ingest_heartbeats(batch(f"n{node}", list(range(node * 8, node * 8 + 8)), seq=1))
    clock.now += 15
    healer.tick_detect()
    assert len(healer.table) == 12288
    assert [(i["node"], i["evidence"]["stale_ranks"]) for i in healer.store.list_incidents()] == [("n700", 8)]
    assert healer.metrics.detection_cycle._sum.get() > 0


GPU = "- name: gpu\n  when: {detector: gpu_fault}\n  severity: critical\n"


def test_a_faulty_gpus_incident_resolves_once_its_node_reports_it_clean_and_healthy_keys_are_made_only_then(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from healer.detect import base

    made = []
    real = base.LazyKeys._made
    monkeypatch.setattr(base.LazyKeys, "_made", lambda self: made.append(self._make is not None) or real(self))
    clock = ManualClock()
    healer = make_healer(tmp_path, GPU, clock)
    body = batch("n1", [0, 1])
    body["gpus"] = [{"gpu": 0}, {"gpu": 1}]
    healer.ingest_heartbeats(body)
    healer.tick_detect()
    assert healer.store.list_incidents() == [] and made == [], "no open incident: no healthy key was looked up"
    body["gpus"][1] = {"gpu": 1, "xid_counts": {"79": 1}}  # fell off the bus
    healer.ingest_heartbeats({**body, "seq": 1})
    healer.tick_detect()
    (incident,) = healer.store.list_incidents()
    assert incident["node"] == "n1" and incident["state"] == "open"
    body["gpus"][1] = {"gpu": 1}  # reset, and clean again
    healer.ingest_heartbeats({**body, "seq": 2})
    healer.tick_detect()
    got = healer.store.get(incident["id"])
    assert got["state"] == "resolved" and got["events"][-1]["evidence"]["key"] == "n1/gpu1"
    assert True in made, "the open incident's key was looked up among the healthy ones"
