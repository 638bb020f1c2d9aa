"""PromQL rules: each `when: {promql: EXPR, for: D}` is queried against Prometheus' HTTP API on a schedule.
Every series the expression returns is a candidate fault, identified by its labels; it fires once it has
been returned for `for` without a gap (Prometheus' own pending -> firing), and its incident resolves when
a successful query no longer returns it. A failed query changes nothing: an unreachable Prometheus is not
evidence that anything recovered.
"""

from __future__ import annotations

import logging
import math
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from ground.httpclient import RequestFailed, request_json
from healer.decide.rules import PromqlCondition, Rule
from healer.decide.signals import Signal, from_rule

log = logging.getLogger(__name__)


class PrometheusError(Exception):
    """A query failed: Prometheus unreachable, or it refused the expression (the message says which)."""


class PrometheusClient:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query; each series as (labels, value). Scalars come back as one series without labels."""
        qs = urllib.parse.urlencode({"query": expr, "timeout": f"{self.timeout_s:g}s"})
        try:
            body = request_json("GET", f"{self.url}/api/v1/query?{qs}", timeout_s=self.timeout_s + 1)
        except RequestFailed as exc:
            raise PrometheusError(str(exc)) from exc
        if not isinstance(body, dict) or body.get("status") != "success":
            raise PrometheusError(f"query {expr!r}: {body!r}"[:500])
        data = body.get("data") or {}
        result = data.get("result")
        if data.get("resultType") == "vector":
            return [(dict(s.get("metric") or {}), float(s["value"][1])) for s in result or []]
        if data.get("resultType") == "scalar" and isinstance(result, list):
            return [({}, float(result[1]))]
        raise PrometheusError(f"query {expr!r}: expected an instant vector, got {data.get('resultType')}")


@dataclass(slots=True)
class RuleResult:
    firing: list[Signal] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)
    """Fingerprints no longer returned by a successful query."""
    pending: int = 0
    error: str | None = None


class PromqlEvaluator:
    """Keeps the pending state of every series of every promql rule (in memory, like Prometheus itself)."""

    def __init__(self, client: PrometheusClient) -> None:
        self.client = client
        self._since: dict[str, dict[str, float]] = {}

    def evaluate(self, rule: Rule, now: float) -> RuleResult:
        cond = rule.condition
        assert isinstance(cond, PromqlCondition)
        out = RuleResult()
        try:
            series = self.client.query(cond.promql)
        except PrometheusError as exc:
            out.error = str(exc)
            return out
        since = self._since.setdefault(rule.name, {})
        seen: dict[str, Signal] = {}
        for labels, value in series:
            if math.isnan(value):
                continue
            signal = _signal(rule, labels, value, cond)
            seen[signal.fingerprint] = signal
            started = since.setdefault(signal.fingerprint, now)
            if now - started >= cond.for_.total_seconds():
                out.firing.append(signal)
            else:
                out.pending += 1
        out.cleared = [fp for fp in since if fp not in seen]
        for fp in out.cleared:
            del since[fp]
        return out


def _signal(rule: Rule, labels: dict[str, str], value: float, cond: PromqlCondition) -> Signal:
    identity = {k: v for k, v in labels.items() if k != "__name__"}
    name = labels.get("__name__")
    where = ", ".join(f"{k}={v}" for k, v in sorted(identity.items())) or "no labels"
    summary = f"{rule.name}: {name + ' ' if name else ''}{{{where}}} = {value:g}"
    evidence: dict[str, Any] = {"promql": cond.promql, "for_s": cond.for_.total_seconds(), "value": value,
                                "labels": labels}
    return from_rule(rule, identity, summary, evidence, job=identity.get("job"),
                     # NOTE: "Hostname": dcgm-exporter's node label (4.x, and megaheal's GPU series).
                     node=(identity.get("node") or identity.get("Hostname") or identity.get("hostname")
                           or identity.get("instance")))
