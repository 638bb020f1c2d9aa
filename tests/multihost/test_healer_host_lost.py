"""The host that runs the healer lost with it, under Slurm: deploy/slurm/megaheal.sbatch on the bed's 4 hosts, its
first host (the batch script, the healer, ranks 0-1) killed while the job trains. The watcher on another host
(megaheal watch) hands the run to a successor job on the three hosts left, whose healer takes the run over from its
run directory: the lost host is an incident there, the spare takes its place, and the job finishes."""

from __future__ import annotations

import json
import time

import pytest

from ground import slurm
from testbed import faults
from testbed.bed import Bed
from tests.multihost.conftest import bed_env
from tests.multihost.slurm_job import SlurmJob
from tests.support import wait_for
from wire.run_paths import RunPaths

pytestmark = pytest.mark.multihost
STEPS = 22


@pytest.mark.timeout(900)
def test_the_healers_host_lost_hands_the_job_to_a_successor_that_takes_the_run_over_and_finishes(
        healthy_bed: Bed, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_CONF", bed_env(healthy_bed)["SLURM_CONF"])  # scontrol and squeue, below
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    job = SlurmJob.submit(bed, tmp_path / "job", STEPS)
    successor: str | None = None
    try:
        job.wait_step(10, 300)
        wait_for("the watcher's step", lambda: "megaheal-watch" in slurm.steps(job.job_id), 60, every_s=0.5)
        at_fault = max(job.steps().values())
        fault_at = time.time()
        faults.kill_host(bed, hosts[0])
        handover_file = RunPaths(job.run_dir).launcher / "handover.json"
        wait_for("the watcher's handover", handover_file.exists, 120, every_s=0.5)
        handover = json.loads(handover_file.read_text())
        successor = handover["successor"]
        assert handover["job_id"] == job.job_id and handover["batch_host"] == hosts[0], handover
        # This job was cancelled by its watcher.
        job.wait_ended(120)
        wait_for(f"job {job.job_id} cancelled", lambda: _state(job.job_id) == "CANCELLED", 120, every_s=1.0)
        wait_for(f"successor job {successor} to end", lambda: _ended(successor), 600, every_s=1.0)
    finally:
        job.stop()
        if successor is not None and not _ended(successor):
            slurm.cancel(successor)
    out = job.text()
    assert "outcome: finished" in out, out[-4000:]
    assert _state(successor) == "COMPLETED", _state(successor)
    # One incident for the lost host, in the run's own store, with the watcher's account; the spare in its place.
    lost = [i for i in job.incidents() if i["kind"] == "host_lost"]
    assert [i["suspect_nodes"] for i in lost] == [[hosts[0]]], [(i["kind"], i["summary"]) for i in job.incidents()]
    incident = lost[0]
    assert f"goes on as job {successor}" in incident["summary"] and incident["state"] == "resolved", incident
    assert incident["evidence"]["handover"]["successor"] == successor
    last = job.attempts()[-1]
    assert job.attempt(last)["nodes"] == [hosts[3], hosts[1], hosts[2]], "the spare took the lost host's place"
    # The restart spent the run's budget (the restarts table of the same store), and resumed from the newest
    # checkpoint: the job trained every step to the end.
    assert incident["resume_step"] is not None and 0 < incident["resume_step"] <= at_fault + 1, incident
    steps = {r["step"] for r in job.records()}
    assert steps == set(range(STEPS)), sorted(set(range(STEPS)) - steps)
    first_after = min(r["time"] for r in job.records() if r["attempt"] == last)
    print(f"healer's host lost: the successor's first step {first_after - fault_at:.1f} s after the fault")


def _state(job_id: str) -> str:
    return slurm.job_state(job_id)


def _ended(job_id: str) -> bool:
    return _state(job_id) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")
