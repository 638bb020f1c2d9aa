"""The heartbeat batch on the wire: what a sidecar encodes, the healer decodes into the same typed structs; a
field that does not fit is refused by name; fields a newer sidecar adds are accepted."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from exporters.sidecar import Sidecar
from healer.errors import BadRequest
from healer.observe.heartbeats import HeartbeatTable, parse_batch
from tests.exporters.helpers import step_record
from tests.exporters.recorded_nvml import RecordedNvml
from tests.healer.helpers import batch
from wire.telemetry import GpuEntry, HeartbeatBatch, RankEntry, build_record, decode, encode, encode_batch

pytestmark = pytest.mark.unit


def sidecar_batch(tmp_path: Any) -> HeartbeatBatch:
    """A batch as a real sidecar builds it: two ranks (one with a NaN loss and an event, one that only said hello)
    and the recorded GPUs, each record sent through the rank datagram's own encoding first."""
    sidecar = Sidecar(Sidecar.Config(node="node-1", socket_path=str(tmp_path / "s.sock"), metrics_addr="127.0.0.1:0"),
                      nvml=RecordedNvml())
    sidecar.start()
    try:
        for record in (build_record("hello", "job-a", 0, 100, 0, {"local_rank": 0, "node": "h", "world_size": 2,
                                                                  "mesh": {"pp": 0, "dp": 0, "tp": 0}}),
                       build_record("step", "job-a", 0, 100, 1, step_record(7, loss=float("nan"))),
                       build_record("event", "job-a", 0, 100, 1, {"name": "checkpoint_saved", "time": 5.0,
                                                                  "fields": {"step": 7, "path": "/ckpt"}}),
                       build_record("hello", "job-a", 1, 101, 0, {"local_rank": 1, "node": "h", "world_size": 2,
                                                                  "mesh": {"pp": 0, "dp": 1, "tp": 0}})):
            sidecar.table.observe(decode(encode(record)))
        return sidecar.heartbeat_batch(seq=4, sent_at=1_700_000_000.5)
    finally:
        sidecar.stop()


def test_a_sidecars_batch_reaches_the_detectors_unchanged(tmp_path: Any) -> None:
    sent = sidecar_batch(tmp_path)
    assert len(sent.ranks) == 2 and sent.gpus, "the batch carries ranks and GPUs"
    assert sent.ranks[0].nonfinite == {"loss": "nan"} and sent.ranks[0].loss is None and sent.ranks[1].step is None
    body = encode_batch(sent)
    assert parse_batch(body) == sent
    table = HeartbeatTable(clock=lambda: 10.0)
    assert table.ingest(body) == 2
    assert [b.entry for b in sorted(table.ranks(), key=lambda b: b.rank)] == sent.ranks
    (node,) = table.nodes()
    assert (node.node, node.seq, node.gpus, node.jobs) == ("node-1", 4, tuple(sent.gpus), ("job-a",))


def test_a_rank_entry_is_read_by_attribute_so_a_misspelt_field_fails_loudly(tmp_path: Any) -> None:
    table = HeartbeatTable()
    table.ingest(encode_batch(sidecar_batch(tmp_path)))
    beat = next(b for b in table.ranks() if b.rank == 0)
    assert (beat.entry.pid, beat.entry.phases["dp_reduce"], beat.entry.last_event.name) == (100, 0.05, "checkpoint_saved")
    with pytest.raises(AttributeError):
        beat.entry.pdi  # type: ignore[attr-defined]  # noqa: B018 - the read is the test


# ---- every field refused by name ----------------------------------------------------------------------------

def _wrong(struct: type, field: str) -> Any:
    """A value of the wrong type for `field`: no field of these structs takes both a list and a string."""
    return "x" if "list[" in str(msgspec.structs.fields(struct)[_index(struct, field)].type) else []


def _index(struct: type, field: str) -> int:
    return [f.name for f in msgspec.structs.fields(struct)].index(field)


def _cases() -> list[tuple[str, Any]]:
    """(path, where to put the bad value) for every field of the batch, its rank entries and its GPU entries."""
    cases: list[tuple[str, Any]] = []
    for f in msgspec.structs.fields(HeartbeatBatch):
        cases.append((f.name, (None, f.name, _wrong(HeartbeatBatch, f.name))))
    for f in msgspec.structs.fields(RankEntry):
        cases.append((f"ranks[0].{f.name}", ("ranks", f.name, _wrong(RankEntry, f.name))))
    for f in msgspec.structs.fields(GpuEntry):
        cases.append((f"gpus[0].{f.name}", ("gpus", f.name, _wrong(GpuEntry, f.name))))
    return cases


def _body(where: tuple[str | None, str, Any]) -> bytes:
    body = batch("n1", [0])
    body["gpus"] = [{"gpu": 0, "uuid": "GPU-0"}]
    part, key, value = where
    (body if part is None else body[part][0])[key] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(("field", "where"), _cases(), ids=[c[0] for c in _cases()])
