"""Slurm across the bed's hosts: distinct hosts for srun, drained hosts left out, node-local /tmp."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from tests.conftest import REPO
from tests.multihost.conftest import bed_env, python, srun
from testbed import faults

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(90)]

WHO = "import socket, subprocess; h = socket.gethostname(); " \
      "a = subprocess.run(['ip', '-4', '-o', 'addr', 'show', 'eth0'], capture_output=True, text=True).stdout; " \
      "print('WHO', h, socket.gethostbyname(h), a.split()[3].split('/')[0])"


def test_it_runs_srun_N3_on_three_distinct_hostnames_with_distinct_addresses(healthy_bed) -> None:
    proc = srun(healthy_bed, "-N", "3", "--ntasks-per-node=1", python(), "-c", WHO)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("WHO ")]
    assert len(rows) == 3, proc.stdout
    layout = {h.name: h.address for h in healthy_bed.hosts}
    names = {name for name, _, _ in rows}
    assert len(names) == 3 and names <= set(layout), rows
    for name, resolved, on_eth0 in rows:
        # Its own name resolves (through its own /etc/hosts) to the address its interface really has.
        assert resolved == on_eth0 == layout[name], rows
    assert len({addr for _, addr, _ in rows}) == 3


def test_it_keeps_srun_off_a_drained_host(healthy_bed) -> None:
    drained = healthy_bed.hosts[1]
    faults.drain(healthy_bed, drained, "megaheal test: bad host")
    reasons = subprocess.run(["sinfo", "-R", "-h", "-o", "%N|%E"], env=bed_env(healthy_bed), capture_output=True,
                             text=True, timeout=10).stdout
    assert f"{drained.name}|megaheal test: bad host" in reasons.splitlines(), reasons
    # Three of four hosts are left: a 3-node step takes exactly those, every time.
    proc = srun(healthy_bed, "-N", "3", "--ntasks-per-node=1", "hostname")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == sorted(h.name for h in healthy_bed.hosts if h != drained)
    # Asked for by name, the drained host is refused instead of used.
    proc = srun(healthy_bed, "-N", "1", f"--nodelist={drained.name}", "--immediate=5", "hostname")
    assert proc.returncode != 0 and drained.name not in proc.stdout.split(), proc.stdout + proc.stderr


def test_each_host_has_its_own_tmp_and_shares_the_checkout(healthy_bed, tmp_path_factory) -> None:
    a, b = healthy_bed.hosts[0].name, healthy_bed.hosts[1].name
    name = f"megaheal-{uuid.uuid4().hex}"
    shared = REPO / "runs" / name  # the shared filesystem: a run directory every host sees
    write = f"import pathlib; pathlib.Path('/tmp/{name}').write_text('x'); pathlib.Path('{shared}').write_text('x')"
    look = f"import os; print('TMP', os.path.exists('/tmp/{name}'), 'SHARED', os.path.exists('{shared}'))"
    shared.parent.mkdir(exist_ok=True)
    try:
        assert srun(healthy_bed, "-N1", f"--nodelist={a}", python(), "-c", write).returncode == 0
        on_a = srun(healthy_bed, "-N1", f"--nodelist={a}", python(), "-c", look).stdout.split()
        on_b = srun(healthy_bed, "-N1", f"--nodelist={b}", python(), "-c", look).stdout.split()
    finally:
        shared.unlink(missing_ok=True)
    assert on_a == ["TMP", "True", "SHARED", "True"]
    assert on_b == ["TMP", "False", "SHARED", "True"], "a host's /tmp is its own; the checkout is shared"
    assert not (healthy_bed.layout.state_dir / "tmp" / b / name).exists()
    assert (healthy_bed.layout.state_dir / "tmp" / a / name).exists()


def test_a_directory_the_machine_keeps_under_tmp_is_shared_with_every_host(healthy_bed, tmp_path) -> None:
    # pytest's tmp_path (and a checkout a CI clones under /tmp) must stay the shared filesystem on every host,
    # although each host's /tmp is its own.
    assert str(tmp_path).startswith("/tmp/")
    (tmp_path / "from-the-machine").write_text("x")
    look = f"import os; print(os.path.exists('{tmp_path / 'from-the-machine'}'))"
    for host in healthy_bed.hosts:
        assert srun(healthy_bed, "-N1", f"--nodelist={host.name}", python(), "-c", look).stdout.split() == ["True"]
