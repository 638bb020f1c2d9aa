"""Fuzz: rank datagrams (wire/telemetry.py decode, exporters/receiver.py). Any bytes give a decoded record or a
SchemaError naming what is wrong, never another exception; the receiver counts every datagram it refuses and hands
nothing of it on."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from exporters.peers import Credentials
from exporters.receiver import DatagramReceiver
from tests.exporters.helpers import step_record
from wire.telemetry import MAX_DATAGRAM_BYTES, Message, SchemaError, build_record, decode, encode

pytestmark = pytest.mark.unit

# ---- what a sender can put in a datagram ---------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1) | st.floats()
           | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=30)


def valid_records() -> list[dict]:
    """One record of each kind, as plain objects a fuzzer can change a field of."""
    records = [
        build_record("hello", "job-a", 3, os.getpid(), 0,
                     {"local_rank": 3, "node": "h", "world_size": 4, "mesh": {"dp": 3}}),
        build_record("step", "job-a", 3, os.getpid(), 2, step_record(7, rank=3, loss=float("nan"))),
        build_record("event", "job-a", 3, os.getpid(), 0, {"name": "exception", "time": 1.0, "fields": {"type": "X"}}),
    ]
    return [msgspec.to_builtins(r) for r in records]


@st.composite
def mutated_records(draw) -> bytes:
    """A valid record with one field, at any depth, replaced by anything (or removed)."""
    record = draw(st.sampled_from(valid_records()))
    node, key = record, None
    while True:
        key = draw(st.sampled_from(sorted(node)))
        if not isinstance(node[key], dict) or not node[key] or draw(st.booleans()):
            break
        node = node[key]
    if draw(st.booleans()):
        del node[key]
    else:
        node[key] = draw(values)
    return msgspec.msgpack.encode(record)


@st.composite
def nesting_bombs(draw) -> bytes:
    """Arrays or maps nested thousands deep, where a record or one of its free-form fields is expected."""
    depth = draw(st.integers(min_value=1, max_value=MAX_DATAGRAM_BYTES - 64))
    opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k"]))
    bomb = opener * (depth // len(opener)) + b"\x01"
    head = draw(st.sampled_from([b"", b"\x81\xa1v", b"\x82\xa4kind\xa5event\xa6fields"]))
    return head + bomb


datagrams = st.binary(max_size=MAX_DATAGRAM_BYTES + 1) | st.builds(msgspec.msgpack.encode, values) \
    | mutated_records() | nesting_bombs()


# ---- decoding ------------------------------------------------------------------------------------------------


@given(datagrams)
def test_it_decodes_any_bytes_into_a_record_or_a_schema_error_naming_the_problem(data: bytes) -> None:
    try:
        message = decode(data)
    except SchemaError as exc:
        assert str(exc) and isinstance(exc.field, str) and exc.reason, "a refusal says what is wrong"
        assert len(str(exc)) < 500, "and says it briefly (a log line, not the datagram)"
        return
    assert isinstance(message, Message.__args__)  # type: ignore[attr-defined]
    assert message.v == 2 and message.rank >= 0 and message.pid >= 0
    assert decode(encode(message)) == message or _has_nan(message), "a decoded record survives a round trip"


def _has_nan(message) -> bool:
    body = msgspec.to_builtins(message.body)
    return any(isinstance(v, float) and math.isnan(v) for v in body.values())


# ---- the receiver --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def receiver():
    with tempfile.TemporaryDirectory() as tmp:
        handed: list = []
        r = DatagramReceiver(Path(tmp) / "s.sock", handed.append)
        r.handed = handed  # type: ignore[attr-defined]
        yield r
        r.stop()


ME = Credentials(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
STRANGER = Credentials(pid=os.getpid(), uid=65534, gid=65534)


@given(datagrams, st.sampled_from([ME, STRANGER, None]))
def test_the_receiver_counts_what_it_refuses_and_hands_on_only_good_records(receiver, data: bytes, creds) -> None:
    before = (receiver.received, receiver.malformed, receiver.rejected_senders, len(receiver.handed))
    receiver.handle(data, creds)
    received, malformed, refused, handed = (receiver.received, receiver.malformed, receiver.rejected_senders,
                                            len(receiver.handed))
    assert received == before[0] + 1
    try:
        message = decode(data)
    except SchemaError:
        message = None
    took = creds is ME and message is not None and message.pid == ME.pid
    assert handed - before[3] == int(took), "only a good record from its own sender is handed on"
    assert (malformed - before[1]) + (refused - before[2]) == int(not took), "everything else is counted once"
    if creds is not ME:
        assert refused == before[2] + 1 and malformed == before[1], "a stranger's bytes are not even decoded"