def test_each_field_of_the_wrong_type_is_refused_by_name(field: str, where: tuple[str | None, str, Any]) -> None:
    with pytest.raises(BadRequest) as refused:
        HeartbeatTable().ingest(_body(where))
    assert refused.value.field == field and "expected" in str(refused.value), str(refused.value)


@pytest.mark.parametrize(("field", "where", "text"), [
    ("schema", (None, "schema", 2), "expected 1, got 2"),
    ("node", (None, "node", "n 1"), "expected a name"),
    ("seq", (None, "seq", -1), "expected an integer >= 0"),
    ("ranks[0].rank", ("ranks", "rank", -3), "expected an integer >= 0"),
    ("ranks[0].job", ("ranks", "job", "a" * 254), "at most 253"),
    ("ranks[0].last_seen_age_s", ("ranks", "last_seen_age_s", -0.5), "expected a finite number >= 0"),
    ("ranks[0].alive", ("ranks", "alive", 1), "expected true or false, got an integer"),
    ("ranks[0].mesh[...]", ("ranks", "mesh", {"pp": -1}), "expected an integer >= 0"),
    ("ranks[0].phases", ("ranks", "phases", {str(i): 0.1 for i in range(17)}), "at most 16 phases"),
    ("ranks[0].last_event.name", ("ranks", "last_event", {"name": "", "time": 1.0}), "an event name of 1-64"),
    ("gpus[0].xid_counts[...]", ("gpus", "xid_counts", {"79": -1}), "expected an integer >= 0"),
    ("ranks[0].job", ("ranks", "job", None), "got null"),
    # Past 64 bits: the healer's int64 columns cannot hold them (once a struct.error, a 500 and half a batch stored).
    ("ranks[0].pid", ("ranks", "pid", 2**63), "below 2^63"),
    ("ranks[0].step", ("ranks", "step", 2**64), "below 2^63"),
    ("ranks[0].dp_reduce_enter_ns", ("ranks", "dp_reduce_enter_ns", -(2**63)), "an integer of 64 bits"),
])
def test_values_outside_the_limits_are_refused_by_name(field: str, where: tuple[str | None, str, Any], text: str) -> None:
    with pytest.raises(BadRequest) as refused:
        HeartbeatTable().ingest(_body(where))
    assert refused.value.field == field and text in str(refused.value), str(refused.value)


def test_a_required_field_left_out_is_named_missing() -> None:
    body = batch("n1", [0])
    del body["ranks"][0]["alive"]
    with pytest.raises(BadRequest, match=r"ranks\[0\]\.alive: missing: expected true or false") as refused:
        HeartbeatTable().ingest(json.dumps(body).encode())
    assert refused.value.field == "ranks[0].alive"


def test_more_than_4096_ranks_in_one_batch_are_refused() -> None:
    entry = batch("n1", [0])["ranks"][0]
    body = {**batch("n1", []), "ranks": [entry] * 4097}
    with pytest.raises(BadRequest, match="at most 4096 rank entries") as refused:
        HeartbeatTable().ingest(json.dumps(body).encode())
    assert refused.value.field == "ranks"


def test_an_unknown_schema_version_is_refused_whatever_else_it_carries() -> None:
    for body in ({"schema": 2, "ranks": "a later layout"}, {"ranks": None, "schema": "2"}):
        with pytest.raises(BadRequest, match="expected 1, got") as refused:
            HeartbeatTable().ingest(json.dumps(body).encode())
        assert refused.value.field == "schema"


def test_a_decoded_object_is_held_to_the_same_schema_as_bytes() -> None:
    body = batch("n1", [0])
    body["ranks"][0]["step_seconds"] = float("nan")  # JSON cannot carry this; an object in memory can
    with pytest.raises(BadRequest, match="expected a finite number") as refused:
        HeartbeatTable().ingest(body)
    assert refused.value.field == "ranks[0].step_seconds"


# ---- forward compatibility ----------------------------------------------------------------------------------

def test_fields_a_newer_sidecar_adds_are_accepted_everywhere() -> None:
    body = batch("n1", [0, 1])
    body["future"] = {"anything": [1, 2]}
    body["ranks"][0]["numa_node"] = 1
    body["ranks"][0]["last_event"] = {"name": "finishing", "time": 1.0, "fields": {"step": 11}, "severity": "info"}
    body["gpus"] = [{"gpu": 0, "uuid": "GPU-0", "nvlink_errors": 0}]
    table = HeartbeatTable()
    assert table.ingest(json.dumps(body).encode()) == 2
    beat = next(b for b in table.ranks() if b.rank == 0)
    assert beat.step == 10 and beat.entry.last_event is not None and beat.entry.last_event.fields == {"step": 11}
    assert table.nodes()[0].gpus[0].uuid == "GPU-0"
