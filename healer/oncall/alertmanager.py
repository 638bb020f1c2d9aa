"""Alertmanager in and out.

In: the webhook receiver's payload, version 4. Only what the healer reads is checked; unknown fields are
ignored (newer Alertmanagers add some). Out: incidents posted to `/api/v2/alerts` as alerts named
`MegahealIncident`; an active incident is re-posted while it lasts with an `endsAt` a few intervals ahead
(so an incident whose healer died resolves on its own), a resolved one once with `endsAt` = its resolution.
Each carries a `runbook_url` into docs/operations.md, made the way the Prometheus alerts make theirs
(deploy/prometheus/rules/alerts.yml): under the configured docs base, else the file's path in the repository.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlparse

from ground.httpclient import request_json
from healer.decide.policy import page_now
from healer.decide.states import IncidentState
from healer.errors import BadRequest
from healer.incidents.models import Incident

INCIDENT_ALERTNAME = "MegahealIncident"
MAX_ALERTS = 10000
INCIDENT_RUNBOOK_ANCHOR = "the-incident-page"
"""docs/operations.md's section on reading an incident's page: the runbook of every MegahealIncident."""


def runbook_url(base: str | None, anchor: str) -> str:
    """The link to docs/operations.md#`anchor`: under `base` (the URL of megaheal's docs/ folder as people reach
    it), else the file's path in the repository, a pointer for a reader with a checkout rather than a link
    (the same rule as the Prometheus alerts' `runbook_base` external label)."""
    return f"{base.rstrip('/')}/operations.md#{anchor}" if base else f"docs/operations.md#{anchor}"


def check_runbook_base(base: str, name: str = "runbook_base") -> None:
    """ValueError unless `base` is an absolute URL: http(s) with a host, or file:// with an absolute path. A relative
    link is what pagers and Grafana cannot open."""
    parsed = urlparse(base)
    absolute = (parsed.scheme in ("http", "https") and bool(parsed.netloc)) or \
        (parsed.scheme == "file" and parsed.netloc in ("", "localhost") and parsed.path.startswith("/"))
    if not absolute or parsed.query or parsed.fragment:
        raise ValueError(f"{name} must be the absolute URL of megaheal's docs/ folder (https://HOST/PATH or "
                         f"file:///PATH, no query or fragment), got {base!r}")


@dataclass(frozen=True, slots=True)
class WebhookAlert:
    status: str
    """firing or resolved."""
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: str
    fingerprint: str

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")


def parse_webhook(body: Any) -> list[WebhookAlert]:
    """The alerts of a version 4 webhook payload; BadRequest names the offending field."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object (an Alertmanager webhook payload)")
    if body.get("version") != "4":
        raise BadRequest("version", f"expected \"4\" (Alertmanager webhook payload version), got {body.get('version')!r}")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise BadRequest("alerts", "expected a list")
    if len(alerts) > MAX_ALERTS:
        raise BadRequest("alerts", f"at most {MAX_ALERTS} alerts, got {len(alerts)}")
    return [_alert(a, f"alerts[{i}]") for i, a in enumerate(alerts)]


def _alert(raw: Any, where: str) -> WebhookAlert:
    if not isinstance(raw, dict):
        raise BadRequest(where, "expected an object")
    status = raw.get("status")
    if status not in ("firing", "resolved"):
        raise BadRequest(f"{where}.status", f"expected firing or resolved, got {status!r}")
    labels = _strings(raw.get("labels"), f"{where}.labels")
    if not labels.get("alertname"):
        raise BadRequest(f"{where}.labels.alertname", "missing")
    annotations = _strings(raw.get("annotations", {}), f"{where}.annotations")
    starts_at = raw.get("startsAt", "")
    if not isinstance(starts_at, str):
        raise BadRequest(f"{where}.startsAt", "expected a string")
    fingerprint = raw.get("fingerprint", "")
    if not isinstance(fingerprint, str):
        raise BadRequest(f"{where}.fingerprint", "expected a string")
    return WebhookAlert(status=status, labels=labels, annotations=annotations, starts_at=starts_at,
                        fingerprint=fingerprint)


def _strings(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise BadRequest(where, "expected an object of strings")
    for key, item in value.items():
        if not isinstance(item, str):
            raise BadRequest(f"{where}.{key}", f"expected a string, got {item!r}")
    return value


def incident_alert(incident: Incident, now: datetime, hold: timedelta, base_url: str,
                   runbook_base: str | None = None) -> dict[str, Any]:
    """The Alertmanager alert (API v2) of one incident; `hold` is how far ahead an active one's endsAt lies;
    `runbook_base` as in `runbook_url`."""
    state = IncidentState(incident.state)
    labels = {"alertname": INCIDENT_ALERTNAME, "incident": str(incident.id), "kind": incident.kind,
              "severity": incident.severity, "job": incident.job or "", "node": incident.node or "",
              "page": "true" if page_now(incident.page, state) else "false"}
    ends = incident.resolved_at if state is IncidentState.RESOLVED and incident.resolved_at else now + hold
    return {
        "labels": {k: v for k, v in labels.items() if v},
        "annotations": {"summary": incident.summary, "state": incident.state, "rule": incident.rule,
                        "occurrences": str(incident.occurrences),
                        "runbook_url": runbook_url(runbook_base, INCIDENT_RUNBOOK_ANCHOR)},
        "startsAt": incident.opened_at.isoformat(),
        "endsAt": ends.isoformat(),
        # The incident's page on the healer (healer/service/pages.py): what on-call opens from the page.
        "generatorURL": f"{base_url.rstrip('/')}/incidents/{incident.id}",
    }


class AlertmanagerClient:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        """POST /api/v2/alerts; RequestFailed (permanent on a 4xx) when Alertmanager refuses or cannot be reached."""
        if alerts:
            request_json("POST", f"{self.url}/api/v2/alerts", alerts, timeout_s=self.timeout_s)

    def alerts(self, filters: list[str] | None = None) -> list[dict[str, Any]]:
        """GET /api/v2/alerts (filter matchers like 'alertname="MegahealIncident"')."""
        from urllib.parse import urlencode

        qs = urlencode([("filter", f) for f in filters or []])
        found = request_json("GET", f"{self.url}/api/v2/alerts?{qs}", timeout_s=self.timeout_s)
        return list(found or [])
