"""The agent keeper's one decision: when to replace a node agent that stopped posting batches and does not answer.
At once when its process is known to have ended; only after `unreachable_after` when it may just be out of reach (a
link down): replacing a live agent cancels its step, and under Slurm its ranks go with it. The launcher and the
coordinator are stand-ins here (what they do is proven on real agents in test_e2e.py and tests/multihost); the
agents' URLs are real closed ports on loopback, so "does not answer" is a real refused connection."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from healer.launchers.agent_client import AgentClient
from healer.observe.heartbeats import HeartbeatTable
from healer.runner.keeper import AgentKeeper
from tests.healer.helpers import ManualClock, batch
from tests.support import free_port

pytestmark = pytest.mark.unit


@dataclass
class Fleet:
    dead: set[str] = field(default_factory=set)
    restarted: list[str] = field(default_factory=list)

    def gone(self, node: str) -> bool:
        return node in self.dead

    def restart(self, node: str) -> str:
        self.restarted.append(node)
        self.dead.discard(node)
        return f"http://127.0.0.1:{free_port()}"


def test_a_dead_agent_is_replaced_at_once_and_one_out_of_reach_only_after_its_longer_silence(tmp_path: Path) -> None:
    clock = ManualClock()
    table = HeartbeatTable(clock=clock)
    closed = {n: AgentClient(n, f"http://127.0.0.1:{free_port()}", "t") for n in ("n1", "n2", "n3")}
    coordinator = SimpleNamespace(agents=closed, cfg=SimpleNamespace(run_dir=tmp_path),
                                  reattach=lambda node, client: 0)
    fleet = Fleet(dead={"n1"})
    # Not started: each look is taken by hand below.
    hosts = ["n1", "n2", "n3"]
    keeper = AgentKeeper(fleet, coordinator, table, lambda: hosts, "t", clock=clock)  # type: ignore[arg-type]
    for node in ("n1", "n2", "n3"):
        table.ingest(batch(node, [0]))
    clock.now += 5
    table.ingest(batch("n3", [0]))  # n3 still posts
    keeper.check()
    assert fleet.restarted == ["n1"], "n1's process ended: replaced after 5 s; n2 only went quiet"
    clock.now += 10  # n2 silent 15 s: a link can be down that long
    for node in ("n1", "n3"):  # n1's new agent posts
        table.ingest(batch(node, [0]))
    keeper.check()
    assert fleet.restarted == ["n1"]
    clock.now += 6  # 21 s
    for node in ("n1", "n3"):
        table.ingest(batch(node, [0]))
    keeper.check()
    assert fleet.restarted == ["n1", "n2"]
    assert [(node, adopted) for node, _, adopted in keeper.restarts] == [("n1", 0), ("n2", 0)]
