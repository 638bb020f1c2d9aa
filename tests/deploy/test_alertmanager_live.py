"""Live: a real Alertmanager (Debian's package) loaded with deploy/alertmanager/alertmanager.yml as it is. Each alert
of the rule file, posted with its own labels, is routed to its owner; the fleet's GPU alerts are held back while the
healer's own gpu_fault incident on the same node is open (the healer's real incident alert) or the node is down,
and come back when that incident resolves; a job's ETTR ticket is held back while its burn pages. amtool cannot show
inhibitions; only a running Alertmanager can."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from healer.incidents.models import Incident
from healer.oncall.alertmanager import AlertmanagerClient
from healer.oncall.sinks import alertmanager_alerts
from tests.deploy.configs import ALERTMANAGER, ALERTS, rules
from tests.healer.services import Alertmanager
from tests.support import wait_for

pytestmark = pytest.mark.services

HOLD = timedelta(minutes=10)


@pytest.fixture
def deployed_alertmanager(tmp_path: Path) -> Iterator[AlertmanagerClient]:
    am = Alertmanager(tmp_path, webhook_url="http://127.0.0.1:9/unused")
    # NOTE: the deploy config replaces the test one as is: its receivers (the healer at http://healer:8470, PagerDuty
    # with a key file under /run/secrets) are only reached after group_wait, and this test reads Alertmanager's API.
    shutil.copy(ALERTMANAGER, am.dir / "alertmanager.yml")
    am.start()
    try:
        yield AlertmanagerClient(am.url)
    finally:
        am.stop()


def fleet_alert(name: str, now: datetime, **labels: str) -> dict[str, Any]:
    """The alert Prometheus sends for the rule `name` of deploy/prometheus/rules/alerts.yml, on the given series."""
    (rule,) = [r for r in rules(ALERTS) if r.get("alert") == name]
    return {"labels": {"alertname": name, **rule["labels"], **labels}, "annotations": {},
            "startsAt": now.isoformat(), "endsAt": (now + HOLD).isoformat()}


def gpu_fault_incident(state: str, now: datetime) -> Incident:
    return Incident(id=41, rule="gpu-fault", kind="gpu_fault", severity="critical", page="on-escalation", state=state,
                    job="train-a", node="n1", summary="GPU 0 on n1 is faulty: Xid 79 x1", occurrences=1,
                    opened_at=now - timedelta(minutes=1), resolved_at=now if state == "resolved" else None)


def seen(am: AlertmanagerClient, by: str = "node") -> dict[tuple[str, str], dict[str, Any]]:
    """(alertname, its `by` label) -> {state, receivers, inhibited_by} of every alert Alertmanager holds, resolved ones
    left out."""
    return {(a["labels"]["alertname"], a["labels"].get(by, "")): {
        "state": a["status"]["state"], "receivers": sorted(r["name"] for r in a["receivers"]),
        "inhibited": bool(a["status"]["inhibitedBy"])} for a in am.alerts()}


def settles(am: AlertmanagerClient, expected: dict[tuple[str, str], dict[str, Any]], what: str,
            by: str = "node") -> None:
    try:
        wait_for(what, lambda: seen(am, by) == expected, timeout_s=20)
    except AssertionError:
        assert seen(am, by) == expected, what  # pytest shows which alert went where


@pytest.mark.timeout(90)
def test_alertmanager_routes_each_alert_to_its_owner_and_holds_fleet_gpu_alerts_while_the_healer_owns_the_node(
        deployed_alertmanager: AlertmanagerClient) -> None:
    am, now = deployed_alertmanager, datetime.now(timezone.utc)
    am.post_alerts([
        *alertmanager_alerts([gpu_fault_incident("remediating", now)], now, HOLD, "http://healer:8470"),
        fleet_alert("MegahealGpuCriticalXid", now, node="n1", gpu="0", xid="79"),  # the healer's node
        fleet_alert("MegahealGpuCriticalXid", now, node="n2", gpu="0", xid="79"),  # an idle host
        fleet_alert("MegahealGpuRowRemapFailure", now, node="n3", gpu="1"),
        fleet_alert("MegahealNodeDown", now, node="n3"),
        fleet_alert("MegahealTelemetryAbsent", now),
        fleet_alert("MegahealHealerDown", now),
    ])
    expected = {
        ("MegahealIncident", "n1"): {"state": "active", "receivers": ["blackhole"], "inhibited": False},
        ("MegahealGpuCriticalXid", "n1"): {"state": "suppressed", "receivers": ["oncall"], "inhibited": True},
        ("MegahealGpuCriticalXid", "n2"): {"state": "active", "receivers": ["oncall"], "inhibited": False},
        ("MegahealGpuRowRemapFailure", "n3"): {"state": "suppressed", "receivers": ["oncall"], "inhibited": True},
        ("MegahealNodeDown", "n3"): {"state": "active", "receivers": ["healer"], "inhibited": False},
        ("MegahealTelemetryAbsent", ""): {"state": "active", "receivers": ["healer"], "inhibited": False},
        ("MegahealHealerDown", ""): {"state": "active", "receivers": ["oncall"], "inhibited": False},
    }
    settles(am, expected, "every alert routed to its owner, the GPU alerts of n1 and n3 held back")

    # The incident resolves (its alert ends): the node's GPU alert is a person's again.
    done = datetime.now(timezone.utc)
    am.post_alerts(alertmanager_alerts([gpu_fault_incident("resolved", done)], done, HOLD, "http://healer:8470"))
    del expected[("MegahealIncident", "n1")]
    expected[("MegahealGpuCriticalXid", "n1")] = {"state": "active", "receivers": ["oncall"], "inhibited": False}
    settles(am, expected, "the GPU alert of n1 back once the incident resolved")


@pytest.mark.timeout(90)
def test_alertmanager_sends_a_jobs_ettr_burn_to_oncall_and_holds_its_ticket_while_it_pages(
        deployed_alertmanager: AlertmanagerClient) -> None:
    am, now = deployed_alertmanager, datetime.now(UTC)
    am.post_alerts([
        fleet_alert("MegahealEttrFastBurn", now, job="llama-70b"),
        fleet_alert("MegahealEttrBudgetBurn", now, job="llama-70b"),
        fleet_alert("MegahealEttrBudgetBurn", now, job="gpt-1b"),  # another job's: not held back
    ])
    active = {"state": "active", "receivers": ["oncall"], "inhibited": False}
    expected = {
        ("MegahealEttrFastBurn", "llama-70b"): active,
        ("MegahealEttrBudgetBurn", "llama-70b"): {"state": "suppressed", "receivers": ["oncall"], "inhibited": True},
        ("MegahealEttrBudgetBurn", "gpt-1b"): active,
    }
    settles(am, expected, "the page to on-call, the paged job's ticket held back", by="job")

    # The burn stops (the fast burn's 5-minute window is healthy again): the 3-day ticket, still true, is sent.
    done = datetime.now(UTC)
    am.post_alerts([{**fleet_alert("MegahealEttrFastBurn", done, job="llama-70b"), "endsAt": done.isoformat()}])
    del expected[("MegahealEttrFastBurn", "llama-70b")]
    expected[("MegahealEttrBudgetBurn", "llama-70b")] = active
    settles(am, expected, "the ticket sent once the page resolved", by="job")
