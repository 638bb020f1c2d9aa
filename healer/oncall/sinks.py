"""Where incidents go: Alertmanager (the incident list, kept in sync), a generic webhook (every change), and
Grafana annotations (optional extra `megaheal[grafana]`). A `Sink` is a null object; `Sinks` fans out to the
configured ones and keeps a failing sink from stopping the others.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from ground.httpclient import RequestFailed, request_json
from healer.errors import SinkError
from healer.incidents.models import Incident
from healer.oncall.alertmanager import AlertmanagerClient, incident_alert

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 5
MAX_QUEUED = 10000


@dataclass(frozen=True, slots=True)
class Change:
    """Something that happened to an incident: opened, joined, reopened, or a transition."""

    event: str
    incident: dict[str, Any]
    from_state: str | None
    to_state: str | None
    at: str

    def to_payload(self) -> dict[str, Any]:
        return {"event": self.event, "from": self.from_state, "to": self.to_state, "at": self.at,
                "incident": self.incident}


class Sink:
    """No-op base: a sink overrides what it cares about."""

    name = "null"

    def sync(self, active: list[Incident], resolved: list[Incident], now: datetime) -> None:
        """The whole picture: every active incident, and the ones resolved since the last sync."""

    def deliver(self, change: Change) -> None:
        """One change; raise SinkError (permanent or not) when it cannot be delivered."""


class AlertmanagerSink(Sink):
    name = "alertmanager"

    def __init__(self, url: str, base_url: str, resend: timedelta, runbook_base: str | None = None) -> None:
        self.client = AlertmanagerClient(url)
        self.base_url = base_url
        self.runbook_base = runbook_base
        # NOTE: like Prometheus, endsAt lies a few resend intervals ahead: if this healer dies, Alertmanager
        # resolves its alerts by itself instead of paging forever; while it lives, each resend extends them.
        self.hold = resend * 4

    def sync(self, active: list[Incident], resolved: list[Incident], now: datetime) -> None:
        self.client.post_alerts(alertmanager_alerts(active + resolved, now, self.hold, self.base_url,
                                                    self.runbook_base))


def alertmanager_alerts(incidents: list[Incident], now: datetime, hold: timedelta, base_url: str,
                        runbook_base: str | None = None) -> list[dict[str, Any]]:
    """Every incident's alert. NOTE: `page` is a label (Alertmanager routes on labels), so an incident whose page
    flag changes (on-escalation: escalated, then acknowledged or resolved; always: resolved) is a different alert
    each time; the variant it no longer has is sent as resolved (endsAt now), or it would keep paging until its hold
    ran out. A resolved incident ends both."""
    out = []
    for incident in incidents:
        alert = incident_alert(incident, now, hold, base_url, runbook_base)
        out.append(alert)
        if incident.page == "on-escalation" or (incident.page == "always" and incident.state == "resolved"):
            twin = {**alert, "labels": {**alert["labels"]}}
            twin["endsAt"] = alert["endsAt"] if incident.state == "resolved" else now.isoformat()
            twin["labels"]["page"] = "false" if alert["labels"]["page"] == "true" else "true"
            out.append(twin)
    return out


class WebhookSink(Sink):
    name = "webhook"

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def deliver(self, change: Change) -> None:
        request_json("POST", self.url, change.to_payload(), headers=self.headers)


class GrafanaSink(Sink):
    """An annotation per incident (tags megaheal, kind, severity, job, node), closed as a region when resolved."""

    name = "grafana"

    def __init__(self, url: str, token: str) -> None:
        try:
            # NOTE: an optional extra: grafana-client pulls in niquests/urllib3-future, kept out of the core install.
            from grafana_client import GrafanaApi
            from grafana_client.client import GrafanaException
        except ImportError as exc:
            raise SinkError("the Grafana sink needs the optional extra: pip install 'megaheal[grafana]'",
                            permanent=True) from exc
        self.api = GrafanaApi.from_url(url, credential=token)
        self._errors: tuple[type[BaseException], ...] = (GrafanaException, OSError)
        self._ids: dict[int, int] = {}

    def deliver(self, change: Change) -> None:
        inc = change.incident
        if change.event not in ("opened", "reopened") and change.to_state != "resolved":
            return
        start = _ms(inc["opened_at"])
        tags = ["megaheal", f"kind:{inc['kind']}", f"severity:{inc['severity']}"] + \
            [f"{k}:{inc[k]}" for k in ("job", "node") if inc.get(k)]
        text = f"incident {inc['id']} ({inc['state']}): {inc['summary']}"
        try:
            if change.to_state == "resolved" and inc["id"] in self._ids:
                self.api.annotations.update_annotation(self._ids.pop(inc["id"]), time_from=start,
                                                       time_to=_ms(inc["resolved_at"]), tags=tags, text=text)
            elif change.to_state == "resolved":
                self.api.annotations.add_annotation(time_from=start, time_to=_ms(inc["resolved_at"]), tags=tags, text=text)
            else:
                made = self.api.annotations.add_annotation(time_from=start, time_to=start, tags=tags, text=text)
                self._ids[inc["id"]] = int(made["id"])
        except self._errors as exc:
            raise SinkError(f"grafana annotation for incident {inc['id']}: {exc}") from exc


def _ms(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp() * 1000)


class Sinks:
    """Fans out to every sink. Changes wait in a bounded queue; transient failures are retried on the next
    flush (at most MAX_ATTEMPTS times), permanent ones are dropped at once. Nothing here raises."""

    def __init__(self, sinks: list[Sink], counter: Any = None) -> None:
        self.sinks = sinks
        self._queue: deque[tuple[Sink, Change, int]] = deque()
        self.delivered: dict[tuple[str, str], int] = {}
        self.counter = counter
        """A prometheus Counter labelled (sink, result), set by the healer."""

    def wants_changes(self) -> bool:
        return any(type(sink).deliver is not Sink.deliver for sink in self.sinks)

    def push(self, change: Change) -> None:
        for sink in self.sinks:
            if type(sink).deliver is not Sink.deliver:
                if len(self._queue) >= MAX_QUEUED:
                    self._queue.popleft()
                    self._count(sink, "dropped")
                self._queue.append((sink, change, 0))

    def flush(self) -> int:
        """Deliver what is queued; returns how many are still waiting for a retry."""
        retry: list[tuple[Sink, Change, int]] = []
        while self._queue:
            sink, change, attempts = self._queue.popleft()
            try:
                sink.deliver(change)
                self._count(sink, "ok")
            except RequestFailed as exc:
                if exc.permanent or attempts + 1 >= MAX_ATTEMPTS:
                    log.warning("%s sink: dropped %s of incident %s: %s", sink.name, change.event,
                                change.incident.get("id"), exc)
                    self._count(sink, "failed")
                else:
                    retry.append((sink, change, attempts + 1))
                    self._count(sink, "retry")
        self._queue.extend(retry)
        return len(retry)

    def sync(self, active: list[Incident], resolved: list[Incident], now: datetime) -> bool:
        """Give every sink the whole picture; True when all took it."""
        ok = True
        for sink in self.sinks:
            if type(sink).sync is Sink.sync:
                continue
            try:
                sink.sync(active, resolved, now)
                self._count(sink, "ok")
            except RequestFailed as exc:
                ok = False
                log.warning("%s sink: sync failed: %s", sink.name, exc)
                self._count(sink, "failed")
        return ok

    def _count(self, sink: Sink, result: str) -> None:
        key = (sink.name, result)
        self.delivered[key] = self.delivered.get(key, 0) + 1
        if self.counter is not None:
            self.counter.labels(sink.name, result).inc()
