"""End to end with a real Prometheus and Alertmanager: a Prometheus alert rule fires -> Alertmanager calls the healer's
webhook -> an incident opens -> the healer posts it to Alertmanager -> Alertmanager's API lists it; a promql rule
evaluated against the live Prometheus opens an incident too; when the fault clears, both resolve."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, start_http_server
import pytest

from healer.oncall.alertmanager import AlertmanagerClient
from tests.healer.services import Alertmanager, HealerProcess, Prometheus, free_port, http, wait_for

pytestmark = pytest.mark.services


def _incident_alerts(am: AlertmanagerClient) -> dict[str, dict[str, str]]:
    return {a["labels"]["incident"]: a["labels"] for a in am.alerts(['alertname="MegahealIncident"'])
            if a["status"]["state"] == "active"}


def test_alerts_and_promql_rules_become_incidents_that_alertmanager_lists(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    fault = Gauge("megaheal_test_fault", "1 while the injected fault lasts", ["job", "node"], registry=registry)
    fault.labels("train", "node-3").set(1)
    metrics_port = free_port()
    server, thread = start_http_server(metrics_port, addr="127.0.0.1", registry=registry)

    healer_port = free_port()
    am = Alertmanager(tmp_path / "am", f"http://127.0.0.1:{healer_port}/v1/alertmanager")
    prom = Prometheus(tmp_path / "prom", f"127.0.0.1:{metrics_port}", f"127.0.0.1:{am.port}", [
        {"alert": "TrainingFault", "expr": "megaheal_test_fault > 0", "for": "0s", "labels": {"severity": "critical"},
         "annotations": {"summary": "fault injected on {{ $labels.node }}"}}])
    rules = tmp_path / "rules.yaml"
    rules.write_text("- name: training-fault\n  when: {alert: TrainingFault}\n  severity: critical\n  page: always\n"
                     "- name: fault-series\n  when: {promql: 'megaheal_test_fault > 0', for: 1s}\n")
    healer = HealerProcess(tmp_path / "healer", {
        "listen": f"127.0.0.1:{healer_port}", "db": f"sqlite:///{tmp_path / 'h.db'}", "rules": [str(rules)],
        "prometheus_url": prom.url, "alertmanager_urls": [am.url], "promql_interval": "500ms",
        "alertmanager_resend": "1s", "respond_interval": "200ms", "notify_interval": "200ms"})
    try:
        healer.start()
        am.start()
        prom.start()
        client = AlertmanagerClient(am.url)
        by_rule = wait_for("both incidents", lambda: {i["rule"]: i for i in healer.incidents()}
                           if len(healer.incidents()) == 2 else None, 60)
        alert_incident, promql_incident = by_rule["training-fault"], by_rule["fault-series"]
        assert (alert_incident["summary"], alert_incident["node"], alert_incident["job"]) == (
            "fault injected on node-3", "node-3", "train")
        assert alert_incident["labels"]["severity"] == "critical"
        assert promql_incident["evidence"]["value"] == 1 and promql_incident["node"] == "node-3"

        listed = wait_for("Alertmanager to list both incidents",
                          lambda: (lambda got: got if len(got) == 2 else None)(_incident_alerts(client)), 30)
        mine = listed[str(alert_incident["id"])]
        assert (mine["kind"], mine["severity"], mine["job"], mine["node"], mine["page"]) == (
            "trainingfault", "critical", "train", "node-3", "true")
        assert listed[str(promql_incident["id"])]["page"] == "false"

        fault.labels("train", "node-3").set(0)  # the fault clears: Prometheus resolves, Alertmanager tells the healer
        wait_for("both incidents resolved", lambda: not healer.incidents("open", "diagnosing", "remediating"), 60)
        events = healer.incident(alert_incident["id"])["events"]
        assert events[-1]["to"] == "resolved" and events[-1]["evidence"]["reason"] == "Alertmanager resolved the alert"
        wait_for("Alertmanager to drop the resolved incidents", lambda: _incident_alerts(client) == {}, 30)
        status, text = http("GET", f"{healer.url}/metrics")
        assert status == 200 and 'megaheal_healer_sink_deliveries_total{result="ok",sink="alertmanager"}' in text
        assert 'megaheal_healer_rule_evaluations_total{result="ok",rule="fault-series"}' in text
    finally:
        healer.stop()
        prom.stop()
        am.stop()
        server.shutdown()
        server.server_close()
        thread.join(5)
