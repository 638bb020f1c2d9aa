"""Signals: a fault as a rule sees it (from a detector, a PromQL series or an Alertmanager alert), before
it becomes or joins an incident. Its fingerprint is what deduplicates: the rule plus the labels that
identify the faulty thing, so the same fault seen twice (or by two healers) is one incident.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from healer.decide.rules import Rule
from healer.detect.suspects import Suspects

MAX_LABEL = 256


@dataclass(frozen=True, slots=True)
class Signal:
    rule: str
    kind: str
    severity: str
    page: str
    cooldown: timedelta
    identity: tuple[tuple[str, str], ...]
    """The labels that identify the faulty thing, sorted; with the rule, they make the fingerprint."""
    job: str | None
    node: str | None
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    attempt: int | None = None
    """The job's attempt the fault happened in (part of the identity: the same fault in a later attempt is a new
    incident); None without a launcher."""
    suspects: Suspects = ()
    """Whom its finding blames (healer/detect/suspects.py); none for a PromQL series or an alert (its `node`, if
    any, is where it is)."""
    first_bad_step: int | None = None
    """The first step its finding says the fault touched (for a rollback)."""

    @property
    def fingerprint(self) -> str:
        text = json.dumps([self.rule, list(self.identity)], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def from_rule(rule: Rule, identity: dict[str, str], summary: str, evidence: dict[str, Any] | None = None,
              labels: dict[str, str] | None = None, job: str | None = None, node: str | None = None,
              attempt: int | None = None, suspects: Suspects = (), first_bad_step: int | None = None) -> Signal:
    """A signal of `rule`; job and node default to the identity's `job` and `node` labels."""
    if attempt is not None:
        identity = {**identity, "attempt": str(attempt)}
    labels = {k: _clip(v) for k, v in (labels or identity).items()}
    return Signal(rule=rule.name, kind=rule.incident_kind, severity=rule.incident_severity, page=rule.page,
                  cooldown=rule.cooldown, identity=tuple(sorted((k, _clip(v)) for k, v in identity.items())),
                  job=job if job is not None else identity.get("job"),
                  node=node if node is not None else identity.get("node"),
                  summary=_clip(summary, 2000), evidence=evidence or {}, labels=labels, attempt=attempt,
                  suspects=suspects, first_bad_step=first_bad_step)


def _clip(value: str, limit: int = MAX_LABEL) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."
