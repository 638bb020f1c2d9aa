"""Hosts in the evidence and the report: the Slurm state of the hosts a restart left out (through the launcher's
`host_states`, drained or not), and the run report's row per host (its role in each attempt, the incidents naming it,
its drain, its Slurm state at the end, what network-triage measured on its links), from a run directory as
`megaheal run` leaves it. Real Slurm answers these on the multi-host bed (tests/multihost/test_slurm_launcher.py)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from healer.decide.signals import Signal
from healer.decide.states import IncidentState as S
from healer.incidents import db
from healer.incidents.store import IncidentStore
from healer.incidents.timeline import IncidentTimeline
from healer.launchers import agent_registry
from healer.launchers.drain import Drainer
from healer.pages.hosts import host_table, states_path
from healer.runner.hosts import record_states
from healer.runner.report import report
from wire.run_paths import RunPaths

pytestmark = pytest.mark.unit


class SlurmSays:
    """A launcher's answer about hosts, as SlurmAgents gives it after asking scontrol."""

    def __init__(self, states: dict[str, dict[str, str | None]], reaches: bool = False) -> None:
        self.states, self.drained, self.reaches = states, [], reaches

    def scheduler_reaches(self, node: str) -> bool:
        return self.reaches

    def drain(self, node: str, reason: str) -> bool:
        self.drained.append(node)
        self.states[node] = {"state": "MIXED+DRAIN", "reason": reason}
        return True

    def host_states(self, nodes: list[str]) -> dict[str, dict[str, str | None]]:
        return {n: self.states[n] for n in nodes if n in self.states}

    def resume(self, node: str) -> bool:
        self.states[node] = {"state": "IDLE", "reason": None}
        return True


def lost_host_incident(store: IncidentStore, host: str) -> int:
    incident_id, _ = store.record(Signal(rule="host-lost", kind="host_lost", severity="critical", page="on-escalation",
                                         cooldown=timedelta(minutes=5), identity=(("job", "j"), ("node", host)), job="j", node=host,
                                         summary=f"{host} silent", evidence={"silent_s": 16.0}))
    assert store.transition(incident_id, S.OPEN, S.REMEDIATING, {"decision": {"plan": {"remedy": "exclude-node-and-restart", "exclude": [host]}}})
    return incident_id


def make_store(tmp_path: Path) -> IncidentStore:
    engine = db.make_engine(f"sqlite:///{tmp_path / 'healer.db'}")
    db.ensure_schema(engine)
    return IncidentStore(engine, "test")


