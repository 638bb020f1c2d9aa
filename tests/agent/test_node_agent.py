"""The node agent on its own, against real processes: its orders API (token, malformed orders, idempotent ids), a
real attempt of 4 ranks started, watched, signalled and stopped through it, a runbook run on its host, and its
batches carrying the host's part of the attempt to a healer's table."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from ground.httpclient import RequestFailed, request_json
from healer.agent.node import NodeAgent
from healer.compose_agent import node_agent
from healer.launchers.agent_client import AgentClient, OrderFailed
from healer.observe.heartbeats import HeartbeatTable
from healer.runner.reports import ReportServer
from healer.service.api import TableIngest, ingest_app
from tests.conftest import CONFIGS, REPO
from tests.support import wait_for
from wire.orders import Order, RunbookOrder, SignalOrder, StartOrder, StopOrder

TOKEN = "agent-test-token-0123456789"
PHASES = {"startup", "restore", "data_wait", "forward_backward", "dp_gather", "dp_reduce", "grad_norm_clip",
          "optimizer", "global_scalars", "checkpoint", "checkpoint_save"}


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    table = HeartbeatTable()
    reports = ReportServer(ingest_app(TableIngest(table), TOKEN))
    url = reports.start()
    node = node_agent(NodeAgent.Config(node="n1", token=TOKEN, work_dir=tmp_path / "agent", scratch_dir=tmp_path / "tmp",
                                      healer_url=url, socket_path=str(tmp_path / "r.sock"), cwd=REPO,
                                      heartbeat_interval_s=0.2, extra_env={"GLOO_SOCKET_IFNAME": "lo"}), nvml=None)
    node.start()
    yield node, AgentClient("n1", node.url, TOKEN), table
    node.stop()
    reports.stop()


def start_order(tmp_path: Path, order_id: str = "j-0:start:n1") -> dict[str, Any]:
    return {"kind": "start", "id": order_id, "epoch": 1, "job": "j", "attempt": 0, "nnodes": 1, "node_rank": 0,
            "nproc_per_node": 4, "config": str(CONFIGS / "tiny-dp4.yaml"), "run_dir": str(tmp_path / "run"),
            "overrides": ["steps=200", "job=j"]}


def post(url: str, body: dict[str, Any], token: str = TOKEN) -> Any:
    """An order as any client may send it, typed or not (the agent must refuse what does not fit)."""
    return request_json("POST", f"{url}/v1/orders", body, {"Authorization": f"Bearer {token}"})


@pytest.mark.services
def test_orders_need_the_token_and_a_malformed_order_is_refused_naming_its_field(agent: Any, tmp_path: Path) -> None:
    node, client, _ = agent
    with pytest.raises(RequestFailed, match="401"):
        post(node.url, start_order(tmp_path), token="wrong")
    bad = {**start_order(tmp_path), "nproc_per_node": 0}
    with pytest.raises(RequestFailed, match="400.*nproc_per_node"):
        post(node.url, bad)
    hostile = {**start_order(tmp_path), "env": {"LD_PRELOAD": "/tmp/x.so"}}
    with pytest.raises(RequestFailed, match="400.*env"):
        post(node.url, hostile)  # only the settings wire/orders.py ENV_KEYS names reach a rank
    # A stop names the attempt it stops: one that named none stopped whatever ran, a later attempt too.
    with pytest.raises(RequestFailed, match="400.*attempt"):
        post(node.url, {"kind": "stop", "id": "stop-any", "epoch": 1, "grace_s": 0})
    for key in ("CUDA_INJECTION64_PATH", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "TORCH_EXTENSIONS_DIR"):
        with pytest.raises(RequestFailed, match="400.*env"):
            post(node.url, {**start_order(tmp_path), "env": {key: "/tmp/evil.so"}})  # by name, not by prefix
    # An unknown field nested 20,000 deep (msgspec skips it recursively): refused, not a 500.
    deep = json.dumps(start_order(tmp_path))[:-1] + ', "extra": ' + "[" * 20000 + "]" * 20000 + "}"
    answer = httpx.post(f"{node.url}/v1/orders", content=deep, headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=10)
    assert answer.status_code == 400 and "nested too deeply" in answer.text, answer.text


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_an_attempt_is_started_once_watched_signalled_and_stopped_through_the_agent(agent: Any, tmp_path: Path) -> None:
    node, client, table = agent
    table.processes.started("j", 0)  # what the healer's coordinator does before it orders the start
    order = msgspec.convert(start_order(tmp_path), Order)
    assert isinstance(order, StartOrder)
    assert client.run(order, 30).rdzv_endpoint.startswith("127.0.0.1:")
    assert client.order(order).status == "done", "the same id again: the first order's state, no second start"
    with pytest.raises(OrderFailed, match="409"):
        client.order(msgspec.structs.replace(order, attempt=1))
    # The batches carry the host's part of the attempt into the healer's table.
    wait_for("four ranks in the table", lambda: len(table.processes.reported_ranks("j")) == 4, 60, every_s=0.1)
    # And the phase each rank says it is in now (its phase file), with when it entered it, by the healer's clock.
    in_phase = wait_for("a rank's phase in the table",
                        lambda: [s for s in table.processes.states() if s.phase in PHASES and s.phase_entered], 60,
                        every_s=0.1)
    assert all(s.phase_entered <= time.time() + 1 and s.phase_step is not None for s in in_phase)
    pid = client.run(SignalOrder(id="kill-3", epoch=1, attempt=0, rank=3, signal="SIGKILL"), 10).pid
    wait_for("the crash in the batches", lambda: [e for e in table.processes.exits() if e.rank == 3], 30, every_s=0.1)
    (crashed,) = [e for e in table.processes.exits() if e.rank == 3]
    assert crashed.pid == pid and (crashed.signal == signal.SIGKILL or crashed.vanished)
    # torchrun stops the other ranks and exits by itself, its failure report saying how rank 3 died (a stop before
    # that would SIGKILL torchrun too, and a rank it reaped first would stay "vanished").
    wait_for("torchrun to end the attempt", lambda: client.state()["attempt"]["ended"], 60, every_s=0.1)
    assert client.run(StopOrder(id="stop-0", epoch=1, attempt=0, grace_s=1), 60).stopped == 0
    state = client.state()["attempt"]
    assert state["ended"] and state["ranks"] == []
    exits = {e["rank"]: e for e in state["exits"]}
    assert exits[3]["signal"] == signal.SIGKILL and not exits[3]["expected"]
    time.sleep(0.5)
    assert table.processes.ended_nodes("j") == {"n1": state["exit_code"]}


@pytest.mark.services
@pytest.mark.timeout(120)
def test_a_runbook_runs_on_the_agents_host_and_says_its_verdict(agent: Any) -> None:
    _, client, _ = agent
    result = client.run(RunbookOrder(id="rb-1", epoch=1, runbook="node-health", timeout_s=90), 120)
    assert result.returncode == 0 and '"verdict": "pass"' in result.stdout
