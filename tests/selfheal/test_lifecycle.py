"""The one incident lifecycle, driven tick by tick: the real engine, store (SQLite), rules, detectors and policy,
with scripted hands (tests/selfheal/scripted.py) so each step can be held and looked at. What the hands really do
is proven on real processes in test_e2e.py."""

from __future__ import annotations

import signal
from datetime import UTC, datetime
from pathlib import Path

import pytest

from healer.engine.engine import Healer
from healer.incidents.jobstore import JobStore
from healer.incidents.timeline import job_timelines
from healer.observe.jobview import TickView
from healer.observe.processes import ProcessExit, ProcessState, ProcessView
from healer.ports import HostVerdict
from tests.healer.helpers import ManualClock, batch, make_healer
from tests.selfheal.scripted import ScriptedRemediator

pytestmark = pytest.mark.unit

JOB = "train-a"
RULES = """
remediation:
  budget: {max_restarts: 2, window: 1h}
rules:
  - {name: crash, when: {detector: crash, report_wait: 0s}, runbook: node-health}
  - {name: stale, when: {detector: heartbeat_stale, after: 30s}}
"""


def setup(tmp_path: Path, rules: str = RULES, db_url: str | None = None
          ) -> tuple[Healer, ScriptedRemediator, ManualClock]:
    clock = ManualClock()
    hands = ScriptedRemediator(job=JOB, view=ProcessView(), clock=clock)
    healer = make_healer(tmp_path, rules, clock=clock, remediator=hands, db_url=db_url)
    healer.table.processes = hands.view  # the launcher's view of the processes, as the supervisor would write it
    hands.view.found(JOB, frozenset({1000, 1001, 1002, 1003}))
    return healer, hands, clock


def crash(healer: Healer, clock: ManualClock, attempt: int = 0, rank: int = 3, node: str = "n2") -> None:
    healer.table.processes.record_exit(ProcessExit(job=JOB, attempt=attempt, node=node, rank=rank, pid=1000 + rank,
                                                   at=clock.now, exit_code=None, signal=signal.SIGKILL))


def tick(healer: Healer) -> TickView:
    view = healer.tick_detect()
    healer.tick_respond()
    healer.tick_recovery(view)
    return view


def test_a_crash_goes_through_diagnosis_restart_and_recovery_with_every_stage_stored(tmp_path: Path) -> None:
    healer, hands, clock = setup(tmp_path)
    # Step 9 is the highest when the restart is decided; the attempt finishes step 10 before its stop lands.
    hands.highest[0], hands.trained_on = 9, 1
    crash(healer, clock)
    tick(healer)
    assert hands.orders[:2] == [("diagnose", (("n2",), "node-health", True)), ("stop", "diagnosis")]
    clock.now += 5
    hands.diagnoses.pop()([HostVerdict("n2", "pass", "healthy", 4.0)])
    tick(healer)
    (_, order) = hands.orders[-1]
    assert hands.orders[-1][0] == "restart" and order.nodes == ("n1", "n2") and order.dp == 2
    # The new attempt trains: its ranks report steps, and the ranks' own records say it resumed at step 8.
    hands.first_steps[1] = 8
    healer.table.processes.found(JOB, frozenset({2000, 2001}))
    healer.table.ingest(_beats(JOB, "n1", [0, 1], pid0=2000, step=8))
    clock.now += 3
    tick(healer)
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert inc.stages == ["detected", "diagnosed", "decided", "restarted", "recovered"]
    assert (inc.state, inc.action, inc.verdict, inc.attempt) == ("resolved", "restart", "pass", 0)
    assert (inc.resume_step, inc.first_step_after, inc.highest_step, inc.lost_steps) == (8, 8, 10, 3)
    assert inc.summary.startswith("rank 3 on n2 killed by SIGKILL")
    (restart,) = JobStore(healer.store.engine).restarts(JOB)
    assert (restart.outcome, restart.attempt, restart.resumed_step, restart.cause) == ("recovered", 1, 8, "remediation")