def test_a_lost_host_left_out_is_drained_and_its_slurm_state_and_reason_go_into_the_evidence(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    incident = lost_host_incident(store, "h2")
    fleet = SlurmSays({"h2": {"state": "MIXED", "reason": None}})
    Drainer(fleet, store, "j").left_out(incident, {"h2"})  # type: ignore[arg-type]
    evidence = store.row(incident).evidence
    assert evidence["drain"]["h2"]["drained"] is True
    assert evidence["slurm"] == {"h2": {"state": "MIXED+DRAIN", "reason": evidence["drain"]["h2"]["reason"]}}


def test_a_repaired_host_is_given_back_to_slurm_only_where_megaheal_drained_it(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    incident = lost_host_incident(store, "h2")
    fleet = SlurmSays({"h2": {"state": "MIXED", "reason": None},
                       "h3": {"state": "IDLE+DRAIN", "reason": "bad fan (ops ticket 12)"}, "h4": {"state": "IDLE"}})
    drainer = Drainer(fleet, store, "j")  # type: ignore[arg-type]
    drainer.left_out(incident, {"h2"})
    said = drainer.returned("h2")
    assert said["resumed"] is True and said["reason_was"].startswith("megaheal: incident") and \
        fleet.states["h2"]["state"] == "IDLE"
    assert drainer.returned("h3") == {"resumed": False,
                                      "why": "drained by someone else ('bad fan (ops ticket 12)'): left as it is"}
    assert fleet.states["h3"]["state"] == "IDLE+DRAIN"
    assert drainer.returned("h4") == {"resumed": False, "why": "not drained in the scheduler"}


@pytest.mark.parametrize(("agent_answers", "scheduler_reaches", "doubt"), [
    (True, False, "not confirmed: its agent answers the healer's call"),
    (False, True, "not confirmed: the scheduler still runs work there"),
])
def test_a_silent_host_is_not_drained_while_its_agent_or_the_scheduler_still_reaches_it(
        tmp_path: Path, agent_answers: bool, scheduler_reaches: bool, doubt: str) -> None:
    store = make_store(tmp_path)
    incident = lost_host_incident(store, "h2")
    fleet = SlurmSays({"h2": {"state": "MIXED", "reason": None}}, reaches=scheduler_reaches)
    Drainer(fleet, store, "j", agent_answers=lambda node: agent_answers).left_out(  # type: ignore[arg-type]
        incident, {"h2"})
    drain = store.row(incident).evidence["drain"]["h2"]
    assert fleet.drained == [] and drain["drained"] is False and drain["error"].startswith(doubt), drain


def test_silence_shared_by_several_hosts_drains_none_of_them(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    first, second = lost_host_incident(store, "h2"), lost_host_incident(store, "h3")
    fleet = SlurmSays({}, reaches=False)
    drainer = Drainer(fleet, store, "j", agent_answers=lambda node: False)  # type: ignore[arg-type]
    drainer.left_out(first, {"h2"})
    drainer.left_out(second, {"h3"})
    assert fleet.drained == []
    assert "h3 fell silent within 10 s" in store.row(first).evidence["drain"]["h2"]["error"]


def test_a_host_left_out_without_draining_still_has_its_slurm_state_recorded(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    incident = lost_host_incident(store, "h2")
    fleet = SlurmSays({"h2": {"state": "DOWN*", "reason": "Not responding"}})
    Drainer(fleet, store, "j", drain=False).left_out(incident, {"h2"})  # type: ignore[arg-type]
    evidence = store.row(incident).evidence
    assert fleet.drained == [] and "drain" not in evidence
    assert evidence["slurm"] == {"h2": {"state": "DOWN*", "reason": "Not responding"}}


def test_without_a_scheduler_the_evidence_gets_no_slurm_state(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    incident = lost_host_incident(store, "h2")
    Drainer(SlurmSays({}), store, "j", drain=False).left_out(incident, {"h2"})  # type: ignore[arg-type]
    assert "slurm" not in store.row(incident).evidence


SLOW = "median pair busbw 0.006 GB/s < 0.5 x 1.07 GB/s among the other nodes"


def a_run(tmp_path: Path) -> tuple[Path, list[dict[str, object]]]:
    """A run on h1-h3 with h4 spare: h3's link slowed (named by network-triage), then h2 lost and replaced by h4."""
    run = tmp_path / "run"
    agent_registry.save(run, {h: f"http://{h}:1" for h in ("h1", "h2", "h3", "h4")})
    RunPaths(run).journal.write_text("".join(json.dumps(e) + "\n" for e in (
        {"event": "start", "job": "j", "attempt": 0, "at": 100.0, "nodes": ["h1", "h2", "h3"], "dp": 3},
        {"event": "end", "attempt": 0, "at": 200.0},
        {"event": "start", "job": "j", "attempt": 1, "at": 210.0, "nodes": ["h1", "h3", "h4"], "dp": 3},
        {"event": "end", "attempt": 1, "at": 300.0})))
    states_path(run).write_text(json.dumps({"h2": {"state": "IDLE+DRAIN", "reason": "megaheal: incident 2"},
                                            "h3": {"state": "IDLE", "reason": None}}))
    slow = IncidentTimeline(
        id=1, kind="collective_slowdown", rule="collective-slowdown", summary="reduce slower", state="remediating",
        attempt=0, suspect_nodes=["h3"], suspect_ranks=[], detected_at=150.0,
        evidence={"named_by": {"runbook": "network-triage", "hosts": {
            "h3": {"summary": SLOW, "pairs_gbps": {"h1<->h3": 0.006, "h2<->h3": 0.0061}}}}})
    lost = IncidentTimeline(
        id=2, kind="host_lost", rule="host-lost", summary="h2 silent", state="resolved", attempt=0,
        suspect_nodes=["h2"], suspect_ranks=[], detected_at=190.0, plan={"exclude": ["h2"]},
        evidence={"drain": {"h2": {"reason": "megaheal: incident 2", "drained": True}},
                  "slurm": {"h2": {"state": "MIXED+DRAIN", "reason": "megaheal: incident 2"}}})
    incidents = [slow.to_payload(), lost.to_payload()]
    return run, incidents


def test_the_report_has_a_row_per_host_with_its_role_in_each_attempt_its_incidents_drain_and_slurm_state(
        tmp_path: Path) -> None:
    run, incidents = a_run(tmp_path)
    h1, h2, h3, h4 = host_table(run, incidents)  # type: ignore[arg-type]
    assert h1["roles"] == {"0": "trained", "1": "trained"} and h1["incidents"] == [] and h1["slurm"] is None
    assert h2["roles"] == {"0": "trained", "1": "left out"}
    assert h2["incidents"] == [{"id": 2, "kind": "host_lost", "state": "resolved"}]
    assert h2["drain"] == {"reason": "megaheal: incident 2", "drained": True}
    assert h2["slurm"] == {"state": "IDLE+DRAIN", "reason": "megaheal: incident 2"}, "the state at the end, not then"
    assert h3["network"] == [SLOW] and h3["pairs_gbps"] == {"h1<->h3": 0.006, "h2<->h3": 0.0061}
    assert h4["roles"] == {"0": "spare", "1": "trained"}


def test_report_json_holds_the_hosts(tmp_path: Path) -> None:
    run, incidents = a_run(tmp_path)
    report(run, incidents, quiet=True)  # type: ignore[arg-type]
    hosts = json.loads((run / "report.json").read_text())["hosts"]
    assert [h["host"] for h in hosts] == ["h1", "h2", "h3", "h4"]


def test_the_states_at_the_end_are_kept_only_where_a_scheduler_answered(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "supervisor").mkdir(parents=True)
    assert record_states(run, SlurmSays({}), ["h1"]) == {} and not states_path(run).exists()  # type: ignore[arg-type]
    record_states(run, SlurmSays({"h1": {"state": "IDLE", "reason": None}}), ["h1", "h1"])  # type: ignore[arg-type]
    assert json.loads(states_path(run).read_text()) == {"h1": {"state": "IDLE", "reason": None}}


def test_the_witnesses_asked_when_the_healer_acted_decide_not_a_later_answer(tmp_path: Path) -> None:
    # A host cut off when the healer acts, whose link is back by the time the restart is done: still drained.
    store = make_store(tmp_path)
    incident = lost_host_incident(store, "h2")
    answers = {"now": False}
    fleet = SlurmSays({}, reaches=False)
    drainer = Drainer(fleet, store, "j", agent_answers=lambda node: answers["now"])  # type: ignore[arg-type]
    doubts = drainer.witness(incident)
    assert doubts.result(timeout=10) == {"h2": None}
    answers["now"] = True
    drainer.left_out(incident, {"h2"}, doubts)
    assert fleet.drained == ["h2"]


def test_a_host_that_failed_preflight_is_left_out_from_its_attempt_with_why_and_its_drain(tmp_path: Path) -> None:
    run, incidents = a_run(tmp_path)
    with RunPaths(run).journal.open("a") as out:  # h5, a spare, failed its screening before attempt 1
        out.write(json.dumps({"event": "screened", "attempt": 1, "at": 205.0, "node": "h5", "status": "fail",
                              "summary": "host: scratch directory /x is not a directory", "seconds": 1.2,
                              "drain": {"reason": "megaheal: preflight (host: ...)", "drained": True}}) + "\n")
    *_, h5 = host_table(run, incidents)  # type: ignore[arg-type]
    assert h5["host"] == "h5" and h5["roles"] == {"0": "spare", "1": "left out"}
    assert h5["screening"] == [{"attempt": 1, "status": "fail", "seconds": 1.2,
                                "summary": "host: scratch directory /x is not a directory"}]
    assert h5["drain"] == {"reason": "megaheal: preflight (host: ...)", "drained": True}
