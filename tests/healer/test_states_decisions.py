"""The incident state machine (one table, illegal transitions raise) and the pure policy (healer.decide.policy)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from healer.decide.catalogue import Remedy, fault
from healer.decide.plans import JobFacts, Verdict
from healer.decide.policy import Action, IncidentFacts, JobNow, decide, page_now
from healer.decide.rules import AlertCondition, Rule
from healer.decide.states import ACTIVE_STATES, TRANSITIONS, IncidentState, check_transition
from healer.errors import IllegalTransition

pytestmark = pytest.mark.unit

S = IncidentState
T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def _rule(**kw: object) -> Rule:
    rule = Rule(name="r", when=None, **kw)  # type: ignore[arg-type]
    rule.when = AlertCondition(alert="X")
    return rule


def _facts(state: S, rule: Rule | None, now: datetime = T0, kind: str = "x", **kw: object) -> IncidentFacts:
    return IncidentFacts(incident_id=1, kind=fault(kind), state=state, state_since=T0, now=now, rule=rule,
                         **kw)  # type: ignore[arg-type]


def _job(attempt: int = 1, busy_with: int | None = None) -> JobNow:
    return JobNow(facts=JobFacts(nodes=("n1", "n2"), spares=("n3",), dp=2, checkpoint_steps=(4,)), attempt=attempt,
                  busy_with=busy_with)


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
    assert "no verdict from the diagnosis within its deadline" in late.basis["reason"]


def test_a_verdict_moves_diagnosis_on_to_the_rules_remediation() -> None:
    notify = decide(_facts(S.DIAGNOSING, _rule(runbook="x"), verdict=Verdict("fail")))
    assert (notify.action, notify.to_state, notify.basis["verdict"]) == (Action.REMEDIATE, S.REMEDIATING, "fail")
    assert notify.plan is not None and notify.plan.remedy is Remedy.NOTIFY
    escalate = decide(_facts(S.DIAGNOSING, _rule(runbook="x", remediate="escalate"), verdict=Verdict("pass")))
    assert (escalate.action, escalate.to_state) == (Action.ESCALATE, S.ESCALATED)


def test_without_a_launcher_a_remedy_that_restarts_only_notifies_and_says_why() -> None:
    d = decide(_facts(S.OPEN, _rule(), kind="crash"))
    assert d.plan is not None and d.plan.remedy is Remedy.NOTIFY and d.basis["launcher"] == "none: notify only"
    with_launcher = decide(_facts(S.OPEN, _rule(), kind="crash", job=_job()))
    assert with_launcher.plan is not None and with_launcher.plan.remedy is Remedy.RESTART


def test_one_remediation_at_a_time_and_a_fault_of_an_older_attempt_is_superseded() -> None:
    busy = decide(_facts(S.OPEN, _rule(), kind="hang", attempt=1, job=_job(busy_with=7)))
    assert (busy.action, busy.next_action_at) == (Action.WAIT, T0 + timedelta(seconds=1))
    assert "incident 7" in busy.basis["reason"]
    old = decide(_facts(S.OPEN, _rule(), kind="hang", attempt=1, job=_job(attempt=2)))
    assert (old.action, old.to_state) == (Action.RESOLVE, S.RESOLVED) and "superseded" in old.basis["reason"]


def test_a_spent_budget_escalates_and_stops_a_job_that_cannot_go_on() -> None:
    from healer.decide.plans import RestartBudget

    d = decide(_facts(S.OPEN, _rule(), kind="crash", job=_job(), budget=RestartBudget(max_restarts=0)))
    assert (d.action, d.to_state, d.stop_job) == (Action.ESCALATE, S.ESCALATED, True)
    straggler = decide(_facts(S.OPEN, _rule(remediate="escalate"), kind="straggler", job=_job()))
    assert straggler.to_state is S.ESCALATED and not straggler.stop_job  # it still trains: page, do not stop it


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


def test_a_crash_in_a_job_that_runs_warm_is_diagnosed_live_and_restarts_warm_unless_its_host_fails() -> None:
    job = JobNow(facts=JobFacts(nodes=("n1", "n2"), spares=("n3",), dp=2, checkpoint_steps=(4,),
                                warm_unavailable=None), attempt=1, busy_with=None)
    rule = _rule(runbook="node-health")
    d = decide(_facts(S.OPEN, rule, kind="crash", job=job, attempt=1, diagnosis_available=True))
    assert (d.action, d.to_state) == (Action.DIAGNOSE, S.DIAGNOSING)
    assert d.basis["runbook"] == "node-health-live" and d.basis["live"] is True
    passed = decide(_facts(S.DIAGNOSING, rule, kind="crash", job=job, attempt=1, verdict=Verdict("pass")))
    assert (passed.action, passed.to_state) == (Action.REMEDIATE, S.REMEDIATING)
    assert passed.plan is not None and passed.plan.warm and passed.plan.basis["restart"]["mode"] == "warm"
    failed = decide(_facts(S.DIAGNOSING, rule, kind="crash", job=job, attempt=1,
                           verdict=Verdict("fail", bad_nodes=("n2",))))
    assert failed.plan is not None and failed.plan.exclude == ("n2",) and not failed.plan.warm
    assert failed.plan.basis["restart"] == {
        "mode": "cold", "why": "the state of the ranks of n2 is lost with the replicas (n2's nowhere else)"}
    # The same crash in a job that does not run warm is diagnosed with the rule's runbook, the job stopped.
    cold = decide(_facts(S.OPEN, rule, kind="crash", job=_job(), attempt=1, diagnosis_available=True))
    assert cold.action is Action.DIAGNOSE and cold.basis["runbook"] == "node-health" and "live" not in cold.basis


def test_a_crash_in_a_job_of_replica_groups_is_diagnosed_live_and_replaces_only_its_group() -> None:
    job = JobNow(facts=JobFacts(nodes=("n1", "n2", "n3"), spares=("n4",), dp=3, checkpoint_steps=(4,),
                                replica_groups=3), attempt=0, busy_with=None)
    rule = _rule(runbook="node-health")
    d = decide(_facts(S.OPEN, rule, kind="crash", job=job, attempt=0, diagnosis_available=True))
    assert d.basis["runbook"] == "node-health-live" and d.basis["live"] is True, "the other groups train on"
    failed = decide(_facts(S.DIAGNOSING, rule, kind="crash", job=job, attempt=0,
                           verdict=Verdict("fail", bad_nodes=("n2",))))
    assert failed.plan is not None and failed.plan.replica and failed.plan.nodes == ("n1", "n4", "n3")
    assert failed.plan.to_payload()["replica"] is True and not failed.stop_job
