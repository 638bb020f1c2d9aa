"""A node agent and the healer's report endpoint over the run's mutual TLS (issue 34, item 3): orders only from the
run's healer, a batch taken only for the host whose certificate it came with, and nothing from outside the run."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ground.httpclient import RequestFailed, request_json
from ground.tls import PeerTls, https
from healer.agent.node import NodeAgent
from healer.compose_agent import node_agent
from healer.launchers.agent_client import AgentClient, AgentUnreachable
from healer.launchers.run_authority import RunAuthority
from healer.observe.heartbeats import HeartbeatTable
from healer.runner.reports import ReportServer
from healer.service.api import TableIngest, ingest_app
from tests.conftest import REPO
from tests.support import wait_for
from wire.telemetry import HeartbeatBatch, encode_batch

pytestmark = pytest.mark.services
TOKEN = "agent-tls-token-0123456789"


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[RunAuthority, NodeAgent, HeartbeatTable, str]]:
    authority = RunAuthority.of_run(tmp_path / "launcher")
    table = HeartbeatTable()
    reports = ReportServer(ingest_app(TableIngest(table), TOKEN), tls=authority.healer().server(require_peer=False))
    url = reports.start()
    agent = node_agent(NodeAgent.Config(node="n1", token=TOKEN, work_dir=tmp_path / "agent",
                                        scratch_dir=tmp_path / "tmp", healer_url=url,
                                        socket_path=str(tmp_path / "r.sock"), cwd=REPO, heartbeat_interval_s=0.2,
                                        tls_dir=authority.host("n1").directory), nvml=None)
    agent.start()
    yield authority, agent, table, url
    agent.stop()
    reports.stop()


def _batch(node: str) -> bytes:
    return encode_batch(HeartbeatBatch(schema=1, node=node, seq=1, sent_at=0.0, ranks=[]))


def test_the_agents_batches_arrive_over_tls_and_are_taken_for_its_host(run: Any) -> None:
    _, agent, table, url = run
    assert url.startswith("https://") and agent.url.startswith("https://")
    wait_for("n1's batches over TLS", lambda: "n1" in {b.node for b in table.nodes()}, 15)


def test_orders_come_only_from_the_runs_healer(run: Any, tmp_path: Path) -> None:
    authority, agent, _, _ = run
    healer = AgentClient("n1", agent.url, TOKEN, tls=authority.healer().client())
    assert healer.state()["node"] == "n1"
    # Another host of the run holds the token and a certificate of the run's authority: still not the healer.
    n2 = authority.host("n2").client()
    status, body = https("GET", f"{agent.url}/v1/state", None, {"Authorization": f"Bearer {TOKEN}"}, 5,
                         PeerTls(n2, "host", "n1"), 4096)
    assert status == 403 and b"only the run's healer" in body
    # Someone with the token and no certificate of the run: no handshake.
    plain = ssl.create_default_context(cafile=str(authority.ca_cert))
    plain.check_hostname = False
    with pytest.raises(RequestFailed):
        request_json("GET", f"{agent.url}/v1/state", headers={"Authorization": f"Bearer {TOKEN}"},
                     tls=PeerTls(plain, "host", "n1"))
    # A healer of another run, whatever its token: its certificate does not verify.
    stranger = RunAuthority.of_run(tmp_path / "other" / "launcher").healer().client()
    with pytest.raises(AgentUnreachable, match="certificate verify failed"):
        AgentClient("n1", agent.url, TOKEN, tls=stranger, attempts=1).state()


def test_a_batch_for_another_host_is_refused_and_the_token_alone_cannot_report(run: Any) -> None:
    authority, _, table, url = run
    n2 = PeerTls(authority.host("n2").client(), "healer")
    status, body = https("POST", f"{url}/v1/heartbeats", _batch("n1"), {"Content-Type": "application/json"}, 5, n2,
                         4096)
    assert status == 403 and b"certificate of host 'n2'" in body
    status, _ = https("POST", f"{url}/v1/heartbeats", _batch("n2"), {}, 5, n2, 4096)
    assert status == 202
    # A client that verifies the healer but shows no certificate, with the run's token: not a host.
    anonymous = ssl.create_default_context(cafile=str(authority.ca_cert))
    anonymous.check_hostname = False
    status, body = https("POST", f"{url}/v1/heartbeats", _batch("n3"), {"Authorization": f"Bearer {TOKEN}"}, 5,
                         PeerTls(anonymous, "healer"), 4096)
    assert status == 403 and b"host's certificate" in body
    assert "n3" not in {b.node for b in table.nodes()}
