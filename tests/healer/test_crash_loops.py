"""Loops no restart ends: the program's own failure told from the infrastructure's (healer/detect/logtail.py:
signature, healer.decide.plans.crash_loop) and stopped before any diagnosis, for good (healer.decide.policy); and
rollbacks that bring no net progress, escalated at the third."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from healer.decide.catalogue import Remedy, fault
from healer.decide.plans import (
    CRASH_LOOP_EXIT,
    JobFacts,
    Limits,
    Plan,
    ProgramFailure,
    RestartBudget,
    choose,
    crash_loop,
)
from healer.decide.policy import Action, IncidentFacts, JobNow, decide
from healer.decide.rules import AlertCondition, Rule
from healer.decide.states import IncidentState
from healer.detect.crash import Crash
from healer.detect.logtail import classify, signature
from healer.observe.heartbeats import HeartbeatTable
from healer.observe.processes import ProcessExit
from tests.healer.helpers import ManualClock

pytestmark = pytest.mark.unit
T0 = datetime(2024, 1, 1, tzinfo=UTC)

TRACEBACK = [  # a rank's stderr, as it wrote it (torchrun's stderr.log puts "[rankN]: " before each line)
    "Traceback (most recent call last):",
    '  File "/home/a/job/train.py", line 88, in <module>',
    "    main()",
    '  File "/home/a/job/train.py", line 61, in main',
    "    loss = step(batch)",
    '  File "/opt/venv/lib/python3.11/site-packages/mylib/blocks.py", line 212, in forward',
    "    raise ValueError(f'bad shape {x.shape}')",
    "ValueError: bad shape torch.Size([4, 17])",
]


@pytest.mark.parametrize("tail", [TRACEBACK, [f"[rank1]: {line}" for line in TRACEBACK]],
                         ids=["plain", "torchrun-prefixed"])
def test_a_python_exception_is_signed_by_its_type_and_innermost_frame_whatever_the_path(tail: list[str]) -> None:
    cls = classify(1, None, tail)
    assert (cls.category, cls.detail) == ("python-exception", "ValueError")
    assert signature(cls, tail) == "ValueError at blocks.py:212 in forward"
    # The same failure on a host that installed the library elsewhere signs the same.
    moved = [line.replace("/opt/venv/lib/python3.11/site-packages", "/usr/lib/python3/dist-packages") for line in tail]
    assert signature(classify(1, None, moved), moved) == signature(cls, tail)


def test_signals_peer_echoes_and_out_of_memory_have_no_signature() -> None:
    assert signature(classify(None, 9, []), []) is None
    echo = ["Traceback (most recent call last):", '  File "t.py", line 3, in step',
            "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"]
    assert signature(classify(1, None, echo), echo) is None
    oom = ["Traceback (most recent call last):", '  File "t.py", line 3, in step',
           "torch.OutOfMemoryError: CUDA out of memory."]
    assert signature(classify(1, None, oom), oom) is None
    no_frame = ["ValueError: bad config"]
    assert signature(classify(1, None, no_frame), no_frame) is None


def test_a_programs_exception_waits_for_the_other_ranks_exits_to_see_every_host_it_struck() -> None:
    # Every rank raises at the same step; the one on n1 is seen first, n2's a second later. Fired at once, the crash
    # would name n1 alone, and a loop on two hosts would go unseen for an attempt.
    table = HeartbeatTable(clock=ManualClock())
    view = table.processes
    view.started("job", 0)
    detector = Crash(Crash.Config())
    view.record_exit(ProcessExit(job="job", attempt=0, node="n1", rank=0, pid=10, at=100.0, exit_code=1,
                                 log_tail=tuple(TRACEBACK)))
    assert detector.evaluate(table, 100.5).firing == ()
    view.record_exit(ProcessExit(job="job", attempt=0, node="n2", rank=2, pid=12, at=101.0, exit_code=1,
                                 log_tail=tuple(f"[rank2]: {line}" for line in TRACEBACK)))
    assert detector.evaluate(table, 101.5).firing == ()
    (f,) = detector.evaluate(table, 102.5).firing
    assert f.node == "n1" and f.evidence["signature_nodes"] == ["n1", "n2"], f.evidence
    # A signal has no signature: it fires at once, as before.
    view.started("job", 1)
    view.record_exit(ProcessExit(job="job", attempt=1, node="n1", rank=0, pid=20, at=200.0, exit_code=None,
                                 signal=9, log_tail=()))
    assert [f.key for f in detector.evaluate(table, 200.1).firing] == ["job/attempt-1"]


SIG = "ValueError at blocks.py:212 in forward"


def _job(*failures: ProgramFailure) -> JobFacts:
    return JobFacts(nodes=("n1", "n2"), spares=("n3",), dp=2, failures=failures)


def test_the_same_failure_in_two_attempts_on_two_hosts_is_a_loop_and_not_otherwise() -> None:
    first = ProgramFailure(attempt=0, signature=SIG, nodes=("n1",), step=3, resumed_from=0)
    # The same exception, frame, step and start, the second time on another host: the program's.
    loop = crash_loop(ProgramFailure(attempt=1, signature=SIG, nodes=("n2",), step=3, resumed_from=0), _job(first))
    assert loop is not None and loop["attempts"] == [0, 1] and loop["hosts"] == ["n1", "n2"]
    assert loop["reason"].startswith(f"crash loop: {SIG} at step 3, resumed from step 0, in attempts 0, 1 on n1, n2")
    assert f"exit {CRASH_LOOP_EXIT}" in loop["reason"]
    # Every rank failing alike on both hosts in each attempt: two attempts are enough.
    both = ProgramFailure(attempt=0, signature=SIG, nodes=("n1", "n2"), step=3, resumed_from=0)
    assert crash_loop(ProgramFailure(attempt=1, signature=SIG, nodes=("n1", "n2"), step=3, resumed_from=0), _job(both))
    # Not a loop: the first time; the same host twice (the host may be to blame); another step, another start,
    # another frame; nothing to compare (a signal).
    assert crash_loop(first, _job()) is None
    same_host = ProgramFailure(attempt=1, signature=SIG, nodes=("n1",), step=3, resumed_from=0)
    assert crash_loop(same_host, _job(first)) is None
    for other in (ProgramFailure(attempt=1, signature=SIG, nodes=("n2",), step=7, resumed_from=0),
                  ProgramFailure(attempt=1, signature=SIG, nodes=("n2",), step=3, resumed_from=2),
                  ProgramFailure(attempt=1, signature="ValueError at blocks.py:99 in forward", nodes=("n2",), step=3,
                          resumed_from=0)):
        assert crash_loop(other, _job(first)) is None, other
    assert crash_loop(None, _job(first)) is None


def _rule() -> Rule:
    rule = Rule(name="crash", when=None, runbook="node-health",  # type: ignore[arg-type]
                diagnosis_deadline=timedelta(minutes=5))
    rule.when = AlertCondition(alert="X")
    return rule


def test_a_crash_loop_is_escalated_and_its_job_stopped_before_any_diagnosis() -> None:
    first = ProgramFailure(attempt=0, signature=SIG, nodes=("n1",), step=3, resumed_from=0)
    again = ProgramFailure(attempt=1, signature=SIG, nodes=("n2",), step=3, resumed_from=0)
    facts = IncidentFacts(incident_id=2, kind=fault("crash"), state=IncidentState.OPEN, state_since=T0, now=T0,
                          rule=_rule(), attempt=1, diagnosis_available=True, failure=again,
                          job=JobNow(facts=_job(first), attempt=1))
    d = decide(facts)
    assert (d.action, d.to_state, d.stop_job) == (Action.ESCALATE, IncidentState.ESCALATED, True)
    assert d.basis["crash_loop"]["signature"] == SIG and d.basis["reason"].startswith("crash loop: ")
    # The first of them is diagnosed and restarted as any crash is.
    first_facts = IncidentFacts(incident_id=1, kind=fault("crash"), state=IncidentState.OPEN, state_since=T0, now=T0,
                                rule=_rule(), attempt=0, diagnosis_available=True, failure=first,
                                job=JobNow(facts=_job(), attempt=0))
    assert decide(first_facts).action is Action.DIAGNOSE


def test_a_third_rollback_in_a_row_without_net_progress_escalates_instead() -> None:
    def plan(stalled: int) -> Plan:
        job = JobFacts(nodes=("n1", "n2"), dp=2, checkpoint_steps=(8, 12), stalled_rollbacks=stalled)
        return choose(fault("nonfinite"), None, (), 14, None, job, Limits(), RestartBudget(), T0, {})
    assert plan(0).remedy is Remedy.ROLLBACK and plan(1).remedy is Remedy.ROLLBACK
    third = plan(2)
    assert third.remedy is Remedy.ESCALATE and third.basis["stalled_rollbacks"] == 2
    assert "rollback 3 in a row without net progress" in third.basis["reason"]
