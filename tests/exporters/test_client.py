"""The rank client and the wire schema: records arrive intact; without a sidecar nothing blocks or raises."""

from __future__ import annotations

import math
import re
import socket

import msgspec
import pytest

from exporters.client import SOCKET_ENV, NullRankClient, RankClient
from tests.exporters.helpers import step_record
from wire.telemetry import Event, Hello, SchemaError, StepRecord, build_record, decode, encode

pytestmark = pytest.mark.unit

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
    assert isinstance(hello, Hello) and hello.body.mesh == MESH and hello.body.world_size == 8
    assert hello.body.node == "host-a"
    assert isinstance(step, StepRecord) and step.body.step == 7 and step.rank == 3
    assert math.isnan(step.body.loss), "a NaN loss reaches the sidecar as NaN"
    assert step.body.phases["dp_reduce"] == 0.05 and step.body.mesh == {"pp": 0, "dp": 3, "tp": 0}
    assert isinstance(event, Event) and event.body.name == "exception"
    assert event.body.fields == {"type": "RuntimeError", "message": "NCCL timeout"}
    assert (c.sent, c.dropped) == (3, 0)
    c.close()


def test_each_step_says_the_attempt_named_in_the_environment_as_it_is_sent(tmp_path, sidecar_socket,
                                                                         monkeypatch) -> None:
    # A warm worker's process outlives its attempt: its generation loop sets MEGAHEAL_ATTEMPT as each one begins.
    from exporters.heartbeat import rank_summary
    from exporters.ranks import RankState
    from wire import rank_env

    c = client(tmp_path / "s.sock")
    monkeypatch.delenv(rank_env.ATTEMPT, raising=False)
    c.step(step_record(1))
    monkeypatch.setenv(rank_env.ATTEMPT, "1")
    c.step(step_record(2))
    monkeypatch.setenv(rank_env.ATTEMPT, "2")
    c.step(step_record(3))
    steps = [decode(sidecar_socket.recv(65536)) for _ in range(4)][1:]  # after the hello
    assert [(s.body.step, s.body.attempt) for s in steps] == [(1, None), (2, 1), (3, 2)]
    assert rank_summary(RankState(job="job-a", rank=3, pid=1, last_step=steps[2].body)).attempt == 2
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
    assert isinstance(first, Hello) and isinstance(second, StepRecord) and second.body.step == 0


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
    assert isinstance(hello, Hello) and hello.dropped == 2
    assert isinstance(step, StepRecord) and step.body.step == 1 and step.dropped == 2


def test_unserialisable_or_oversized_records_are_dropped_and_the_next_one_goes(tmp_path, sidecar_socket) -> None:
    c = client(tmp_path / "s.sock")
    c.step(step_record(0, loss="low"))  # does not fit the schema
    c.event("exception", tensor=object())  # MessagePack cannot carry it
    c.event("exception", message="x" * 20000)  # over the datagram limit
    c.step(step_record(2))
    assert c.dropped == 3
    messages = [decode(sidecar_socket.recv(65536)) for _ in range(2)]
    assert [type(m).__name__ for m in messages] == ["Hello", "StepRecord"] and messages[1].body.step == 2


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
        (lambda e: e.update(v=3), "v: unknown schema version 3 (this sidecar reads 2)"),
        (lambda e: e.update(kind="metrics"), "kind: invalid value 'metrics'"),
        (lambda e: e.update(rank=-1), "rank: expected an integer >= 0"),
        (lambda e: e["body"].update(loss="low"), "body.loss: expected a number (NaN and infinities allowed)"),
        (lambda e: e["body"].pop("step_seconds"), "body.step_seconds: missing"),
        (lambda e: e["body"].update(step_seconds=float("inf")), "body.step_seconds: expected a finite number"),
        (lambda e: e["body"]["phases"].update(optimizer="slow"), "body.phases[...]: expected a finite number"),
        (lambda e: e.update(job=""), "job: expected a name"),
    ],
)
def test_the_decoder_names_what_is_wrong(mutate, message) -> None:
    envelope = {"kind": "step", "v": 2, "job": "j", "rank": 0, "pid": 1, "dropped": 0, "body": step_record(0)}
    mutate(envelope)
    with pytest.raises(SchemaError, match=re.escape(message)):
        decode(msgspec.msgpack.encode(envelope))


def test_the_decoder_refuses_what_is_not_a_v2_record() -> None:
    with pytest.raises(SchemaError, match="not a MessagePack record"):
        decode(b"\xc1")
    with pytest.raises(SchemaError, match=re.escape("v: a JSON datagram (schema v1)")):
        decode(b'{"v": 1, "kind": "step"}')


def test_every_record_kind_comes_back_from_the_wire_unchanged() -> None:
    records = [
        build_record("hello", "job-a", 3, 42, 0, {"local_rank": 1, "node": "host-a", "world_size": 8, "mesh": MESH}),
        build_record("step", "job-a", 3, 42, 5, step_record(7, rank=3, loss=float("inf"), grad_norm=float("-inf"))),
        build_record("event", "job-a", 3, 42, 5, {"name": "exception", "time": 1.5, "fields": {"type": "E", "n": [1]}}),
    ]
    assert [decode(encode(r)) for r in records] == records


def test_fields_a_newer_rank_adds_are_ignored() -> None:
    envelope = {"kind": "step", "v": 2, "job": "j", "rank": 0, "pid": 1, "dropped": 0, "trace_id": "abc",
                "body": {**step_record(4), "moe_aux_loss": 0.01}}
    record = decode(msgspec.msgpack.encode(envelope))
    assert isinstance(record, StepRecord) and record.body.step == 4 and record.job == "j"
