"""The incident state machine (one table, illegal transitions raise) and the pure decision function."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from healer.core.decisions import Action, IncidentFacts, decide, page_now
from healer.errors import IllegalTransition
from healer.core.rules import AlertCondition, Rule
from healer.core.states import ACTIVE_STATES, TRANSITIONS, IncidentState, check_transition

S = IncidentState
T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def _rule(**kw: object) -> Rule:
    rule = Rule(name="r", when=None, **kw)  # type: ignore[arg-type]
    rule.when = AlertCondition(alert="X")
    return rule


def _facts(state: S, rule: Rule | None, now: datetime = T0, **kw: object) -> IncidentFacts:
    return IncidentFacts(incident_id=1, state=state, state_since=T0, now=now, rule=rule, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("old", list(S))
@pytest.mark.parametrize("new", list(S))
def test_it_allows_exactly_the_transitions_of_the_table(old: S, new: S) -> None:
    if new in TRANSITIONS[old]:
        check_transition(old, new)
    else:
        with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
            check_transition(old, new)


def test_every_active_state_can_be_acknowledged_or_resolved_and_resolved_only_reopens() -> None:
    for state in ACTIVE_STATES:
        assert S.RESOLVED in TRANSITIONS[state]
        assert state is S.ACKNOWLEDGED or S.ACKNOWLEDGED in TRANSITIONS[state]
    assert TRANSITIONS[S.RESOLVED] == {S.OPEN}


def test_an_open_incident_with_a_runbook_is_diagnosed_until_its_deadline() -> None:
    rule = _rule(runbook="node-health", diagnosis_deadline=timedelta(minutes=5))
    d = decide(_facts(S.OPEN, rule, diagnosis_available=True))
    assert (d.action, d.to_state, d.next_action_at) == (Action.DIAGNOSE, S.DIAGNOSING, T0 + timedelta(minutes=5))
    assert d.to_payload()["basis"]["runbook"] == "node-health"
    waiting = decide(_facts(S.DIAGNOSING, rule, now=T0 + timedelta(minutes=4)))
    assert (waiting.action, waiting.next_action_at) == (Action.WAIT, T0 + timedelta(minutes=5))
    late = decide(_facts(S.DIAGNOSING, rule, now=T0 + timedelta(minutes=5)))
    assert (late.action, late.to_state) == (Action.ESCALATE, S.ESCALATED)
    assert "diagnosis deadline" in late.basis["reason"]


def test_a_verdict_moves_diagnosis_on_to_the_rules_remediation() -> None:
    notify = decide(_facts(S.DIAGNOSING, _rule(runbook="x"), verdict="fail"))
    assert (notify.action, notify.to_state, notify.basis["verdict"]) == (Action.REMEDIATE, S.REMEDIATING, "fail")
    escalate = decide(_facts(S.DIAGNOSING, _rule(runbook="x", remediate="escalate"), verdict="pass"))
    assert (escalate.action, escalate.to_state) == (Action.ESCALATE, S.ESCALATED)


def test_without_a_diagnoser_it_says_diagnosis_was_skipped_and_remediates() -> None:
    d = decide(_facts(S.OPEN, _rule(runbook="x"), diagnosis_available=False))
    assert d.to_state is S.REMEDIATING and "skipped" in d.basis["diagnosis"]


def test_remediating_escalates_when_the_condition_outlives_the_recovery_deadline() -> None:
    rule = _rule(recovery_deadline=timedelta(seconds=30))
    assert decide(_facts(S.REMEDIATING, rule, now=T0 + timedelta(seconds=29))).action is Action.WAIT
    assert decide(_facts(S.REMEDIATING, rule, now=T0 + timedelta(seconds=30))).to_state is S.ESCALATED


def test_an_incident_whose_rule_is_gone_escalates_and_people_owned_ones_wait() -> None:
    assert decide(_facts(S.OPEN, None)).to_state is S.ESCALATED
    for state in (S.ESCALATED, S.ACKNOWLEDGED, S.RESOLVED):
        d = decide(_facts(state, _rule()))
        assert (d.action, d.to_state, d.next_action_at) == (Action.WAIT, None, None)


def test_page_policy() -> None:
    assert page_now("always", S.OPEN) and not page_now("always", S.RESOLVED)
    assert not page_now("never", S.ESCALATED)
    assert page_now("on-escalation", S.ESCALATED) and not page_now("on-escalation", S.REMEDIATING)


def test_facts_are_frozen() -> None:
    facts = _facts(S.OPEN, _rule())
    with pytest.raises(AttributeError):
        facts.state = S.RESOLVED  # type: ignore[misc]
    assert replace(facts, state=S.DIAGNOSING).state is S.DIAGNOSING
