"""Host faults on the bed are real: a dead host's processes are gone and Slurm notices, a frozen
process ignores SIGKILL until thawed."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO
from tests.multihost.conftest import bed_env
from tests.support import wait_for
from testbed import faults, procs, slurm

pytestmark = [pytest.mark.multihost]


def start_sleep(bed, host: str) -> subprocess.Popen:
    """A job step sleeping on `host`; returns its srun once the sleep runs there."""
    job = subprocess.Popen(["srun", "-N1", f"--nodelist={host}", "sleep", "300"], cwd=REPO, env=bed_env(bed),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(f"sleep on {host}", lambda: sleeping(bed, host), 20)
    return job


def sleeping(bed, host: str) -> list[int]:
    return [p for p in bed.pids(host) if procs.command(p) == "sleep"]


@pytest.mark.timeout(90)
def test_a_dead_host_loses_every_process_and_slurm_marks_it_down(healthy_bed) -> None:
    host = healthy_bed.hosts[3]
    job = start_sleep(healthy_bed, host.name)
    try:
        slurmd = slurm.slurmd_pid(healthy_bed.layout, host)
        assert slurmd in healthy_bed.pids(host)
        killed = faults.kill_host(healthy_bed, host)
        assert slurmd in killed
        assert healthy_bed.pids(host) == [], "nothing runs on a dead host"
        assert not procs.alive(slurmd)
        # slurmctld hears nothing from it and takes it out after SlurmdTimeout (30 s on the tier's bed).
        wait_for(f"{host.name} down in Slurm",
                 lambda: "down" in slurm.node_states(healthy_bed.layout).get(host.name, ""), 80, every_s=0.5)
    finally:
        job.kill()
        job.wait()
    faults.revive_host(healthy_bed, host)
    assert slurm.node_states(healthy_bed.layout)[host.name] == "idle"


@pytest.mark.timeout(60)
def test_a_frozen_process_takes_sigkill_only_once_thawed(healthy_bed) -> None:
    host = healthy_bed.hosts[1].name
    job = start_sleep(healthy_bed, host)
    try:
        (pid,) = sleeping(healthy_bed, host)
        group = faults.freeze(healthy_bed, [pid], "test-sleep")
        assert procs.state(pid) == "D", "frozen in the kernel, not stopped (T)"
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
        assert procs.alive(pid) and procs.state(pid) == "D", "SIGKILL waits while the task is frozen"
        faults.thaw(group)
        wait_for("the thawed process to die", lambda: not procs.alive(pid), 10)
    finally:
        job.kill()
        job.wait()
