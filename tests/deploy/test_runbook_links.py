"""Runbook links are absolute under one configurable base, made the same way by Prometheus (the external label
runbook_base, deploy/prometheus/rules/alerts.yml) and by the healer (its MegahealIncident alerts), and point at
sections that exist."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from healer.incidents.models import Incident
from healer.oncall.alertmanager import INCIDENT_RUNBOOK_ANCHOR, check_runbook_base, runbook_url
from healer.oncall.sinks import alertmanager_alerts
from tests.deploy.configs import OPERATIONS, PROMETHEUS_DIR, load_yaml, markdown_anchors, unit_tests

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 5, 18, 0, tzinfo=UTC)
BASE = "https://docs.example.org/megaheal/docs"


def _incident() -> Incident:
    return Incident(id=3, rule="stale", kind="heartbeat_stale", severity="critical", page="always", state="escalated",
                    job="j", node="n1", summary="8 ranks silent", occurrences=1, opened_at=NOW - timedelta(minutes=1),
                    resolved_at=None)


def test_the_healers_incident_alerts_link_their_runbook_under_the_configured_base() -> None:
    linked = alertmanager_alerts([_incident()], NOW, timedelta(minutes=2), "https://healer.example", BASE + "/")
    assert {a["annotations"]["runbook_url"] for a in linked} == {f"{BASE}/operations.md#the-incident-page"}
    plain = alertmanager_alerts([_incident()], NOW, timedelta(minutes=2), "https://healer.example")
    assert {a["annotations"]["runbook_url"] for a in plain} == {"docs/operations.md#the-incident-page"}
    assert INCIDENT_RUNBOOK_ANCHOR in markdown_anchors(OPERATIONS)


def test_prometheus_renders_the_links_the_healer_would_make_for_the_same_base() -> None:
    # NOTE: the promtool unit tests (tests/deploy/test_configs.py runs them) prove these are what Prometheus
    # renders, with and without the label; here they are held to the healer's rule for a base.
    checked = {None: 0, BASE: 0}
    for group in unit_tests():
        base = group.get("external_labels", {}).get("runbook_base")
        for case in group.get("alert_rule_test", []):
            for alert in case.get("exp_alerts", []):
                assert alert["exp_annotations"]["runbook_url"] == runbook_url(base, case["alertname"].lower())
                checked[base] += 1
    assert all(checked.values()), f"alerts checked per base: {checked}"


@pytest.mark.parametrize("base", [BASE, "http://wiki:8080/megaheal/docs", "file:///opt/megaheal/docs"])
def test_an_absolute_base_is_taken(base: str) -> None:
    check_runbook_base(base)


@pytest.mark.parametrize("base", ["docs", "/srv/megaheal/docs", "docs.example.org/megaheal", "https:///docs",
                                  "file://relative/docs", "ftp://host/docs", f"{BASE}#operations", f"{BASE}?x=1"])
def test_a_base_that_is_not_an_absolute_link_is_refused_by_name(base: str) -> None:
    with pytest.raises(ValueError, match=r"^runbook_base must be the absolute URL"):
        check_runbook_base(base)


def test_the_shipped_prometheus_config_sets_no_base_or_an_absolute_one() -> None:
    base = load_yaml(PROMETHEUS_DIR / "prometheus.yml")["global"]["external_labels"].get("runbook_base")
    if base is not None:
        check_runbook_base(base, "prometheus.yml global.external_labels.runbook_base")
        assert not base.endswith("/"), "the rules add /operations.md themselves"
