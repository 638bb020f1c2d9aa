"""What the sinks send: Alertmanager alerts of incidents (labels, endsAt, the page flag), and the optional Grafana sink."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from healer.errors import SinkError
from healer.incidents.models import Incident
from healer.oncall.sinks import GrafanaSink, alertmanager_alerts

pytestmark = pytest.mark.unit

NOW = datetime(2024, 6, 1, 12, 0, tzinfo=timezone.utc)


def _incident(state: str, page: str = "on-escalation", **kw: object) -> Incident:
    fields = dict(id=7, rule="stale", kind="heartbeat_stale", severity="critical", page=page, state=state, job="j",
                  node="n1", summary="8 ranks silent", occurrences=1, opened_at=NOW - timedelta(minutes=5),
                  resolved_at=None)
    fields.update(kw)
    return Incident(**fields)


def test_an_active_incident_is_an_alert_held_a_few_resends_ahead() -> None:
    (alert, _twin) = alertmanager_alerts([_incident("remediating")], NOW, timedelta(minutes=2), "http://healer:8470")
    assert alert["labels"] == {"alertname": "MegahealIncident", "incident": "7", "kind": "heartbeat_stale",
                               "severity": "critical", "job": "j", "node": "n1", "page": "false"}
    assert alert["endsAt"] == (NOW + timedelta(minutes=2)).isoformat()
    assert alert["startsAt"] == (NOW - timedelta(minutes=5)).isoformat()
    assert alert["annotations"]["state"] == "remediating"
    assert alert["generatorURL"] == "http://healer:8470/incidents/7"


def test_escalation_pages_and_resolves_the_not_paging_variant() -> None:
    alert, twin = alertmanager_alerts([_incident("escalated")], NOW, timedelta(minutes=2), "http://h")
    assert alert["labels"]["page"] == "true" and twin["labels"]["page"] == "false"
    assert twin["endsAt"] == NOW.isoformat() and twin["labels"]["incident"] == "7"


@pytest.mark.parametrize("page", ["always", "on-escalation"])
def test_a_resolved_incident_ends_both_its_paging_and_its_quiet_alert_when_it_was_resolved(page: str) -> None:
    # NOTE: an escalated (or always-paging) incident's alert carried page="true"; resolved, it is page="false":
    # a different alert in Alertmanager, so the paging one must be ended too or it pages until its hold runs out.
    resolved_at = NOW - timedelta(seconds=30)
    alerts = alertmanager_alerts([_incident("resolved", page=page, resolved_at=resolved_at)], NOW,
                                 timedelta(minutes=2), "http://h")
    assert sorted(a["labels"]["page"] for a in alerts) == ["false", "true"]
    assert {a["endsAt"] for a in alerts} == {resolved_at.isoformat()}


def test_a_quiet_incident_that_never_pages_sends_one_alert() -> None:
    (alert,) = alertmanager_alerts([_incident("resolved", page="never", resolved_at=NOW)], NOW, timedelta(minutes=2),
                                   "http://h")
    assert alert["labels"]["page"] == "false"


def test_the_grafana_sink_says_how_to_install_its_extra() -> None:
    try:
        import grafana_client  # noqa: F401
    except ImportError:
        with pytest.raises(SinkError, match=r"pip install 'megaheal\[grafana\]'") as info:
            GrafanaSink("http://grafana:3000", "token")
        assert info.value.permanent
    else:
        pytest.skip("grafana-client is installed here: the missing-extra message cannot be shown")
