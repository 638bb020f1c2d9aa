"""Fencing a healer off, at a real agent: an order of a stale epoch is refused with a 409 naming the epoch, the
healer's client raises Fenced and trips its fence, and an agent replaced in the same work directory still refuses
it and answers a retried order as its predecessor did. A start order that points outside the agent's run directory
fails, naming the field."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from healer.agent.node import NodeAgent
from healer.compose_agent import node_agent
from healer.launchers.agent_client import AgentClient, Fence, Fenced, OrderFailed
from tests.conftest import REPO
from wire.orders import StartOrder, WorkersOrder

pytestmark = pytest.mark.services
TOKEN = "fencing-test-token-0123456789"


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[[str], NodeAgent]]:
    """Starts an agent working in tmp_path/agent (the same one each time: a replaced agent), run dir tmp_path/run."""
    started: list[NodeAgent] = []

    def start(name: str) -> NodeAgent:
        agent = node_agent(NodeAgent.Config(node="n1", token=TOKEN, work_dir=tmp_path / "agent",
                                            scratch_dir=tmp_path / "tmp", socket_path=str(tmp_path / f"{name}.sock"),
                                            cwd=REPO, run_dir=tmp_path / "run"), nvml=None)
        agent.start()
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()


def post(url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}/v1/orders", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)


def test_an_order_from_a_stale_epoch_is_refused_and_fences_its_healer_off(agents: Callable[[str], NodeAgent]) -> None:
    first = agents("first")
    newer = AgentClient("n1", first.url, TOKEN)
    assert newer.run(WorkersOrder(id="w@2", epoch=2), 10).node == "n1"
    answer = post(first.url, {"kind": "workers", "id": "w@1", "epoch": 1})
    assert answer.status_code == 409
    assert answer.json() == {"error": "stale epoch 1 < 2: a newer healer drives this host's job", "field": "epoch"}
    fence = Fence()
    older = AgentClient("n1", first.url, TOKEN, fence=fence)
    with pytest.raises(Fenced, match="stale epoch 1 < 2"):
        older.order(WorkersOrder(id="w2@1", epoch=1))
    assert fence.by is not None
    with pytest.raises(Fenced):
        fence.check()
    recorded = first.orders.get("w@2")
    assert recorded is not None and recorded.status == "done"
    first.stop()
    # The agent is replaced (same work directory): it still refuses the older healer, and knows the newer's order.
    second = agents("second")
    assert post(second.url, {"kind": "workers", "id": "w3@1", "epoch": 1}).status_code == 409
    state = AgentClient("n1", second.url, TOKEN).order(WorkersOrder(id="w@2", epoch=2))
    assert (state.status, state.received_at, state.result) == ("done", recorded.received_at, recorded.result)


def test_a_start_order_outside_the_agents_run_directory_fails_naming_the_field(
        agents: Callable[[str], NodeAgent], tmp_path: Path) -> None:
    client = AgentClient("n1", agents("only").url, TOKEN)

    def start(order_id: str, **kw: object) -> StartOrder:
        fields: dict[str, object] = {"run_dir": str(tmp_path / "run"), "config": "configs/demo.yaml"} | kw
        return StartOrder(id=order_id, epoch=1, job="j", attempt=0, nnodes=1, node_rank=0, nproc_per_node=1,
                          **fields)  # type: ignore[arg-type]

    with pytest.raises(OrderFailed, match=r"OutsideRunDir: run_dir: .*other is not this agent's run directory"):
        client.run(start("s1", run_dir=str(tmp_path / "other")), 10)
    with pytest.raises(OrderFailed, match=r"OutsideRunDir: resume: /elsewhere/step-3 is not under"):
        client.run(start("s2", resume="/elsewhere/step-3"), 10)
    with pytest.raises(OrderFailed, match=r"OutsideRunDir: config: /etc/hosts is neither under"):
        client.run(start("s3", config="/etc/hosts"), 10)
