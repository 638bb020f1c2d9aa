"""The rank client and the wire schema: records arrive intact; without a sidecar nothing blocks or raises."""

from __future__ import annotations

import json
import math
import socket

import pytest

from exporters.client import SOCKET_ENV, NullRankClient, RankClient
from exporters.schema import Event, Hello, SchemaError, StepRecord, decode
from tests.exporters.helpers import step_record

MESH = {"pp": 1, "dp": 0, "tp": 1}


@pytest.fixture
def sidecar_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "s.sock"))
    sock.settimeout(2)
    yield sock
    sock.close()


def client(path, rank=3) -> RankClient:
    return RankClient(str(path), "job-a", rank, 1, 8, MESH, node="host-a")


def test_it_delivers_hello_step_and_event_records(tmp_path, sidecar_socket) -> None:
    c = client(tmp_path / "s.sock")
    c.hello()
    c.step(step_record(7, rank=3, loss=float("nan")))
    c.event("exception", type="RuntimeError", message="NCCL timeout")
    hello, step, event = (decode(sidecar_socket.recv(65536)) for _ in range(3))
    assert isinstance(hello, Hello) and hello.mesh == MESH and hello.world_size == 8 and hello.node == "host-a"
    assert isinstance(step, StepRecord) and step.step == 7 and step.origin.rank == 3
    assert math.isnan(step.loss), "a NaN loss reaches the sidecar as NaN"
    assert step.phases["dp_reduce"] == 0.05 and step.extra["mesh"] == {"pp": 0, "dp": 3, "tp": 0}
    assert isinstance(event, Event) and event.name == "exception"
    assert event.fields == {"type": "RuntimeError", "message": "NCCL timeout"}
    assert (c.sent, c.dropped) == (3, 0)
    c.close()


def test_without_a_sidecar_records_are_counted_as_dropped_and_nothing_raises(tmp_path) -> None:
    c = client(tmp_path / "absent.sock")
    c.hello()
    for step in range(5):
        c.step(step_record(step))
    c.event("checkpoint_saved", step=4)
    assert (c.sent, c.dropped) == (0, 7)
    c.close()
    c.step(step_record(5))  # after close: still silent, still counted
    assert c.dropped == 8


def test_it_never_waits_for_a_sidecar_that_stopped_reading(tmp_path, sidecar_socket) -> None:
    c = client(tmp_path / "s.sock")
    c.hello()
    for step in range(2000):  # far more than the kernel queues for an unread socket
        c.step(step_record(step))
    assert c.dropped > 0, "a full queue drops records instead of blocking"
    assert c.sent + c.dropped == 2001
    # What was queued is intact and in order.
    first, second = decode(sidecar_socket.recv(65536)), decode(sidecar_socket.recv(65536))
    assert isinstance(first, Hello) and isinstance(second, StepRecord) and second.step == 0


def test_a_sidecar_that_appears_later_is_greeted_and_told_the_drops(tmp_path) -> None:
    path = tmp_path / "late.sock"
    c = client(path)
    c.hello()
    c.step(step_record(0))
    assert c.dropped == 2
    late = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    late.bind(str(path))
    late.settimeout(2)
    try:
        c.step(step_record(1))
        hello, step = decode(late.recv(65536)), decode(late.recv(65536))
    finally:
        late.close()
    assert isinstance(hello, Hello) and hello.origin.dropped == 2
    assert isinstance(step, StepRecord) and step.step == 1 and step.origin.dropped == 2


def test_unserialisable_or_oversized_records_are_dropped_and_the_next_one_goes(tmp_path, sidecar_socket) -> None:
    c = client(tmp_path / "s.sock")
    c.step(step_record(0, tensor=object()))
    c.step(step_record(1, blob="x" * 20000))
    c.step(step_record(2))
    assert c.dropped == 2
    messages = [decode(sidecar_socket.recv(65536)) for _ in range(2)]
    assert [type(m).__name__ for m in messages] == ["Hello", "StepRecord"] and messages[1].step == 2


def test_from_env_gives_a_null_client_without_the_variable(tmp_path) -> None:
    null = RankClient.from_env("job", 0, 0, 1, MESH, environ={})
    assert isinstance(null, NullRankClient)
    null.hello()
    null.step(step_record(0))
    null.event("exception", type="E", message="m")
    null.close()
    assert null.dropped == 0
    real = RankClient.from_env("job", 0, 0, 1, MESH, environ={SOCKET_ENV: str(tmp_path / "s.sock")})
    assert type(real) is RankClient and real.path == str(tmp_path / "s.sock")
    real.close()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: e.update(v=2), "v: unknown schema version 2"),
        (lambda e: e.update(kind="metrics"), "kind: expected one of"),
        (lambda e: e.update(rank=-1), "rank: expected a non-negative integer"),
        (lambda e: e["body"].pop("loss"), "body.loss: expected a number"),
        (lambda e: e["body"].update(step_seconds=float("inf")), "body.step_seconds: expected a finite number"),
        (lambda e: e["body"]["phases"].update(optimizer="slow"), "body.phases.optimizer"),
        (lambda e: e.update(job=""), "job: expected a printable string"),
    ],
)
def test_the_decoder_names_what_is_wrong(mutate, message) -> None:
    envelope = {"v": 1, "kind": "step", "job": "j", "rank": 0, "pid": 1, "dropped": 0, "body": step_record(0)}
    mutate(envelope)
    with pytest.raises(SchemaError, match=message.replace(".", r"\.")):
        decode(json.dumps(envelope).encode())
    with pytest.raises(SchemaError, match="not JSON"):
        decode(b"\xff{")
