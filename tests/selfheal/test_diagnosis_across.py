"""Runbooks of scope job (network-triage): run once across the job's hosts for an incident that names no host, beside
the training (nothing stopped, nothing restarted), their verdict split into one per host, and the host they name made
the incident's suspect, with which link and how fast in its evidence. The real engine, store, rules, detector and
policy with scripted hands (tests/selfheal/scripted.py); the runbook itself runs for real over local hosts at the end
(on the multi-host bed, across hosts: tests/multihost/test_slow_link_named.py)."""

from __future__ import annotations

import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from ground.typedconfig import ConfigError
from healer.decide.rules import load_rules
from healer.incidents.timeline import job_timelines
from healer.launchers.job_diagnosis import JobDiagnosis, local_env, split
from healer.observe.processes import ProcessExit, ProcessView
from healer.ports import HostVerdict
from runbooks.spec import load_runbook
from tests.conftest import REPO
from tests.healer.helpers import ManualClock, make_healer
from tests.selfheal.scripted import ScriptedRemediator
from tests.selfheal.streams import JobStream
from tests.support import wait_for

pytestmark = pytest.mark.e2e

JOB = "train-a"
RULES = """
rules:
  - name: collective-slowdown
    when: {detector: collective_slowdown, window: 5, baseline_windows: 3, consecutive: 2}
    runbook: network-triage
    remediate: notify
    page: never
  - {name: crash, when: {detector: crash, report_wait: 0s}, runbook: node-health}
"""
SLOW = "median pair busbw 0.0119 GB/s < 0.5 x 0.412 GB/s among the other nodes"


def slowed_network(tmp_path: Path, rules: str = RULES, total_steps: int | None = None):  # noqa: ANN201 - set-up
    """A healer whose job's network got 10x slower for every rank, ticked until its incident is being diagnosed."""
    clock = ManualClock()
    hands = ScriptedRemediator(job=JOB, view=ProcessView(), clock=clock, total_steps=total_steps)
    healer = make_healer(tmp_path, rules, clock=clock, remediator=hands)
    healer.table.processes = hands.view
    hands.view.found(JOB, frozenset({1000, 1001, 1002, 1003}))
    s = JobStream(table=healer.table, clock=clock, nodes={"n1": [0, 1], "n2": [2, 3]}, job=JOB)
    for i in range(60):
        if i == 25:
            s.transfer = 0.2
        s.advance()
        healer.tick_detect()
        healer.tick_respond()
        if any(o == "diagnose_across" for o, _ in hands.orders):
            break
    return healer, hands, clock


def test_a_collective_slowdown_runs_network_triage_once_across_the_jobs_hosts_beside_the_training(
        tmp_path: Path) -> None:
    healer, hands, _ = slowed_network(tmp_path)
    assert hands.orders == [("diagnose_across", (("n1", "n2"), "network-triage"))], "nothing stopped"
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert (inc.kind, inc.state, inc.suspect_nodes) == ("collective_slowdown", "diagnosing", [])


def test_the_host_network_triage_names_becomes_the_suspect_with_its_link_in_the_evidence_and_nothing_restarts(
        tmp_path: Path) -> None:
    healer, hands, clock = slowed_network(tmp_path)
    hands.diagnoses.pop()([HostVerdict("n1", "pass", "not named", 30.0, {"pairs_gbps": {"n1<->n2": 0.0119}}),
                           HostVerdict("n2", "fail", SLOW, 30.0, {"pairs_gbps": {"n1<->n2": 0.0119}})])
    clock.now += 1
    healer.tick_respond()
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert (inc.state, inc.action, inc.verdict, inc.suspect_nodes) == ("remediating", "notify", "fail", ["n2"])
    assert inc.evidence["named_by"] == {"runbook": "network-triage", "hosts": {
        "n2": {"summary": SLOW, "pairs_gbps": {"n1<->n2": 0.0119}}}}
    assert inc.summary.endswith(f"[network-triage: n2: {SLOW}]")
    assert [o for o, _ in hands.orders] == ["diagnose_across"] and hands.running, "notify only: no stop, no restart"


def test_a_slow_link_that_costs_more_than_a_swap_before_the_job_ends_is_swapped_for_the_spare_at_a_checkpoint(
        tmp_path: Path) -> None:
    # The shipped rule's way (no remedy pinned): the host network-triage names is weighed as a straggler is. A long
    # job: its slower reduce a step x the steps left is far more than a swap's 120 s.
    healer, hands, clock = slowed_network(tmp_path, RULES.replace("    remediate: notify\n", ""), total_steps=100_000)
    hands.diagnoses.pop()([HostVerdict("n1", "pass", "not named", 30.0, {"pairs_gbps": {"n1<->n2": 0.0119}}),
                           HostVerdict("n2", "fail", SLOW, 30.0, {"pairs_gbps": {"n1<->n2": 0.0119}})])
    clock.now += 1
    healer.tick_respond()
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert inc.state == "diagnosing" and [o for o, _ in hands.orders] == ["diagnose_across"], "waits for a checkpoint"
    hands.checkpoints = (4, 8, 10_000)
    clock.now += 3
    healer.tick_respond()
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert (inc.action, inc.plan["exclude"], inc.plan["nodes"]) == ("exclude-node-and-restart", ["n2"], ["n1", "n3"])
    call = inc.plan["decision_basis"]["fail_slow"]
    assert call["swap"] and call["host"] == "n2" and call["excess_s"] > 0, call
    assert [o for o, _ in hands.orders] == ["diagnose_across", "restart"]


