"""A user's own FSDP2 script, unchanged, as a self-healing Slurm job (deploy/slurm/megaheal-script.sbatch) on the
bed's 4 hosts (3 training, 2 ranks each, and a spare): a host dies while it trains, is named by its silence and left
out, the spare takes its place, and the script resumes from its own checkpoint, resharded (torch.distributed.checkpoint),
under torchrun's restart count. Then the resumed script raises the same exception at the same step on every host (a
bug in its resume path): restarted once like any crash, stopped the second time as a crash loop, the job's one page,
and the batch script exits 78, which Slurm is told not to requeue."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import faults
from tests.multihost.conftest import bed_env
from tests.multihost.slurm_job import SlurmJob
from tests.support import wait_for
from tests.usertrainer.scripts import PLAIN_FSDP2

pytestmark = pytest.mark.multihost


@pytest.fixture
def submitted(healthy_bed, tmp_path, monkeypatch) -> Iterator[list[SlurmJob]]:
    monkeypatch.setenv("SLURM_CONF", bed_env(healthy_bed)["SLURM_CONF"])
    jobs: list[SlurmJob] = []
    yield jobs
    for job in jobs:
        job.stop()


def saved_step(ckpt: Path) -> int:
    latest = ckpt / "latest"
    return int(latest.read_text()) if latest.exists() else -1


@pytest.mark.timeout(600)
def test_a_host_of_an_unchanged_fsdp2_script_dies_the_spare_takes_its_place_and_a_crash_loop_ends_the_job_with_78(
        healthy_bed, tmp_path, submitted) -> None:
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    (tmp_path / "train.py").write_text(PLAIN_FSDP2)
    ckpt = tmp_path / "ckpt"
    job = SlurmJob.submit_program(bed, tmp_path, ["train.py", "--steps", "40", "--ckpt", str(ckpt), "--sleep", "0.3",
                                                  "--raise-at-resume", "13"])
    submitted.append(job)
    wait_for("the script's checkpoint of step 10", lambda: saved_step(ckpt) >= 10 or job.proc.poll() is not None,
             300, every_s=0.5)
    assert job.proc.poll() is None, (job.proc.returncode, job.proc.stdout.read() if job.proc.stdout else "",
                                     job.text()[-3000:])
    dead = hosts[1]  # a training host; hosts[0] runs the batch script and the healer
    faults.kill_host(bed, dead)
    rc = job.end(420)
    out = job.output
    incidents = sorted(job.incidents(), key=lambda i: i["id"])
    lost = [i for i in incidents if i["kind"] == "host_lost"]
    assert [i["suspect_nodes"] for i in lost] == [[dead]], [(i["kind"], i["summary"]) for i in incidents]
    assert lost[0]["state"] == "resolved", lost[0]
    assert job.attempt(1)["nodes"] == [hosts[0], hosts[3], hosts[2]], "the spare took the dead host's place"
    # The script was told it restarted, and resumed from its own checkpoint on the new hosts.
    logs = "".join(p.read_text() for p in (tmp_path / "run").glob("nodes/*/agent/*-attempt-001/ranks/*/*/*/stdout.log"))
    resumed = {int(line.split()[5]) for line in logs.splitlines() if "restart 1" in line}
    assert len(resumed) == 1 and 10 <= min(resumed) < 13, logs
    # Resumed, it raised at step 13 on every host: a crash, restarted once; the second time, the same exception at
    # the same place and from the same start is the program's own: stopped, paged once, exit 78.
    crashes = [i for i in incidents if i["kind"] == "crash"]
    assert [(i["attempt"], i["state"]) for i in crashes] == [(1, "resolved"), (2, "escalated")], crashes
    sig = crashes[1]["evidence"]["signature"]
    assert sig == crashes[0]["evidence"]["signature"] and sig.startswith("ValueError at train.py:"), crashes
    assert [i["id"] for i in incidents if i["state"] == "escalated"] == [crashes[1]["id"]], "one page"
    assert rc == 78 and "stopped in a crash loop (exit 78, do not requeue)" in out, (rc, out[-3000:])
    assert job.attempts() == [0, 1, 2], "nothing after the loop was stopped"
    job.assert_nothing_left()