def test_the_loop_keeps_ingesting_and_opens_another_incident_while_a_slow_diagnosis_runs(tmp_path: Path) -> None:
    healer, hands, clock = setup(tmp_path)
    crash(healer, clock)
    tick(healer)
    assert len(hands.diagnoses) == 1  # the diagnosis runs (on the hands' worker); the tick did not wait for it
    # Meanwhile: another job's ranks on n7 go silent, and their heartbeats keep coming in.
    healer.table.ingest(batch("n7", [0, 1], job="other", age=0.5))
    for _ in range(4):
        clock.now += 10
        healer.table.ingest(batch("n7", [0, 1], job="other", age=clock.now - 1_700_000_000.0))
        tick(healer)
    kinds = {(t.kind, t.state) for t in job_timelines(healer.store.engine, "other")}
    assert kinds == {("heartbeat_stale", "remediating")} and healer.table.batches == 5
    (crashed,) = job_timelines(healer.store.engine, JOB)
    assert crashed.state == "diagnosing"
    hands.diagnoses.pop()([HostVerdict("n2", "pass", "healthy", 30.0)])
    tick(healer)
    assert hands.orders[-1][0] == "restart"


def test_a_second_fault_of_the_same_attempt_waits_for_the_first_ones_restart_and_is_then_superseded(
        tmp_path: Path) -> None:
    healer, hands, clock = setup(tmp_path, RULES + "  - {name: nan, when: {detector: nonfinite}}\n")
    crash(healer, clock)
    nan = _beats(JOB, "n1", [0, 1], pid0=1000, step=5)
    for entry in nan["ranks"]:  # type: ignore[union-attr]
        entry["loss"], entry["nonfinite"] = None, {"loss": "nan"}
    healer.table.ingest(nan)
    tick(healer)  # both open in the same cycle; the crash is acted on first, the NaN waits its turn
    kinds = {t.kind: t.state for t in job_timelines(healer.store.engine, JOB)}
    assert kinds == {"crash": "diagnosing", "nonfinite": "open"}
    hands.diagnoses.pop()([HostVerdict("n2", "pass", "healthy", 1.0)])
    clock.now += 1
    tick(healer)  # the crash's restart starts attempt 1: the NaN of attempt 0 is answered by it
    clock.now += 1
    tick(healer)
    stages = {t.kind: t.stages for t in job_timelines(healer.store.engine, JOB)}
    assert stages["nonfinite"] == ["detected", "decided", "superseded"]
    assert [o for o, _ in hands.orders].count("restart") == 1


def test_a_spent_budget_escalates_and_stops_the_job(tmp_path: Path) -> None:
    healer, hands, clock = setup(tmp_path, RULES.replace("max_restarts: 2", "max_restarts: 0"))
    crash(healer, clock)
    tick(healer)
    hands.diagnoses.pop()([HostVerdict("n2", "pass", "healthy", 1.0)])
    tick(healer)
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert inc.state == "escalated" and "restart budget spent" in inc.plan["decision_basis"]["reason"]
    assert healer.responder.halted is not None and hands.orders[-1][0] == "stop"
    assert inc.stages == ["detected", "diagnosed", "decided", "escalated"]


def test_a_restart_that_cannot_be_started_escalates(tmp_path: Path) -> None:
    healer, hands, clock = setup(tmp_path)
    hands.fail_restarts = True
    crash(healer, clock)
    tick(healer)
    hands.diagnoses.pop()([HostVerdict("n2", "fail", "scratch disk gone", 1.0)])
    tick(healer)
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert inc.state == "escalated" and inc.plan["exclude"] == ["n2"] and inc.plan["nodes"] == ["n1", "n3"]
    (restart,) = JobStore(healer.store.engine).restarts(JOB)
    assert restart.outcome == "failed" and healer.responder.halted is not None


