"""The Slurm launcher on the bed, inside an allocation: an agent SIGKILLed on its host is restarted through srun and
reports again, and hosts a restart left out that their incident proved bad are drained with the incident as the
reason. (deploy/slurm/megaheal.sbatch on 3 hosts + 1 spare, leaving nothing behind, is test_slow_link_named.py's job.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from datetime import timedelta

import pytest

from ground import slurm
from healer.decide.signals import Signal
from healer.decide.states import IncidentState
from healer.incidents import db
from healer.incidents.store import IncidentStore
from healer.launchers.agent_client import AgentClient
from healer.launchers.allocation import Allocation
from healer.launchers.drain import Drainer
from healer.launchers.run_authority import RunAuthority
from healer.launchers.run_token import write_token
from healer.launchers.slurm_agents import STEP_PREFIX, SlurmAgents
from healer.observe.heartbeats import HeartbeatTable
from healer.runner.reports import ReportServer
from healer.service.api import TableIngest, ingest_app
from testbed import faults, procs
from tests.multihost.conftest import bed_env
from tests.support import wait_for
from wire.run_paths import RunPaths

pytestmark = pytest.mark.multihost
S = IncidentState


# ---------------------------------------------------------------------------------------------- in an allocation


@pytest.fixture
def allocation(healthy_bed, monkeypatch) -> Iterator[Allocation]:
    """A 4-host allocation held by `salloc --no-shell`; this process acts as its batch host would."""
    env = bed_env(healthy_bed)
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    got = subprocess.run(["salloc", "--no-shell", "-N", "4", "--ntasks-per-node=2", "--job-name=megaheal-test"],
                         env=env, capture_output=True, text=True, timeout=60)
    job = re.search(r"Granted job allocation (\d+)", got.stderr + got.stdout)
    assert job, got.stderr
    try:
        nodelist = subprocess.run(["squeue", "-h", "-j", job.group(1), "-o", "%N"], env=env, capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        yield Allocation.from_environment({"SLURM_JOB_ID": job.group(1), "SLURM_JOB_NODELIST": nodelist,
                                           "SLURM_NTASKS_PER_NODE": "2"})
    finally:
        subprocess.run(["scancel", job.group(1)], env=env, capture_output=True, timeout=30)


def agent_batches(table: HeartbeatTable) -> dict[str, str | None]:
    return {n.node: n.agent_url for n in table.nodes()}


@pytest.mark.timeout(300)
def test_an_agent_killed_on_its_host_is_restarted_through_srun_and_reports_again(healthy_bed, allocation,
                                                                                  tmp_path) -> None:
    bed = healthy_bed
    assert allocation.hosts == tuple(h.name for h in bed.hosts) and allocation.ranks_per_node == 2
    # The bridge's address: what this machine (the "batch host" here) is to the hosts.
    assert allocation.healer_address == bed.layout.bridge_address
    token_file = tmp_path / "token"
    token = write_token(token_file)
    table = HeartbeatTable()
    # The run's mutual TLS, as `megaheal run` sets it up: the agents report with their hosts' certificates.
    tls = RunAuthority.of_run(RunPaths(tmp_path).launcher).healer().server(require_peer=False)
    reports = ReportServer(ingest_app(TableIngest(table), token), listen=f"{allocation.healer_address}:0", tls=tls)
    agents = SlurmAgents(run_dir=tmp_path, healer_url=reports.start(), token_file=token_file, allocation=allocation)
    try:
        urls = agents.start(list(allocation.hosts))
        wait_for("a batch from every agent", lambda: agent_batches(table) == urls, 60)
        victim = bed.hosts[1]
        old = AgentClient(victim.name, urls[victim.name], token, tls=agents.healer_tls()).state()
        assert old["node"] == victim.name and old["pid"] in bed.pids(victim), "the agent runs inside its host"

        os.kill(old["pid"], signal.SIGKILL)
        assert procs.wait_gone([old["pid"]], 30) == []
        new_url = agents.restart(victim.name)
        assert new_url != urls[victim.name] and new_url.startswith(f"https://{victim.address}:")
        new = AgentClient(victim.name, new_url, token, tls=agents.healer_tls()).state()
        assert new["pid"] != old["pid"] and new["pid"] in bed.pids(victim)
        wait_for("the new agent's batches", lambda: agent_batches(table).get(victim.name) == new_url, 60)
        steps = slurm.steps(allocation.job_id)
        assert sorted(n for n in steps if n.startswith(STEP_PREFIX)) == sorted(STEP_PREFIX + h for h in urls)
    finally:
        agents.stop()
        reports.stop()
    assert not any(n.startswith(STEP_PREFIX) for n in slurm.steps(allocation.job_id))
    assert wait_for("no agent left on any host", lambda: not any(
        procs.command(p) != "slurmd" for h in bed.hosts for p in bed.pids(h)), 60)


def _incident_that_left_out(store: IncidentStore, diagnosis: list[dict[str, object]], lemons: dict[str, int]) -> int:
    """An incident as the healer records it up to its restart: opened, diagnosed per host, decided."""
    incident_id, _ = store.record(Signal(rule="crash", kind="crash", severity="critical", page="on-escalation",
                                         cooldown=timedelta(minutes=5), identity=(("job", "j"),), job="j",
                                         node=None, summary="rank 2 died"))
    run = store.start_runbook_run(incident_id, "node-health", [str(h["node"]) for h in diagnosis])
    assert store.transition(incident_id, S.OPEN, S.DIAGNOSING, {})
    store.finish_runbook_run(run, incident_id, "fail", "", {"diagnosis": diagnosis})
    plan = {"remedy": "exclude-node-and-restart", "decision_basis": {"lemons": lemons}, "exclude": []}
    assert store.transition(incident_id, S.DIAGNOSING, S.REMEDIATING, {"decision": {"plan": plan}})
    return incident_id


@pytest.mark.timeout(120)
def test_hosts_proven_bad_are_drained_with_the_incident_as_reason_and_a_refusal_is_recorded(healthy_bed, allocation,
                                                                                             tmp_path) -> None:
    bed = healthy_bed
    failed, lemon, suspect = (h.name for h in bed.hosts[1:])
    engine = db.make_engine(f"sqlite:///{tmp_path / 'healer.db'}")
    db.ensure_schema(engine)
    store = IncidentStore(engine, "test")
    incident = _incident_that_left_out(store, [
        {"node": failed, "status": "fail", "summary": 'disk: "/tmp/x" not writable; rm -rf / = $(reboot)'},
        {"node": suspect, "status": "pass", "summary": "ok"},
        {"node": "nosuchhost", "status": "fail", "summary": "gone"}], {lemon: 3})
    agents = SlurmAgents(run_dir=tmp_path, healer_url="", token_file=tmp_path / "token", allocation=allocation)
    try:
        done = Drainer(agents, store, "j").left_out(incident, {failed, lemon, suspect, "nosuchhost"})
        assert sorted(done) == sorted([failed, lemon, "nosuchhost"])
        nodes = slurm.nodes([failed, lemon, suspect])
        assert "DRAIN" in nodes[failed].state and "DRAIN" in nodes[lemon].state
        assert "DRAIN" not in nodes[suspect].state, "nothing proved it bad"
        expect = {failed: f"megaheal: incident {incident}: crash (failed diagnosis: disk: /tmp/x not writable; "
                          f"rm -rf / (reboot))",
                  lemon: f"megaheal: incident {incident}: crash (lemon: named in 3 incidents)"}
        reasons = subprocess.run(["sinfo", "-R", "-h", "-o", "%N|%E"], env=bed_env(bed), capture_output=True,
                                 text=True, timeout=10).stdout.splitlines()
        assert sorted(reasons) == sorted(f"{n}|{r}" for n, r in expect.items())
        evidence = store.row(incident).evidence["drain"]
        assert {n: (e["drained"], e["reason"]) for n, e in evidence.items() if n != "nosuchhost"} == \
            {n: (True, r) for n, r in expect.items()}
        assert evidence["nosuchhost"]["drained"] is False
        assert "draining nosuchhost" in evidence["nosuchhost"]["error"] and "Invalid node name" in \
            evidence["nosuchhost"]["error"]
        assert [e["kind"] for e in store.get(incident)["events"]][-1] == "evidence"
        states = store.row(incident).evidence["slurm"]
        assert "DRAIN" in states[failed]["state"] and states[failed]["reason"].startswith(expect[failed][:40])
        assert "DRAIN" not in states[suspect]["state"], "every host left out is recorded with its Slurm state"
    finally:
        for host in (failed, lemon):
            faults.resume(bed, host)
    assert not any("DRAIN" in n.state for n in slurm.nodes([failed, lemon]).values())
