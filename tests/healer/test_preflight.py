"""Screening before a host takes work (healer/launchers/preflight.py): where the job starts once the hosts that
failed are left out, and the drain reason they are given."""

from __future__ import annotations

import pytest

from healer.launchers.drain import preflight_reason
from healer.launchers.placement import Placement
from healer.launchers.preflight import PreflightError, failed, screened_placement
from healer.ports import HostVerdict
from wire.verdict import Status

pytestmark = pytest.mark.unit
JOB = Placement(nodes=("n1", "n2", "n3"), spares=("n4", "n5"), dp=3)


def test_only_a_failed_verdict_leaves_a_host_out() -> None:
    verdicts = [HostVerdict("n1", Status.PASS, "ok", 1.0), HostVerdict("n2", Status.FAIL, "host: disk full", 1.0),
                HostVerdict("n3", Status.DEGRADED, "loopback: slow", 1.0),
                HostVerdict("n4", Status.ERROR, "preflight could not run: timed out", 30.0)]
    assert failed(verdicts) == {"n2": "host: disk full"}


def test_a_failed_spare_is_no_spare_and_a_failed_host_of_the_job_gives_its_place_to_one_that_passed() -> None:
    placed = screened_placement(JOB, {"n4": "host: /dev/shm too small"}, ())
    assert (placed.nodes, placed.spares, placed.dp, placed.excluded) == (("n1", "n2", "n3"), ("n5",), 3, {"n4"})
    placed = screened_placement(JOB, {"n2": "nvml: Xid 79", "n4": "host: disk full"}, ())
    assert placed.nodes == ("n1", "n5", "n3") and placed.spares == () and placed.excluded == {"n2", "n4"}


def test_with_no_spare_left_the_job_starts_smaller_where_its_layout_allows_and_not_otherwise() -> None:
    bad = {"n2": "host: disk full", "n4": "x", "n5": "y"}
    placed = screened_placement(JOB, bad, (1, 2, 3))
    assert (placed.nodes, placed.dp, placed.spares) == (("n1", "n3"), 2, ())
    with pytest.raises(PreflightError, match=r"n2 failed preflight \(n2: host: disk full\), no spare that passed is "
                                             r"left for n2, and the job's layout does not fit on 2 host\(s\)"):
        screened_placement(JOB, bad, (3,))
    with pytest.raises(PreflightError):
        screened_placement(JOB, {n: "x" for n in ("n1", "n2", "n3", "n4", "n5")}, ())


def test_the_drain_reason_is_one_bounded_line() -> None:
    # (an argument of scontrol, never a shell's: ground.slurm.safe_reason's alphabet)
    reason = preflight_reason("host: scratch directory /tmp/a\nb is not a directory" + "x" * 300)
    assert reason.startswith("megaheal: preflight (host: scratch directory /tmp/a b is not") and len(reason) < 140
    assert "\n" not in reason and reason.endswith("...)")