def test_a_healer_that_takes_over_finishes_the_restart_the_dead_one_ordered_without_charging_the_budget_twice(
        tmp_path: Path) -> None:
    healer, hands, clock = setup(tmp_path)
    hands.restart = _held(hands)  # type: ignore[method-assign]
    crash(healer, clock)
    tick(healer)
    hands.diagnoses.pop()([HostVerdict("n2", "pass", "healthy", 1.0)])
    tick(healer)  # the restart is ordered; then this healer dies
    healer.store.engine.dispose()

    second, hands2, clock2 = setup(tmp_path)  # a new healer on the same database
    clock2.now = clock.now + 30
    assert second.take_over() == [1]
    (_, order) = hands2.orders[-1]
    assert hands2.orders[-1][0] == "restart" and order.incident_id == 1
    restarts = JobStore(second.store.engine).restarts(JOB)
    assert [(r.cause, r.outcome) for r in restarts] == [("remediation", "superseded"), ("take-over", None)]
    (inc,) = job_timelines(second.store.engine, JOB)
    assert inc.taken_over_at is not None and inc.stages[-2:] == ["taken-over", "restarted"]
    spent = JobStore(second.store.engine).restart_times(JOB, since=datetime(2000, 1, 1, tzinfo=UTC))
    assert len(spent) == 1


def _held(hands: ScriptedRemediator) -> object:
    """A restart order that is recorded but never carried out (the hands are slow, or the healer dies first)."""
    def restart(order: object, done: object) -> None:
        hands.orders.append(("restart", order))
    return restart


def _beats(job: str, node: str, ranks: list[int], pid0: int, step: int) -> dict[str, object]:
    b = batch(node, ranks, job=job)
    for entry, rank in zip(b["ranks"], ranks):  # type: ignore[union-attr]
        entry["pid"], entry["step"] = pid0 + rank, step
    return b



def test_a_hang_is_looked_at_before_anything_stops_and_the_rank_its_stacks_name_is_the_one_diagnosed(
        tmp_path: Path) -> None:
    healer, hands, clock = setup(tmp_path, RULES + "  - {name: hang, when: {detector: hang, floor: 10s}, "
                                                   "runbook: node-health}\n")
    spin = ["_spin_in_compute (train/hang_faults.py:70)"]
    gather = ["all_gather_into_tensor (torch/distributed/distributed_c10d.py:3800)"]
    recv = ["_wait_batch_p2p (torch/distributed/pipelining/schedules.py:600)"]
    looked = [(0, "n1", "dp_gather", gather, "S"), (1, "n1", "forward_backward", spin, "R"),
              (2, "n2", "forward_backward", recv, "S"), (3, "n2", "forward_backward", recv, "S")]
    hands.evidence[0] = {"attempt": 0, "unreached": {}, "ranks": [
        {"rank": r, "node": n, "pid": 1000 + r, "state": st, "wchan": None, "stack": stack, "threads": 2,
         "error": None, "phase": {"rank": r, "step": 8, "phase": phase, "since": 0.0}}
        for r, n, phase, stack, st in looked]}

    def beats() -> None:
        for node, ranks in (("n1", [0, 1]), ("n2", [2, 3])):
            b = _beats(JOB, node, ranks, pid0=1000, step=8)
            for entry, r in zip(b["ranks"], ranks):  # type: ignore[union-attr]
                entry["mesh"] = {"pp": r // 2, "dp": r % 2, "tp": 0}
            healer.table.ingest(b)

    # The agents' view of the ranks: all alive, none stopped (SIGSTOP's state T would name the rank by itself).
    healer.table.processes.update_states([ProcessState(job=JOB, attempt=0, node=n, rank=r, pid=1000 + r, state=st,
                                                       cpu_seconds=1.0, sampled_at=clock.now)
                                          for r, n, _, _, st in looked])
    beats()
    tick(healer)
    clock.now += 11
    beats()  # the ranks still report: alive, at the same step
    tick(healer)
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert inc.kind == "hang" and inc.suspect_ranks == [1] and inc.suspect_nodes == ["n1"]
    stacks = inc.evidence["stacks"]
    assert stacks["attribution"]["how"] == "not in any collective while its peers wait for it"
    assert [g["ranks"] for g in stacks["attribution"]["groups"]][0] == [2, 3]
    assert "[stacks: rank(s) 1 on n1: not in any collective" in inc.summary
    # Looked at first, then diagnosed: node-health on the one host its stacks name, not on every host of the job.
    assert hands.orders[:2] == [("diagnose", (("n1",), "node-health", True)), ("stop", "diagnosis")]
