"""Node diagnostics before a restart: the real node-health runbook run "on" a local node (its own TMPDIR) by
the launcher, a broken node failing it, and a runbook that cannot run blaming nobody."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from healer.core.plans import Verdict
from healer.core.remediator import HostVerdict, to_verdict
from healer.runner.chaos import break_scratch
from healer.launchers.local import LocalLauncher
from healer.launchers.node_diagnosis import (
    diagnose_node,
    diagnose_nodes,
)
from tests.conftest import REPO

TIMEOUT = timedelta(seconds=120)


@pytest.mark.timeout(180)
def test_a_node_whose_local_disk_broke_fails_node_health_and_its_healthy_peer_passes(tmp_path: Path) -> None:
    launcher = LocalLauncher(cwd=REPO)
    for node in ("n1", "n2"):
        launcher.scratch_dir(tmp_path, node).mkdir(parents=True)
    broken = break_scratch(launcher.scratch_dir(tmp_path, "n2"))
    verdicts = diagnose_nodes(launcher, tmp_path, ["n1", "n2"], "node-health", TIMEOUT)
    assert [v.node for v in verdicts] == ["n1", "n2"]
    ok, bad = verdicts
    assert ok.status == "pass", ok.summary
    assert bad.status == "fail" and f"host: scratch directory {broken.absolute()} is not a directory" in bad.summary
    assert to_verdict(verdicts) == Verdict(status="fail", bad_nodes=("n2",))


def test_a_runbook_that_cannot_finish_in_time_is_an_error_that_blames_no_node(tmp_path: Path) -> None:
    # 50 ms is far less than the interpreter needs to start: the command is killed, not waited for.
    v = diagnose_node(LocalLauncher(cwd=REPO), tmp_path, "n1", "node-health", timedelta(milliseconds=50))
    assert v.status == "error" and "ran past 0.05 s" in v.summary
    assert to_verdict([v]) == Verdict(status="error", bad_nodes=())


def test_an_unknown_runbook_is_an_error_with_the_reason(tmp_path: Path) -> None:
    v = diagnose_node(LocalLauncher(cwd=REPO), tmp_path, "n1", "no-such-runbook", TIMEOUT)
    assert v.status == "error" and "no-such-runbook exited 2 without a result" in v.summary


def test_the_worst_node_sets_the_verdict_and_only_failed_nodes_are_named() -> None:
    def v(node: str, status: str) -> HostVerdict:
        return HostVerdict(node, status, "", 0.1)

    assert to_verdict([]) == Verdict(status="pass")
    assert to_verdict([v("a", "pass"), v("b", "degraded")]) == Verdict(status="degraded")
    assert to_verdict([v("a", "error"), v("b", "fail"), v("c", "fail")]) == Verdict("fail", ("b", "c"))
