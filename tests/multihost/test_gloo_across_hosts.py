"""Real torch.distributed (gloo) jobs across the bed's hosts, started by srun."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from tests.conftest import REPO
from tests.multihost.conftest import SCRIPTS, bed_env, python, srun
from testbed import faults

pytestmark = pytest.mark.multihost


@pytest.mark.timeout(120)
def test_it_sums_a_3_host_gloo_all_reduce_launched_by_srun_and_torchrun(healthy_bed) -> None:
    first = healthy_bed.hosts[0].name
    proc = srun(
        healthy_bed, "-N", "3", "--ntasks-per-node=1", f"--nodelist={','.join(h.name for h in healthy_bed.hosts[:3])}",
        python(), "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first}:29400", "--rdzv-id", "mh-allreduce",
        str(SCRIPTS / "allreduce.py"),
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(int(r[1]) for r in rows) == [0, 1, 2], proc.stdout
    assert {r[0] for r in rows} == {h.name for h in healthy_bed.hosts[:3]}, "one rank on each of the 3 hosts"
    assert all(r[2] == "3" and r[3] == "6" for r in rows), rows  # 1 + 2 + 3


@pytest.mark.timeout(120)
def test_a_collective_blocks_while_a_link_is_down_and_finishes_once_it_is_back(healthy_bed) -> None:
    a, b = healthy_bed.hosts[0], healthy_bed.hosts[1]
    steps = 60  # 0.1 s apart: the job is still running when the link goes down after step 3
    job = subprocess.Popen(
        ["srun", "-N2", "--ntasks-per-node=1", f"--nodelist={a.name},{b.name}", "--unbuffered",
         python(), str(SCRIPTS / "allreduce_loop.py"), a.name, "29411", str(steps)],
        cwd=REPO, env=bed_env(healthy_bed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), ln) for ln in job.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any(ln.startswith("STEP 3 ") for _, ln in lines):
            assert job.poll() is None and time.monotonic() < deadline, f"no progress: {lines} {job.stderr.read()}"
            time.sleep(0.05)
        faults.cut_link(healthy_bed, b)
        cut = time.monotonic()
        time.sleep(5.0)
        during = [ln for t, ln in lines if t > cut + 1.0]  # a step already in flight may still land
        assert during == [], f"steps went on with {b.name}'s link down: {during}"
        assert job.poll() is None, "the job must block, not crash, while the link is down"
        faults.restore_link(healthy_bed, b)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    reader.join(timeout=5)
    assert job.returncode == 0, job.stderr.read()[-3000:]
    done = [ln.split() for _, ln in lines if ln.startswith("STEP ")]
    assert [int(i) for _, i, _ in done] == list(range(steps)), "every step, once, in order"
    assert {s for *_, s in done} == {"3"}, "every all-reduce summed 1 + 2"
