"""Relays (exporters/relay.py): a node group's heartbeat batches reach the healer as one request per interval,
checked on the way, aged by the relay's clock, and the nodes go to the healer directly while their relay is down."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from exporters.client import RankClient
from exporters.heartbeat import RELAY_RETRY_S, HeartbeatForwarder
from exporters.relay import HeartbeatRelay
from exporters.sidecar import Sidecar
from healer.errors import BadRequest
from healer.observe.heartbeats import HeartbeatTable
from tests.exporters.helpers import step_record
from tests.healer.services import MEGAHEAL, TOKEN, HealerProcess, free_port, http, wait_for
from wire.telemetry import HEARTBEAT_SCHEMA, HeartbeatBatch, RankEntry, SchemaError, encode_batch

pytestmark = pytest.mark.services


def node_batch(node: str, seq: int, step: int = 7, ranks: int = 2, first: int = 0) -> HeartbeatBatch:
    return HeartbeatBatch(schema=HEARTBEAT_SCHEMA, node=node, seq=seq, sent_at=time.time(), ranks=[
        RankEntry(job="job-a", rank=r, alive=True, last_seen_age_s=0.25, pid=100 + r, step=step)
        for r in range(first, first + ranks)])


def test_a_relay_passes_on_each_nodes_latest_batch_and_the_healer_ages_it_by_the_relays_clock() -> None:
    relay = HeartbeatRelay("rack-1", "http://127.0.0.1:9", TOKEN)
    relay.take(encode_batch(node_batch("n1", seq=0, step=7)))
    relay.take(encode_batch(node_batch("n2", seq=0, ranks=3, first=2)))
    relay.take(encode_batch(node_batch("n1", seq=1, step=8)))  # n1's newer batch replaces its first
    time.sleep(0.2)
    body = relay.build()
    assert body is not None
    sent = json.loads(body)
    assert (sent["relay"], sent["schema"]) == ("rack-1", 2), "by column"
    assert sorted((n["node"], n["seq"], n["ranks"]) for n in sent["nodes"]) == [("n1", 1, 2), ("n2", 0, 3)]
    assert all(0.2 <= n["age_s"] < 5 for n in sent["nodes"]), [n["age_s"] for n in sent["nodes"]]

    table = HeartbeatTable(clock=lambda: 1000.0)
    assert table.ingest_relayed(body) == (2, 5)
    n1 = next(n for n in table.nodes() if n.node == "n1")
    assert n1.relay == "rack-1" and n1.received_at == pytest.approx(1000.0 - next(
        n["age_s"] for n in sent["nodes"] if n["node"] == "n1"))
    assert sorted((b.node, b.rank, b.step) for b in table.ranks()) == [
        ("n1", 0, 8), ("n1", 1, 8), ("n2", 2, 7), ("n2", 3, 7), ("n2", 4, 7)]


def test_a_batch_the_healer_would_refuse_is_refused_by_the_relay_and_a_bad_relay_batch_stores_nothing() -> None:
    relay = HeartbeatRelay("rack-1", "http://127.0.0.1:9", TOKEN, max_nodes=1)
    bad = json.loads(encode_batch(node_batch("n1", 0)))
    bad["ranks"][1]["step"] = -3
    with pytest.raises(SchemaError) as refused:
        relay.take(json.dumps(bad).encode())
    assert refused.value.field == "ranks[1].step", refused.value
    relay.take(encode_batch(node_batch("n1", 0)))
    with pytest.raises(OverflowError, match="max_nodes"):
        relay.take(encode_batch(node_batch("n2", 0)))
    assert relay.nodes == 1

    table = HeartbeatTable()
    relayed = {"schema": 1, "relay": "rack-1", "seq": 1, "sent_at": time.time(), "nodes": [
        {"age_s": 0.1, "batch": json.loads(encode_batch(node_batch("n1", 0)))}, {"age_s": 0.1, "batch": bad}]}
    with pytest.raises(BadRequest) as exc:
        table.ingest_relayed(json.dumps(relayed).encode())
    assert exc.value.field == "nodes[1].batch.ranks[1].step", exc.value
    assert len(table) == 0 and table.nodes() == [], "none of a bad relay batch is stored"


def test_a_forwarder_whose_relay_is_down_sends_to_the_healer_and_tries_the_relay_again_later() -> None:
    now = [0.0]
    relay_up = [False]
    posted: list[tuple[str, int]] = []

    def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
        if url.startswith("http://relay") and not relay_up[0]:
            raise ConnectionRefusedError("connection refused")
        posted.append((url.split("/")[2], json.loads(body)["seq"]))
        return 202

    forwarder = HeartbeatForwarder("http://healer:1", lambda seq, sent_at: node_batch("n1", seq), post=post,
                                   clock=lambda: now[0], relay_url="http://relay:2")
    forwarder.tick()
    assert posted == [] and forwarder.buffered == 1, "one failure of the relay: the batch waits for the next try"
    forwarder.tick()
    assert posted == [("healer:1", 0), ("healer:1", 1)], "two in a row: to the healer itself, nothing lost"
    relay_up[0] = True
    now[0] = RELAY_RETRY_S - 1
    forwarder.tick()
    assert posted[-1] == ("healer:1", 2), "the relay is not tried again before RELAY_RETRY_S"
    now[0] = RELAY_RETRY_S + 1
    forwarder.tick()
    assert posted[-1] == ("relay:2", 3), "then it is, and it answers"


@pytest.mark.timeout(120)
def test_a_sidecars_batches_reach_the_healer_through_its_relay_and_directly_once_the_relay_is_killed(
        tmp_path, monkeypatch) -> None:
    healer = HealerProcess(tmp_path / "healer", {"db": f"sqlite:///{tmp_path / 'h.db'}"}).start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    relay_port = free_port()
    relay_log = (tmp_path / "relay.log").open("w")
    relay = subprocess.Popen([MEGAHEAL, "relay", "--healer-url", healer.url, "--token-file", str(token_file),
                              "--name", "rack-7", "--listen", f"127.0.0.1:{relay_port}", "--interval", "0.5"],
                             stdout=relay_log, stderr=subprocess.STDOUT)
    relay_url = f"http://127.0.0.1:{relay_port}"
    monkeypatch.setenv("MEGAHEAL_TOKEN", TOKEN)
    sidecar = Sidecar(Sidecar.Config(node="node-1", socket_path=str(tmp_path / "s.sock"), metrics_addr="127.0.0.1:0",
                                     healer_url=healer.url, relay_url=relay_url, heartbeat_interval_s=0.3), nvml=None)
    client = None
    try:
        wait_for("the relay", lambda: _status(f"{relay_url}/healthz") == 200, 30)
        sidecar.start()
        client = RankClient(str(tmp_path / "s.sock"), "job-r", 0, 0, 1, {"pp": 0, "dp": 0, "tp": 0})
        client.hello()
        client.step(step_record(1, rank=0, loss=2.5))
        wait_for("the rank in the healer, through the relay",
                 lambda: _metric(healer, "megaheal_healer_relay_batches_total") >= 2
                 and _metric(healer, "megaheal_healer_tracked_ranks") == 1, 30)
        # One node per relay batch here: the batches the healer counts beyond its relay batches came directly.
        direct_before = _metric(healer, "megaheal_healer_heartbeat_batches_total") - _metric(
            healer, "megaheal_healer_relay_batches_total")
        assert direct_before == 0, "while the relay answers, nothing goes to the healer directly"

        relay.send_signal(signal.SIGKILL)
        relay.wait(10)
        relayed = _metric(healer, "megaheal_healer_relay_batches_total")
        killed_at = time.monotonic()
        wait_for("batches straight to the healer", lambda: _metric(
            healer, "megaheal_healer_heartbeat_batches_total") - relayed >= 2, 30)
        took = time.monotonic() - killed_at
        assert _metric(healer, "megaheal_healer_relay_batches_total") == relayed
        assert took < 10, f"the node went to the healer {took:.1f} s after its relay died"
    finally:
        if client is not None:
            client.close()
        sidecar.stop()
        if relay.poll() is None:
            relay.kill()
            relay.wait(10)
        relay_log.close()
        healer.stop()


def _status(url: str) -> int | None:
    try:
        return http("GET", url, timeout=2)[0]
    except OSError:
        return None


def _metric(healer: HealerProcess, name: str) -> float:
    status, text = http("GET", f"{healer.url}/metrics", token=None)
    for line in str(text).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_over_the_runs_tls_a_relay_takes_each_hosts_own_batch_and_the_healer_only_a_relays(tmp_path) -> None:
    from exporters.relay_service import create_relay_app
    from ground.tls import PeerTls, https
    from healer.launchers.run_authority import RunAuthority
    from healer.runner.reports import ReportServer
    from healer.service.api import TableIngest, ingest_app

    authority = RunAuthority.of_run(tmp_path / "launcher")
    table = HeartbeatTable()
    healer = ReportServer(ingest_app(TableIngest(table), TOKEN), tls=authority.healer().server(require_peer=False))
    healer_url = healer.start()
    relay_files = authority.relay("rack-1")
    relay = HeartbeatRelay("rack-1", healer_url, TOKEN, tls=relay_files.client())
    front = ReportServer(create_relay_app(relay), tls=relay_files.server(require_peer=True))
    relay_url = front.start()
    n1 = authority.host("n1").client()
    try:
        json_ = {"Content-Type": "application/json"}
        mine = encode_batch(node_batch("n1", 0))
        assert https("POST", f"{relay_url}/v1/heartbeats", mine, json_, 5, PeerTls(n1, "relay"), 4096)[0] == 202
        status, body = https("POST", f"{relay_url}/v1/heartbeats", encode_batch(node_batch("n2", 0)), json_, 5,
                             PeerTls(n1, "relay"), 4096)
        assert status == 403 and b"certificate of host 'n1'" in body
        assert relay.forward(), "the healer took the relay's batch on its certificate"
        assert {b.node: b.relay for b in table.nodes()} == {"n1": "rack-1"}
        # A host cannot pass itself off as a relay at the healer.
        status, _ = https("POST", f"{healer_url}/v1/heartbeats/relayed", relay.build() or b"", json_, 5,
                          PeerTls(n1, "healer"), 4096)
        assert status == 403
    finally:
        front.stop()
        healer.stop()
