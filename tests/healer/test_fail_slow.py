"""Fail-slow: a straggler (or a slow link network-triage names) replaced with a spare where bearing it would cost
more than the swap, left alone where it would not (healer/decide/fail_slow.py), and the swap put off until a
checkpoint after it was named (healer.decide.policy)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from healer.decide.catalogue import Remedy, fault
from healer.decide.fail_slow import Slowdown, slowdown_from, swap_or_bear
from healer.decide.plans import JobFacts, Limits, Verdict
from healer.decide.policy import Action, IncidentFacts, JobNow, decide
from healer.decide.rules import AlertCondition, Rule
from healer.decide.states import IncidentState

pytestmark = pytest.mark.unit
T0 = datetime(2024, 1, 1, tzinfo=UTC)
JOB = JobFacts(nodes=("n1", "n2"), spares=("n3",), dp=2, checkpoint_steps=(10, 20), total_steps=1000)


def half_speed(step: int = 20) -> Slowdown:
    """A rank stopped half the time: a 0.5 s step takes 1.0 s (what a 50% duty cycle does to the job)."""
    return Slowdown(host="n2", excess_s=0.5, step_s=1.0, step=step)


def facts(slowdown: Slowdown | None, job: JobFacts = JOB, limits: Limits | None = None) -> IncidentFacts:
    return IncidentFacts(incident_id=1, kind=fault("straggler"), state=IncidentState.OPEN, state_since=T0, now=T0,
                         rule=Rule(name="straggler", when=AlertCondition(alert="x")), suspects=("n2",),
                         suspect_ranks=(2,), attempt=0, job=JobNow(facts=job, attempt=0), slowdown=slowdown,
                         limits=limits or Limits())


def test_a_straggler_that_costs_more_than_a_swap_before_the_job_ends_is_replaced_by_the_spare() -> None:
    call = swap_or_bear(half_speed(), JOB, Limits())
    assert call["swap"] and call["steps_left"] == 979 and call["projected_loss_s"] == pytest.approx(489.5)
    assert call["swap_cost_s"] == 120.0 and "no recovered restart" in call["swap_cost_from"]
    d = decide(facts(half_speed()))
    assert d.action is Action.REMEDIATE and d.plan is not None
    assert d.plan.remedy is Remedy.EXCLUDE_AND_RESTART and d.plan.exclude == ("n2",) and d.plan.nodes == ("n1", "n3")
    assert d.basis["fail_slow"]["swap"] and "fail-slow: 0.500 s a step x 979 steps left" in d.basis["fail_slow"]["reason"]


def test_a_small_slowdown_a_short_job_or_a_dear_swap_is_borne_and_said_with_its_numbers() -> None:
    five_percent = Slowdown(host="n2", excess_s=0.025, step_s=0.525, step=20)
    d = decide(facts(five_percent))
    assert d.plan is not None and d.plan.remedy is Remedy.NOTIFY
    call = d.basis["fail_slow"]
    assert not call["swap"] and call["projected_loss_s"] == pytest.approx(24.5) and "cheaper to bear" in call["reason"]
    near_the_end = JobFacts(nodes=JOB.nodes, spares=JOB.spares, dp=2, total_steps=200)
    assert not swap_or_bear(half_speed(step=190), near_the_end, Limits())["swap"]
    # The job's own restarts measured at 10 minutes: half speed for 979 steps (490 s) is not worth one.
    dear = JobFacts(nodes=JOB.nodes, spares=JOB.spares, dp=2, total_steps=1000, restart_cost_s=600.0)
    call = swap_or_bear(half_speed(), dear, Limits())
    assert not call["swap"] and call["swap_cost_from"].startswith("measured")


def test_without_a_spare_or_a_known_length_the_call_says_why() -> None:
    no_spare = JobFacts(nodes=JOB.nodes, dp=2, total_steps=1000)
    call = swap_or_bear(half_speed(), no_spare, Limits())
    assert not call["swap"] and "no spare" in call["reason"]
    assert decide(facts(half_speed(), no_spare)).plan.remedy is Remedy.NOTIFY  # type: ignore[union-attr]
    # A program's length is not known: its cost is projected over slow_horizon (10 minutes: 600 steps of 1 s) where
    # that is set, and it is only notified where not.
    program = JobFacts(nodes=JOB.nodes, spares=JOB.spares, dp=2)
    call = swap_or_bear(half_speed(), program, Limits(slow_horizon=timedelta(minutes=10)))
    assert call["swap"] and call["steps_left"] == 600 and "not known" in call["steps_left_from"]
    call = swap_or_bear(half_speed(), program, Limits())
    assert not call["swap"] and "no slow_horizon is set" in call["reason"]


def test_the_swap_waits_for_a_checkpoint_newer_than_the_step_it_was_named_at() -> None:
    d = decide(facts(half_speed(step=23)))
    assert d.action is Action.WAIT and d.to_state is None and d.next_action_at == T0 + timedelta(seconds=2)
    assert "waits for a checkpoint after step 23 (the newest is at step 20)" in d.basis["reason"]
    saved = JobFacts(nodes=JOB.nodes, spares=JOB.spares, dp=2, checkpoint_steps=(20, 25), total_steps=1000)
    assert decide(facts(half_speed(step=23), saved)).action is Action.REMEDIATE


def test_a_rule_that_names_its_remedy_or_an_evidence_without_numbers_is_not_second_guessed() -> None:
    named = Rule(name="straggler", when=AlertCondition(alert="x"), remediate="notify")
    f = facts(half_speed())
    d = decide(IncidentFacts(**{**{k: getattr(f, k) for k in f.__slots__}, "rule": named}))  # type: ignore[arg-type]
    assert d.plan is not None and d.plan.remedy is Remedy.NOTIFY and "fail_slow" not in d.basis
    assert slowdown_from({"cause": "compute"}, "n2") is None
    assert slowdown_from({"excess_s": 0.5, "step_s": 1.0, "step": 20}, None) is None
    assert slowdown_from({"excess_s": 0.5, "step_s": 1.0, "step": 20}, "n2") == half_speed()


def test_a_slow_link_that_network_triage_names_is_swapped_where_it_costs_more_and_else_borne() -> None:
    # A collective slowdown, diagnosed: network-triage failed n2 (its link), and its evidence holds what each step
    # loses to the slower reduce. Its host is the one the runbook named (the detector names none).
    triage = {"named_by": {"runbook": "network-triage", "hosts": {"n2": {"summary": "0.01 GB/s"}}},
              "excess_s": 0.5, "step_s": 1.0, "step": 20}
    slow = slowdown_from(triage, None)
    assert slow == half_speed()

    def diagnosed(s: Slowdown | None, job: JobFacts = JOB) -> IncidentFacts:
        return IncidentFacts(incident_id=1, kind=fault("collective_slowdown"), state=IncidentState.DIAGNOSING,
                             state_since=T0, now=T0, verdict=Verdict("fail", ("n2",)),
                             rule=Rule(name="collective-slowdown", when=AlertCondition(alert="x"),
                                       runbook="network-triage"),
                             suspects=("n2",), attempt=0, job=JobNow(facts=job, attempt=0), slowdown=s, limits=Limits())

    d = decide(diagnosed(slow))
    assert d.plan is not None and d.plan.remedy is Remedy.EXCLUDE_AND_RESTART and d.plan.nodes == ("n1", "n3")
    assert d.basis["fail_slow"]["swap"], d.basis
    # 25 ms a step for 979 steps is 24 s, less than a swap: borne, although network-triage failed the host.
    d = decide(diagnosed(Slowdown(host="n2", excess_s=0.025, step_s=0.525, step=20)))
    assert d.plan is not None and d.plan.remedy is Remedy.NOTIFY and not d.plan.exclude
    assert "cheaper to bear" in d.basis["fail_slow"]["reason"]
    # Two hosts named (a switch between them, or this healer's own link): no one spare mends it; notified.
    two = {**triage, "named_by": {"runbook": "network-triage", "hosts": {"n1": {}, "n2": {}}}}
    assert slowdown_from(two, None) is None
    d = decide(diagnosed(None))
    assert d.plan is not None and d.plan.remedy is Remedy.NOTIFY and "fail_slow" not in d.basis
