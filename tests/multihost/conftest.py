"""The multi-host tier: a real 4-host bed (network namespaces, a bridge, slurmctld and a slurmd per host),
brought up once per session and taken down at its end.

Needs root (CI runs as root); otherwise every test that uses the bed is skipped, saying so. Its prefix,
subnet and slurmctld port are the tier's own, so a developer's `megaheal testbed up` (prefix mh) can
stay up meanwhile. A session that was killed leaves its bed behind: the next one removes it first.
Faults a test injects are undone after it (`faults.clear`), so every test starts on a healthy bed.
MEGAHEAL_TIER_PREFIX, MEGAHEAL_TIER_SUBNET and MEGAHEAL_TIER_SLURMCTLD_PORT give a second checkout's session a bed
of its own.
"""

from __future__ import annotations

import os
from datetime import timedelta
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from testbed import faults
from testbed.bed import Bed, default_shared_tmp
from testbed.hostns import under_tmp
from testbed.job import job_env

SCRIPTS = REPO / "tests" / "multihost" / "scripts"
# NOTE: two checkouts on one machine (worktrees) may run the tier at once: each gives its own prefix, subnet and
# port here, or the second session's start takes the first one's bed down under it.
# NOTE: Slurm marks a silent host DOWN (and ends its job steps: "Node failure") after SlurmdTimeout. 30 s, not the
# bed's default 10 s: the host cut off for good in test_faults_healed is back ~20-25 s after its cut, and must still
# run its stale attempt then (with 10 s, Slurm ended it first in one full run here).
CONFIG = dict(hosts=4, prefix=os.environ.get("MEGAHEAL_TIER_PREFIX", "mht"),
              subnet=os.environ.get("MEGAHEAL_TIER_SUBNET", "10.214.0.0/24"),
              slurmctld_port=int(os.environ.get("MEGAHEAL_TIER_SLURMCTLD_PORT", "6827")),
              slurmd_timeout=timedelta(seconds=30))


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the multi-host tier needs root (network namespaces, a bridge, Slurm daemons); "
                    "CI runs it as root: sudo .venv/bin/python -m pytest tests/multihost")


@pytest.fixture(scope="session")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    need_root()
    # The tests' temporary directories (pytest keeps them under /tmp) are the cluster's shared filesystem here:
    # every host must see them, as it sees the checkout.
    shared = tuple(sorted({*default_shared_tmp(), str(tmp_path_factory.getbasetemp().parent)}))
    the_bed = Bed(Bed.Config(**CONFIG, shared_tmp=tuple(p for p in shared if under_tmp(p))))
    the_bed.down()  # whatever a killed session left
    the_bed.up()
    try:
        yield the_bed
    finally:
        the_bed.down()


@pytest.fixture
def healthy_bed(bed: Bed) -> Iterator[Bed]:
    """The session's bed, with every fault and job of the test undone afterwards."""
    yield bed
    faults.clear(bed)


def bed_env(bed: Bed) -> dict[str, str]:
    """The environment of a job on the bed (testbed.job.job_env): its SLURM_CONF, one thread per rank, no
    GLOO_SOCKET_IFNAME."""
    return job_env(bed)


def srun(bed: Bed, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`srun ARGS` on the bed from this machine, as a user would type it."""
    return subprocess.run(["srun", *args], cwd=REPO, env=bed_env(bed), capture_output=True, text=True,
                          timeout=timeout)


def python() -> str:
    """The interpreter of this checkout (on the shared filesystem, so every host runs the same one)."""
    return sys.executable
