"""Waits a generation's abort can end (inprocess/waits.py), on two real gloo ranks (tests/distributed/waits_rank.py).

First the loss they exist for: a receive whose connection is shut down while its payload is being read is never woken
by gloo (torch 2.13), and its untimed wait outlasts the watch. Then the same receive waited for through
inprocess/waits.py ends at once with GenerationAborted once the generation's interrupt is set; a collective is
waited for in slices that neither break one that completes late nor outlast an interrupt; and a DTensor's own
collective, run through waits.call, ends at the interrupt too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.support import free_port

pytestmark = pytest.mark.multiprocess


def run_pair(case: str) -> dict:
    """Both ranks of `case`; rank 0's report."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.distributed.waits_rank", str(r), str(port), case],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = ranks[0].communicate(timeout=120)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert ranks[0].returncode == 0 and lines, err[-3000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(300)
def test_a_receive_cut_off_mid_payload_waits_for_ever_in_gloo_and_is_ended_by_the_generations_interrupt() -> None:
    plain = run_pair("receive-plain")
    assert plain["mid_payload"] and plain["shut"] >= 1, plain
    # gloo's own wait: still blocked when the watch ended (the lost wake-up inprocess/waits.py is for).
    assert not plain["released"] and "wait" not in plain, plain

    armed = run_pair("receive-armed")
    assert armed["mid_payload"] and armed["released"], armed
    assert armed["wait"].startswith("GenerationAborted: generation 0 was aborted while this rank waited on"), armed


@pytest.mark.timeout(300)
def test_a_collective_waited_in_slices_completes_late_and_ends_at_the_interrupt() -> None:
    report = run_pair("collective-armed")
    assert report["late_sum"] == [3.0] * 4, report
    assert report["raised"] and "generation 0 was aborted" in report["raised"], report
    assert report["after_s"] >= 0.4, "it waited until the interrupt"



@pytest.mark.timeout(300)
def test_a_dtensors_own_collective_run_through_waits_call_sums_and_ends_at_the_interrupt() -> None:
    # What the trainer's gradient norm waits on (DTensor's full_tensor): a wait inside a C++ op that no slice can
    # end; a warm rank stuck there after an abort exited 75 (tests/multihost/test_warm_across_hosts.py).
    report = run_pair("dtensor-armed")
    assert report["sum"] == [3.0] * 4, report
    assert report["raised"] and "generation 0 was aborted while this rank waited on a DTensor's sum" in \
        report["raised"], report
    assert 0.4 <= report["after_s"] < 3.0, "it waited until the interrupt, and no longer"
