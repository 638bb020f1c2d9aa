"""The sidecar in-process: /metrics from rank clients, heartbeats to a healer (up and down), socket safety."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from exporters.client import RankClient
from exporters.heartbeat import HeartbeatForwarder
from exporters.receiver import SocketInUseError, bind_datagram_socket
from exporters.sidecar import Sidecar
from exporters.traces import STEP_SPAN
from tests.exporters.helpers import PHASES, step_record
from tests.exporters.promtools import free_port, wait_for
from wire.telemetry import HEARTBEAT_SCHEMA, HeartbeatBatch

pytestmark = pytest.mark.unit


class FakeHealer:
    """A real HTTP server on loopback that keeps what is posted to it (JSON batches, or raw bodies by path)."""

    def __init__(self, status: int = 200) -> None:
        self.batches: list[dict] = []
        self.raw: list[tuple[str, str, bytes]] = []
        self.auth: list[str | None] = []
        healer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Type") == "application/json":
                    healer.batches.append(json.loads(body) | {"_path": self.path})
                else:
                    healer.raw.append((self.path, self.headers.get("Content-Type"), body))
                healer.auth.append(self.headers.get("Authorization"))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def healer():
    h = FakeHealer()
    yield h
    h.close()


def make_sidecar(tmp_path, **kw) -> Sidecar:
    cfg = Sidecar.Config(node="node-1", socket_path=str(tmp_path / "s.sock"), metrics_addr="127.0.0.1:0", **kw)
    return Sidecar(cfg, nvml=None)


def test_it_serves_every_rank_and_posts_heartbeats(tmp_path, healer, monkeypatch) -> None:
    monkeypatch.setenv("MEGAHEAL_TOKEN", "s3cret")
    sidecar = make_sidecar(tmp_path, healer_url=healer.url, heartbeat_interval_s=0.2)
    sidecar.start()
    clients = [RankClient(str(tmp_path / "s.sock"), "job-a", r, r, 4, {"pp": 0, "dp": r, "tp": 0}) for r in range(4)]
    try:
        for c in clients:
            c.hello()
            c.step(step_record(1, rank=c.rank, loss=float("nan") if c.rank == 0 else 5.25))
        c.event("exception", type="RuntimeError", message="boom")

        def metrics() -> str:
            return urllib.request.urlopen(sidecar.metrics_url, timeout=5).read().decode()

        text = wait_for("all four ranks on /metrics",
                        lambda: (t := metrics()).count('megaheal_step{') == 4 and t, timeout_s=10)
        assert 'megaheal_mfu{job="job-a",node="node-1",rank="3"} 0.0161' in text
        assert 'megaheal_sidecar_nvml_up{node="node-1"} 0.0' in text
        assert "process_resident_memory_bytes" in text

        def full_batch():
            return next((b for b in healer.batches if len(b["ranks"]) == 4), None)

        batch = wait_for("a heartbeat batch with every rank", full_batch, timeout_s=10)
        assert batch["_path"] == "/v1/heartbeats" and batch["schema"] == 1 and batch["node"] == "node-1"
        assert batch["nvml"] == "absent" and batch["gpus"] == []
        rank3 = next(r for r in batch["ranks"] if r["rank"] == 3)
        assert rank3["step"] == 1 and rank3["phases"]["dp_reduce"] == 0.05 and rank3["alive"] is True
        assert rank3["last_event"]["fields"] == {"type": "RuntimeError", "message": "boom"}
        rank0 = next(r for r in batch["ranks"] if r["rank"] == 0)
        assert (rank0["loss"], rank0["nonfinite"], rank3["loss"], rank3["nonfinite"]) == (None, {"loss": "nan"}, 5.25, {})
        assert healer.auth[-1] == "Bearer s3cret"
        seqs = [b["seq"] for b in healer.batches]
        assert seqs == sorted(seqs)
    finally:
        for c in clients:
            c.close()
        sidecar.stop()
    assert not (tmp_path / "s.sock").exists(), "a stopped sidecar removes its socket"


def test_step_traces_go_out_over_otlp_http(tmp_path, healer) -> None:
    sidecar = make_sidecar(tmp_path, otlp_endpoint=healer.url)  # the fake server stands in for a collector
    sidecar.start()
    client = RankClient(str(tmp_path / "s.sock"), "job-a", 2, 2, 4, {"pp": 1, "dp": 0, "tp": 0})
    try:
        client.step(step_record(9, rank=2))
        wait_for("the rank to be seen", lambda: len(sidecar.table) == 1, timeout_s=10)
    finally:
        client.close()
        sidecar.stop()  # flushes the batch processor
    assert healer.raw, "spans were posted"
    path, content_type, body = healer.raw[0]
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    request = ExportTraceServiceRequest.FromString(body)
    spans = [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
    step = next(sp for sp in spans if sp.name == STEP_SPAN)
    assert {a.key: a.value.int_value for a in step.attributes if a.key in ("megaheal.step", "megaheal.rank")} == \
        {"megaheal.step": 9, "megaheal.rank": 2}
    children = {sp.name for sp in spans if sp.parent_span_id == step.span_id}
    assert children == set(PHASES), "a span for each phase the step took"
    resource = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
    assert resource["host.name"] == "node-1" and resource["service.name"] == "megaheal-sidecar"


def test_a_healer_that_is_down_costs_a_counter_and_a_bounded_buffer(healer) -> None:
    down_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    forwarder = HeartbeatForwarder(down_url, lambda seq, sent_at: HeartbeatBatch(
        schema=HEARTBEAT_SCHEMA, node="n", seq=seq, sent_at=sent_at, ranks=[]), buffer_batches=3)
    for _ in range(5):
        forwarder.tick()
    assert (forwarder.sent, forwarder.failures, forwarder.buffered, forwarder.dropped) == (0, 5, 3, 2)
    # The healer comes back (same forwarder, now pointed at a live one): the buffer drains, oldest first.
    forwarder.url = healer.url + "/v1/heartbeats"
    forwarder.tick()
    assert [b["seq"] for b in healer.batches] == [3, 4, 5], "the newest three fit; batch 2 made room for 5"
    assert (forwarder.sent, forwarder.buffered, forwarder.dropped) == (3, 0, 3)


def test_a_nudge_sends_the_next_batch_at_once_instead_of_at_the_end_of_the_interval() -> None:
    posted: list[int] = []
    arrived = threading.Event()

    def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
        posted.append(json.loads(body)["seq"])
        arrived.set()
        return 202

    forwarder = HeartbeatForwarder("http://127.0.0.1:9", lambda seq, sent_at: HeartbeatBatch(
        schema=HEARTBEAT_SCHEMA, node="n", seq=seq, sent_at=sent_at, ranks=[]), interval_s=60.0, post=post)
    forwarder.start()
    try:
        assert not arrived.wait(0.3), "nothing before the interval ends"
        forwarder.nudge()
        assert arrived.wait(5.0), "the nudged batch went out"
        assert posted == [0]
    finally:
        forwarder.stop()
    assert not forwarder._thread.is_alive(), "stop ends the thread without waiting out the interval"


def test_a_live_sidecars_socket_is_never_taken_over_but_a_stale_one_is(tmp_path) -> None:
    path = tmp_path / "s.sock"
    first = make_sidecar(tmp_path)
    with pytest.raises(SocketInUseError, match="already serving"):
        make_sidecar(tmp_path)
    first.receiver._sock.close()  # the process died without cleaning up: its socket file stays behind
    assert path.exists()
    second = bind_datagram_socket(path)
    second.close()
    (tmp_path / "plain").write_text("not a socket")
    with pytest.raises(SocketInUseError, match="not a socket"):
        bind_datagram_socket(tmp_path / "plain")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("metrics_addr", "9400", "metrics_addr must be HOST:PORT"),
        ("healer_url", "healer:8470", "healer_url must be an http(s) URL"),
        ("heartbeat_interval_s", 0, "heartbeat_interval_s must be > 0"),
        ("node", "", "node must be a name of letters, digits"),
    ],
)
def test_config_errors_name_the_field(tmp_path, field, value, message) -> None:
    kw = {"node": "n", "socket_path": str(tmp_path / "s.sock"), field: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        Sidecar.Config(**kw)


def test_the_metrics_server_binds_loopback_by_default(tmp_path) -> None:
    cfg = Sidecar.Config(node="n", socket_path=str(tmp_path / "s.sock"))
    assert cfg.metrics_addr.startswith("127.0.0.1:")
    sidecar = make_sidecar(tmp_path)
    sidecar.start()
    try:
        assert sidecar._httpd.socket.getsockname()[0] == "127.0.0.1"
    finally:
        sidecar.stop()


def test_a_ranks_first_nonfinite_step_is_held_for_the_next_heartbeat_whatever_comes_after_it() -> None:
    from exporters.ranks import RankTable
    from wire.telemetry import build_record

    table = RankTable(process_state=lambda pid: "S", start_time=lambda pid: 1.0)
    for step, loss in ((10, 2.0), (11, float("nan")), (12, float("nan")), (13, 1.5)):
        table.observe(build_record("step", "job-a", 1, 4242, 0, step_record(step, rank=1, loss=loss)))
    assert [s.last_step.step for s in table.snapshot()] == [13]  # metrics: the newest step
    first, second = table.heartbeat_snapshot(), table.heartbeat_snapshot()
    assert first[0].last_step.step == 11 and first[0].last_step.loss != first[0].last_step.loss
    assert second[0].last_step.step == 13  # released: the next batch goes on from the newest
    table.observe(build_record("step", "job-a", 1, 4242, 0, step_record(14, rank=1, loss=float("inf"))))
    assert table.heartbeat_snapshot()[0].last_step.step == 14  # a new onset after finite steps is held again


def test_every_rerun_verdict_is_carried_by_a_heartbeat_though_a_later_event_came_before_it_left() -> None:
    from exporters.ranks import RankTable
    from wire.telemetry import build_record

    table = RankTable(process_state=lambda pid: "S", start_time=lambda pid: 1.0)

    def event(name: str, **fields: object) -> None:
        table.observe(build_record("event", "job-a", 0, 4242, 0, {"name": name, "time": 1.0, "fields": fields}))

    event("rerun", step=4, verdict="data")
    event("rerun", step=9, verdict="persistent")
    event("checkpoint_saved", step=10)
    said = [s.last_event for s in (table.heartbeat_snapshot()[0], table.heartbeat_snapshot()[0],
                                   table.heartbeat_snapshot()[0])]
    assert [(e.name, e.fields["step"]) for e in said] == [("rerun", 4), ("rerun", 9), ("checkpoint_saved", 10)]