def test_a_crash_during_a_network_test_beside_the_training_is_not_kept_waiting(tmp_path: Path) -> None:
    healer, hands, clock = slowed_network(tmp_path)
    healer.table.processes.record_exit(ProcessExit(job=JOB, attempt=0, node="n2", rank=3, pid=1003, at=clock.now,
                                                   exit_code=None, signal=signal.SIGKILL))
    healer.tick_detect()
    healer.tick_respond()
    assert ("diagnose", (("n2",), "node-health", True)) in hands.orders


def test_a_verdict_across_hosts_splits_into_one_per_host_naming_only_the_slow_one() -> None:
    result = {"verdict": "fail", "suspects": [
        {"kind": "node", "name": "h3", "reason": SLOW},
        {"kind": "link", "name": "h1<->h2", "reason": "pair busbw 0.1 GB/s < 0.5 x 0.4 GB/s"}],
        "steps": [{"measurements": [
            {"name": "pair_busbw", "value": 0.41, "labels": {"pair": "h1<->h2"}},
            {"name": "pair_busbw", "value": 0.0119, "labels": {"pair": "h1<->h3"}},
            {"name": "pair_busbw", "value": 0.0121, "labels": {"pair": "h2<->h3"}}]}]}
    h1, h2, h3 = split(result, ["h1", "h2", "h3"], "pairwise: node h3", 31.0)
    assert (h3.status.value, h3.summary, h3.details["pairs_gbps"]) == ("fail", SLOW, {"h1<->h3": 0.0119,
                                                                                     "h2<->h3": 0.0121})
    assert h1.status.value == h2.status.value == "pass"
    assert h1.details["links"] == ["h1<->h2: pair busbw 0.1 GB/s < 0.5 x 0.4 GB/s"] == h2.details["links"]


def test_a_verdict_across_hosts_that_names_no_host_blames_none_of_them() -> None:
    failed = split({"verdict": "fail", "suspects": [], "steps": []}, ["h1", "h2"], "all_reduce slow", 3.0)
    assert [v.status.value for v in failed] == ["degraded", "degraded"]
    assert failed[0].summary == "named no host: all_reduce slow"
    passed = split({"verdict": "pass", "suspects": [], "steps": []}, ["h1", "h2"], "busbw ok", 3.0)
    assert [v.status.value for v in passed] == ["pass", "pass"]


def test_network_triage_is_of_scope_job_and_a_rule_naming_it_knows_that(tmp_path: Path) -> None:
    assert load_runbook("network-triage").scope == "job" and load_runbook("node-health").scope == "host"
    (rule,) = load_rules([_write(tmp_path / "r.yaml", RULES.split("  - {name: crash")[0])])
    assert rule.runbook_scope == "job"


def test_a_runbook_with_an_unknown_scope_is_refused_by_name(tmp_path: Path) -> None:
    book = _write(tmp_path / "b.yaml", "name: b\nscope: cluster\nsteps: [{name: s, check: clock, timeout: 5s}]\n")
    with pytest.raises(ConfigError, match="scope must be one of host, job, got 'cluster'"):
        load_runbook(str(book))


@pytest.mark.timeout(240)
def test_network_triage_runs_over_local_hosts_when_they_are_all_this_machine(tmp_path: Path) -> None:
    run = JobDiagnosis(python=sys.executable, cwd=REPO, env=local_env({"SLURM_JOB_ID": "7", **_env(tmp_path)}),
                       timeout=timedelta(minutes=3))
    verdicts = run(["n1", "n2", "n3"], "network-triage")
    assert [v.node for v in verdicts] == ["n1", "n2", "n3"]
    assert all(v.status.value != "error" for v in verdicts), verdicts
    assert all(len(v.details["pairs_gbps"]) == 2 for v in verdicts), "every pair measured, over local ranks"


def test_a_network_test_in_flight_is_stopped_when_the_healer_goes_and_blames_no_host(tmp_path: Path) -> None:
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nexec sleep 120\n")  # a runbook that would run on past the healer
    slow.chmod(0o755)
    run = JobDiagnosis(python=str(slow), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    done: list[list[HostVerdict]] = []
    worker = threading.Thread(target=lambda: done.append(run(["h1", "h2"], "network-triage")))
    worker.start()
    wait_for("the runbook to start", lambda: run._running is not None, 30)
    run.stop()
    worker.join(30)
    (verdicts,) = done
    assert [(v.node, v.status.value) for v in verdicts] == [("h1", "error"), ("h2", "error")]
    assert "exited -15 without a result" in verdicts[0].summary


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()} | {"XDG_STATE_HOME": str(tmp_path), "GLOO_SOCKET_IFNAME": "lo",
                                                     "OMP_NUM_THREADS": "1"}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
