"""Host faults on the bed are real: a frozen process ignores SIGKILL until thawed. (A dead host, its processes gone
and Slurm marking it DOWN, is checked where the healer meets it: test_faults_healed.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO
from tests.multihost.conftest import bed_env
from tests.support import wait_for
from testbed import faults, procs

pytestmark = pytest.mark.multihost


def start_sleep(bed, host: str) -> subprocess.Popen:
    """A job step sleeping on `host`; returns its srun once the sleep runs there."""
    job = subprocess.Popen(["srun", "-N1", f"--nodelist={host}", "sleep", "300"], cwd=REPO, env=bed_env(bed),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(f"sleep on {host}", lambda: sleeping(bed, host), 20)
    return job


def sleeping(bed, host: str) -> list[int]:
    return [p for p in bed.pids(host) if procs.command(p) == "sleep"]


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
