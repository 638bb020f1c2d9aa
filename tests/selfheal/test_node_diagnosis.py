"""Node diagnostics before a restart: the real node-health runbook run on a host (its own TMPDIR) through its node
agent, a broken host failing it, and a runbook that cannot run blaming nobody."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from healer.decide.plans import Verdict
from healer.launchers.coordinator import Coordinator
from healer.launchers.local_agents import LocalAgents
from healer.launchers.node_diagnosis import (
    diagnose_node,
    diagnose_nodes,
)
from healer.launchers.run_token import write_token
from healer.observe.processes import ProcessView
from healer.ports import HostVerdict, to_verdict
from healer.runner.chaos import break_scratch
from tests.conftest import REPO

pytestmark = pytest.mark.services

TIMEOUT = timedelta(seconds=120)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[LocalAgents, Coordinator]]:
    """Two hosts' node agents (in this process), and the coordinator that orders them."""
    token = write_token(tmp_path / "token")
    agents = LocalAgents(run_dir=tmp_path, healer_url="", token_file=tmp_path / "token", in_process=True, cwd=REPO)
    coordinator = Coordinator(Coordinator.Config(job="j", config="configs/demo.yaml", run_dir=tmp_path),
                              ProcessView(), token, epoch=1)
    coordinator.agents.update(agents.clients(token) if agents.start(["n1", "n2"]) else {})
    yield agents, coordinator
    agents.stop()


@pytest.mark.timeout(180)
def test_a_node_whose_local_disk_broke_fails_node_health_and_its_healthy_peer_passes(
        tmp_path: Path, hosts: tuple[LocalAgents, Coordinator]) -> None:
    _, coordinator = hosts
    broken = break_scratch(LocalAgents.scratch_dir(tmp_path, "n2"))
    verdicts = diagnose_nodes(coordinator.run_runbook, ["n1", "n2"], "node-health", TIMEOUT)
    assert [v.node for v in verdicts] == ["n1", "n2"]
    ok, bad = verdicts
    assert ok.status == "pass", ok.summary
    assert bad.status == "fail" and f"host: scratch directory {broken.absolute()} is not a directory" in bad.summary
    assert to_verdict(verdicts) == Verdict(status="fail", bad_nodes=("n2",))


def test_a_runbook_that_cannot_finish_in_time_is_an_error_that_blames_no_node(
        hosts: tuple[LocalAgents, Coordinator]) -> None:
    # 50 ms is far less than the interpreter needs to start: the command is killed, not waited for.
    v = diagnose_node(hosts[1].run_runbook, "n1", "node-health", timedelta(milliseconds=50))
    assert v.status == "error" and "ran past 0.05 s" in v.summary
    assert to_verdict([v]) == Verdict(status="error", bad_nodes=())


def test_an_unknown_runbook_is_an_error_with_the_reason(hosts: tuple[LocalAgents, Coordinator]) -> None:
    v = diagnose_node(hosts[1].run_runbook, "n1", "no-such-runbook", TIMEOUT)
    assert v.status == "error" and "no-such-runbook exited 2 without a result" in v.summary


def test_the_worst_node_sets_the_verdict_and_only_failed_nodes_are_named() -> None:
    def v(node: str, status: str) -> HostVerdict:
        return HostVerdict(node, status, "", 0.1)

    assert to_verdict([]) == Verdict(status="pass")
    assert to_verdict([v("a", "pass"), v("b", "degraded")]) == Verdict(status="degraded")
    assert to_verdict([v("a", "error"), v("b", "fail"), v("c", "fail")]) == Verdict("fail", ("b", "c"))
