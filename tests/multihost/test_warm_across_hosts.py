"""Warm recovery across hosts under Slurm, one job for three faults (each a job of its own would cost ~100 s):
deploy/slurm/megaheal.sbatch with `--warm` on the bed's 4 hosts (3 training, 2 ranks each, and a spare), each host
reading its GPUs from a dcgm-exporter exposition served on its own loopback (`--dcgm-url`).

1. A rank hangs spinning in its forward pass: it is named, killed and replaced by a standby of its host from its
   replica, and every other rank keeps its process.
2. One bit of a replica held in memory is flipped (`inject_replica_flips`), and the rank whose replica it is dies:
   the replica fails its checksum, every rank resumes from the disk checkpoint, and the incident says why.
3. A GPU falls off the bus (Xid 79 in its host's dcgm-exporter): the host leaves, and the spare takes its place warm,
   its ranks' state from the replicas on the next host.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.bed import Bed
from testbed.dcgm import URL, Exporters
from tests.multihost.slurm_job import SlurmJob, assert_continues, losses_by_attempt
from tests.support import wait_for

pytestmark = pytest.mark.multihost
HANG_RANK, HANG_STEP = 3, 8
FLIP_KEEPER, FLIP_AFTER = 1, 16
"""Rank 1 keeps the replica of rank 5 (its donor: ranks 2 per host, on the host before)."""
FLIPPED = 5


@pytest.fixture
def dcgm(healthy_bed: Bed, tmp_path: Path) -> Iterator[Exporters]:
    """A dcgm-exporter exposition on every host's loopback, one file per host that the test rewrites."""
    exporters = Exporters(healthy_bed, tmp_path / "dcgm")
    try:
        yield exporters
    finally:
        exporters.stop()


def pids_by_attempt(job: SlurmJob) -> dict[int, dict[int, int]]:
    """Each attempt's rank -> pid, from the ranks' own step records."""
    out: dict[int, dict[int, int]] = {}
    for r in job.records():
        out.setdefault(int(r["attempt"]), {})[r["rank"]] = r["pid"]
    return out


@pytest.mark.timeout(900)
def test_a_hung_rank_a_corrupted_replica_and_a_gpu_fault_are_each_recovered_warm_or_from_the_disk_with_the_reason(
        healthy_bed: Bed, dcgm: Exporters, tmp_path: Path) -> None:
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    faults = (f'inject_hangs=[{{"mode":"spin","at_step":{HANG_STEP},"rank":{HANG_RANK}}}] '
              f'inject_replica_flips=[{{"rank":{FLIP_KEEPER},"after_step":{FLIP_AFTER}}}]')
    # NOTE: a snapshot every 4 steps: the kill below lands within the 3 steps after the flipped one, before the
    # next snapshot could replace it.
    job = SlurmJob.submit(bed, tmp_path / "job", 45, args=f"--warm --dcgm-url {URL}",
                          extra_set=f"checkpoint.every_steps=10 snapshot_every_steps=4 {faults}")
    try:
        # 1. The hang: once a new attempt trains, the hung rank's process is gone and the others' are the same.
        wait_for("a restart after the hang", lambda: 1 in pids_by_attempt(job), 300, every_s=0.5)
        # 2. The flipped replica: rank 5 dies within the steps that follow the flip.
        mark = job.run_dir / "chaos" / f"replica-flip-after{FLIP_AFTER}-rank{FLIP_KEEPER}.fired"
        wait_for("the replica's bit flipped", mark.exists, 300, every_s=0.1)
        victim = pids_by_attempt(job)[1][FLIPPED]
        at_kill = job.steps()[FLIPPED]
        subprocess.run(["kill", "-KILL", str(victim)], check=True, timeout=10)
        assert at_kill < FLIP_AFTER + 3, f"rank {FLIPPED} was past step {at_kill} when killed: the next snapshot " \
                                         "may have replaced the flipped one"
        # 3. The GPU fault, once the job trains again from the disk and has a snapshot on every rank.
        wait_for("the restart after the crash trains past a snapshot",
                 lambda: 2 in pids_by_attempt(job) and min(job.steps().values()) >= 24, 300, every_s=0.5)
        dcgm.gpu_falls_off_the_bus(hosts[1])
        job.finish(600)
    finally:
        job.stop()
    # NOTE: a straggler notice is no fault of these (nothing restarts for it): the spare's ranks, new on a loaded
    # bed, were once named one in a fresh make test.
    incidents = sorted((i for i in job.incidents() if i["kind"] != "straggler"), key=lambda i: i["id"])
    assert [i["kind"] for i in incidents] == ["hang", "crash", "gpu_fault"], [(i["kind"], i["summary"])
                                                                              for i in job.incidents()]
    assert all(i["action"] == "notify" for i in job.incidents() if i["kind"] == "straggler"), job.incidents()
    hang, crash, gpu = incidents
    pids = pids_by_attempt(job)
    # The hang: warm, the named rank replaced from its replica, every other rank's process kept.
    assert hang["suspect_ranks"] == [HANG_RANK] and hang["plan"]["replace_ranks"] == [HANG_RANK], hang
    assert (hang["restart_mode"], hang["resumed_from"]) == ("warm", "memory"), hang
    assert {r: p for r, p in pids[1].items() if r != HANG_RANK} == {r: p for r, p in pids[0].items()
                                                                    if r != HANG_RANK}
    assert pids[1][HANG_RANK] != pids[0][HANG_RANK]
    # The corrupted replica: a warm restart whose ranks all went to the disk, saying why.
    assert crash["suspect_ranks"] == [FLIPPED] and crash["restart_mode"] == "warm", crash
    assert crash["resumed_from"].startswith(f"disk (replica of rank {FLIPPED} kept by rank {FLIP_KEEPER} failed its "
                                            f"checksum at step {FLIP_AFTER}"), crash["resumed_from"]
    assert crash["resume_step"] == 10 and crash["first_step_after"] == 10, crash
    # The GPU fault: its host out, the spare in its place, warm from the replicas on the next host.
    assert gpu["suspect_nodes"] == [hosts[1]] and "Xid 79" in gpu["summary"], gpu
    assert (gpu["restart_mode"], gpu["resumed_from"]) == ("warm", "memory"), gpu
    assert f"{hosts[3]} takes the place of {hosts[1]}, its ranks' state from their replicas on {hosts[2]}" in \
        gpu["restart_why"], gpu["restart_why"]
    assert job.attempt(3)["nodes"] == [hosts[0], hosts[3], hosts[2]]
    # The host that left stopped its workers (a leftover of the attempt before), and nothing is left anywhere.
    stopped = [(e["node"], e["attempt"]) for e in job.journal() if e["event"] == "leftover-stopped"]
    assert stopped == [(hosts[1], 2)], stopped
    dcgm.stop()
    job.assert_nothing_left()
    # After each warm restart from memory training goes on from the step it had reached, without a gap, and every
    # step trained again gives the loss it gave before.
    assert_continues(losses_by_attempt(job), ((0, 1), (2, 3)))
    assert max(losses_by_attempt(job)[3]) == 44, "the last attempt trained to the end"
