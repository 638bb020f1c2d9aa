"""What the healer does next with an incident: a pure function of facts, so every choice can be tested
without a database and is stored with its basis.

    open         -> diagnosing   when the rule names a runbook and this healer can run it
                 -> remediating  notify: the sinks are told, the healer waits for the condition to clear
                 -> escalated    remediate: escalate, or the rule is gone from the configuration
    diagnosing   -> remediating / escalated as above, once the runbook's verdict is in
                 -> escalated    past the rule's diagnosis deadline
    remediating  -> escalated    past the rule's recovery deadline (the condition did not clear)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from healer.core.rules import Rule
from healer.core.states import IncidentState

S = IncidentState


class Action(str, enum.Enum):
    DIAGNOSE = "diagnose"
    REMEDIATE = "remediate"
    ESCALATE = "escalate"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class IncidentFacts:
    """What a decision may look at."""

    incident_id: int
    state: IncidentState
    state_since: datetime
    now: datetime
    rule: Rule | None
    """The incident's rule as configured now; None when it is no longer configured."""
    verdict: str | None = None
    """The verdict of the incident's finished runbook run, if any."""
    diagnosis_available: bool = False
    """Whether this healer can run runbooks."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    to_state: IncidentState | None
    basis: dict[str, Any] = field(default_factory=dict)
    """Why: the rule, the facts and the deadline that made the call."""
    next_action_at: datetime | None = None
    """When to look at the incident again (a deadline); None: only when something happens to it."""

    def to_payload(self) -> dict[str, Any]:
        return {"action": self.action.value, "to_state": self.to_state.value if self.to_state else None,
                "basis": self.basis,
                "next_action_at": self.next_action_at.isoformat() if self.next_action_at else None}


def decide(facts: IncidentFacts) -> Decision:
    rule = facts.rule
    if facts.state not in (S.OPEN, S.DIAGNOSING, S.REMEDIATING):
        return Decision(Action.WAIT, None, {"reason": f"{facts.state.value}: a person owns it or it is over"})
    if rule is None:
        return Decision(Action.ESCALATE, S.ESCALATED, {"reason": "its rule is no longer configured"})
    basis: dict[str, Any] = {"rule": rule.name, "remediate": rule.remediate, "runbook": rule.runbook}
    if facts.state is S.OPEN:
        if rule.runbook and facts.diagnosis_available:
            return Decision(Action.DIAGNOSE, S.DIAGNOSING, basis | {"reason": f"run runbook {rule.runbook}"},
                            facts.now + rule.diagnosis_deadline)
        if rule.runbook:
            basis["diagnosis"] = "skipped: this healer does not run runbooks (diagnosis: off)"
        return _remediate(facts, rule, basis)
    if facts.state is S.DIAGNOSING:
        if facts.verdict is not None:
            return _remediate(facts, rule, basis | {"verdict": facts.verdict})
        deadline = facts.state_since + rule.diagnosis_deadline
        if facts.now >= deadline:
            return Decision(Action.ESCALATE, S.ESCALATED, basis | {
                "reason": f"no verdict from {rule.runbook} within the diagnosis deadline",
                "deadline_s": rule.diagnosis_deadline.total_seconds()})
        return Decision(Action.WAIT, None, basis | {"reason": "diagnosing"}, deadline)
    deadline = facts.state_since + rule.recovery_deadline
    if facts.now >= deadline:
        return Decision(Action.ESCALATE, S.ESCALATED, basis | {
            "reason": "the condition did not clear within the recovery deadline",
            "deadline_s": rule.recovery_deadline.total_seconds()})
    return Decision(Action.WAIT, None, basis | {"reason": "waiting for the condition to clear"}, deadline)


def _remediate(facts: IncidentFacts, rule: Rule, basis: dict[str, Any]) -> Decision:
    if rule.remediate == "escalate":
        return Decision(Action.ESCALATE, S.ESCALATED, basis | {"reason": "the rule escalates to a person"})
    return Decision(Action.REMEDIATE, S.REMEDIATING, basis | {"reason": "notify, then wait for the condition to clear"},
                    facts.now + rule.recovery_deadline)


def page_now(policy: str, state: IncidentState) -> bool:
    """Whether the incident should carry page="true" to Alertmanager now."""
    if policy == "always":
        return state is not S.RESOLVED
    if policy == "never":
        return False
    return state is S.ESCALATED
