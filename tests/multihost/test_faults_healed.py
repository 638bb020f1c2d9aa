"""Faults of a multi-host job healed end to end under Slurm: deploy/slurm/megaheal.sbatch on the bed's 4 hosts (3
training, 2 ranks each, and a spare), a real fault injected on one host while the job trains, and then what the
healer did about it: the incident's kind and the host it names, the Slurm state of that host afterwards, the step
training resumed from, and that no process of any attempt is left on any host."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ground import procfs
from testbed import faults, procs, slurm
from tests.multihost.conftest import bed_env
from tests.multihost.slurm_job import SlurmJob, assert_continues, losses_by_attempt
from tests.support import wait_for
from wire.run_paths import RunPaths

pytestmark = pytest.mark.multihost
CHECKPOINT_EVERY = 5  # megaheal run's default


@pytest.fixture
def job_of(healthy_bed, tmp_path, monkeypatch) -> Iterator:
    monkeypatch.setenv("SLURM_CONF", bed_env(healthy_bed)["SLURM_CONF"])  # scontrol, for the hosts' states
    jobs: list[SlurmJob] = []

    def submit(steps: int, args: str = "", extra_set: str = "") -> SlurmJob:
        jobs.append(SlurmJob.submit(healthy_bed, tmp_path, steps, args, extra_set))
        return jobs[-1]

    yield submit
    for job in jobs:
        job.stop()


def assert_resumed_from_checkpoint(incident: dict, at_fault: int, every: int = CHECKPOINT_EVERY) -> None:
    """The restart resumed from the newest checkpoint the job had when the fault struck, and trained on."""
    resumed = incident["resume_step"]
    assert resumed is not None and resumed % every == 0 and 0 < resumed <= at_fault + 1, incident
    assert incident["state"] == "resolved" and incident["first_step_after"] == resumed, incident


@contextmanager
def hidden(path: Path) -> Iterator[None]:
    """`path` (a directory) out of reach while inside: renamed away, so that nothing can be read from it (root reads
    through any permission bits); put back on the way out (over the empty one a trainer may have made meanwhile)."""
    away = path.with_name(path.name + ".hidden")
    path.rename(away)
    try:
        yield
    finally:
        if path.exists():
            path.rmdir()  # NOTE: fails if anything was written there: a save while hidden is a fault of the test
        away.rename(path)


@pytest.mark.timeout(900)
def test_a_host_that_dies_is_replaced_warm_by_the_spare_and_one_cut_off_for_good_leaves_the_job_smaller(
        healthy_bed, job_of) -> None:
    # One job for both (each a job of its own took ~105 s). It runs warm: a host dies, is named and drained, and the
    # spare's standbys take its ranks from their replicas on the next host, in memory: the checkpoint directory is
    # out of reach from the fault until the spare trained. Then, with no spare left, another is cut off for good:
    # named by its silence, the job comes back cold on the two hosts left (dp 3 -> 2, from the resharded
    # checkpoint), and once the cut host is back its stale attempt is stopped.
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    # NOTE: a snapshot every 2 steps, a checkpoint every 10: the next save after the fault comes well after the
    # spare's first step, when the checkpoints are back.
    job = job_of(steps=45, args="--warm", extra_set="checkpoint.every_steps=10 snapshot_every_steps=2")
    job.wait_step(12, 300)
    dead = hosts[1]  # a training host; hosts[0] runs the batch script and the healer
    at_death = max(job.steps().values())
    slurmd = slurm.slurmd_pid(bed.layout, bed.host(dead))
    checkpoints = RunPaths(job.run_dir).checkpoints
    killed = faults.kill_host(bed, dead)
    with hidden(checkpoints):
        # The host is really dead: every process in it gone, its slurmd with them (so Slurm marks it DOWN, below).
        assert slurmd in killed and not procs.alive(slurmd) and bed.pids(bed.host(dead)) == [], killed
        wait_for("the spare's first step", lambda: 1 in losses_by_attempt(job), 300, every_s=0.2)
    job.wait_step(at_death + 6, 300)  # the spare's attempt trained past where the dead host stopped
    cut = hosts[2]
    at_cut = max(job.steps().values())
    faults.cut_link(bed, cut)
    # The job goes on without it, on the two hosts left: once that attempt starts, the host comes back (before
    # Slurm's SlurmdTimeout would end its steps itself: the healer is to stop what it left running).
    wait_for("attempt 2 started", lambda: any(e["event"] == "start" and e.get("attempt") == 2
                                              for e in job.journal()), 300, every_s=0.5)
    assert bed.pids(bed.host(cut)), "the cut-off host still runs its part of attempt 1"
    faults.restore_link(bed, cut)

    job.finish(420)
    lost = sorted((i for i in job.incidents() if i["kind"] == "host_lost"), key=lambda i: i["id"])
    assert [i["suspect_nodes"] for i in lost] == [[dead], [cut]], [(i["kind"], i["summary"]) for i in job.incidents()]
    died, cut_off = lost
    # Warm, from memory: the newest snapshot every rank held (every 2 steps), the dead host's from the next host.
    assert (died["restart_mode"], died["resumed_from"]) == ("warm", "memory"), died
    assert f"{hosts[3]} takes the place of {dead}, its ranks' state from their replicas on {hosts[2]}" in \
        died["restart_why"] and "standbys took rank(s) [2, 3]" in died["restart_why"], died["restart_why"]
    assert cut_off["restart_mode"] == "cold" and cut_off["restart_why"].startswith("the layout changes"), cut_off
    resumed = died["resume_step"]
    assert resumed is not None and resumed % 2 == 0 and at_death - 2 <= resumed <= at_death + 1, died
    assert died["state"] == "resolved" and died["first_step_after"] == resumed, died
    # The state came back exactly: no step skipped, and every step trained again gave the loss it gave before.
    assert_continues(losses_by_attempt(job), ((0, 1),))
    assert_resumed_from_checkpoint(cut_off, at_cut, every=10)
    assert "silent" in cut_off["summary"], cut_off["summary"]
    assert job.attempts() == [0, 1, 2]
    assert job.attempt(0)["nodes"] == hosts[:3]
    assert job.attempt(1)["nodes"] == [hosts[0], hosts[3], hosts[2]], "the spare took the dead host's place"
    assert job.attempt(2)["nodes"] == [hosts[0], hosts[3]] and job.attempt(2)["dp"] == 2, "no spare left: smaller"
    state = job.slurm_state(dead)
    assert "DRAIN" in state.state and f"megaheal: incident {died['id']}: host_lost" in state.reason, state
    # slurmctld heard nothing from the dead host's slurmd and took it out after SlurmdTimeout (30 s on the tier's
    # bed; the job's two restarts since took longer).
    wait_for(f"{dead} down in Slurm", lambda: "DOWN" in job.slurm_state(dead).state, 60, every_s=0.5)
    assert died["evidence"]["drain"][dead]["drained"] is True
    assert "DRAIN" in job.slurm_state(cut).state
    # Once back, the stale attempt on it was stopped by the healer (not left to the end of the allocation).
    stopped = [e for e in job.journal() if e["event"] == "leftover-stopped"]
    assert [(e["node"], e["attempt"]) for e in stopped] == [(cut, 1)], stopped
    job.assert_nothing_left()
    # Powered on again, the dead host registers and, its drain lifted, is schedulable.
    faults.revive_host(bed, dead)
    assert slurm.node_states(bed.layout)[dead] == "idle"


@pytest.mark.timeout(600)
def test_a_link_flap_a_killed_agent_and_a_killed_healer_are_ridden_out_without_a_restart(healthy_bed,
                                                                                        job_of) -> None:
    # One job takes all three in turn (each a job of its own would triple the tier's time): none of them is a fault
    # of the training, so the job must finish in its first attempt with no incident that acts.
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    job = job_of(steps=45)
    job.wait_step(6, 300)

    # A link down for a few seconds: well inside the hang timeout (its 10 s floor) and host_lost's 15 s of silence.
    faults.cut_link(bed, hosts[1])
    time.sleep(4)
    faults.restore_link(bed, hosts[1])
    at_flap = max(job.steps().values())
    job.wait_step(at_flap + 3, 120)

    # An agent killed while its ranks train: a new agent step takes them on.
    host = bed.host(hosts[2])
    agents = [p for p in bed.pids(host) if "agent" in procs_cmd(p) and "megaheal" in procs_cmd(p)]
    assert len(agents) == 1, agents
    os.kill(agents[0], signal.SIGKILL)
    restarted = wait_for("the agent restarted", lambda: [e for e in job.journal() if e["event"] == "agent-restarted"],
                         120, every_s=0.5)
    assert [(e["node"], e["adopted"]) for e in restarted] == [(hosts[2], 0)], restarted

    # The healer killed on the batch host: the script starts one that takes the run over and adopts the attempt.
    healer = wait_for("the healer's process", lambda: [p for p in bed.pids(bed.hosts[0])
                                                      if "run" in procs_cmd(p) and "--launcher" in procs_cmd(p)], 30)
    os.kill(healer[0], signal.SIGKILL)

    out = job.finish(420)
    assert "taking the run over (megaheal run --take-over" in out, out[-3000:]
    assert "3 of 3 host(s) run attempt 0 (a majority is 2): adopted" in out, out[-3000:]
    assert job.attempts() == [0], "no restart: the job trained through all three in its first attempt"
    assert [i["kind"] for i in job.incidents() if i.get("action") not in (None, "notify")] == []
    assert not any("DRAIN" in job.slurm_state(h).state for h in hosts)
    job.assert_nothing_left()


def procs_cmd(pid: int) -> str:
    return " ".join(procfs.cmdline(pid))
