"""The relay hop by column (wire/relay.py): every field of every rank entry gets to the healer as its node
sent it, the healer's columns hold the same numbers as for a batch the node posted itself, and a relay batch whose
lists do not agree is refused, naming the list, with nothing stored."""

from __future__ import annotations

import base64
import json
import math
import struct
import time

import msgspec
import numpy as np
import pytest

from healer.errors import BadRequest
from healer.observe.heartbeats import HeartbeatTable
from wire.relay import NodeColumns, columns_of, decode_relay_batch, encode_relay
from wire.telemetry import HEARTBEAT_SCHEMA, EventBody, GpuEntry, HeartbeatBatch, RankEntry, SchemaError

pytestmark = pytest.mark.unit


def varied_batch(node: str, first: int, ranks: int) -> HeartbeatBatch:
    """A node's batch whose ranks differ in every way a rank entry can: fields missing or set, jobs, events, the
    last event, non-finite values, phases the trainer does not have, a stopped process."""
    entries = []
    for r in range(first, first + ranks):
        entries.append(RankEntry(
            job="job-a" if r % 3 else "job-b", rank=r, alive=r % 5 != 0, last_seen_age_s=0.1 * r,
            pid=100 + r if r % 4 else None, local_rank=r % 8, world_size=64 if r % 2 else None,
            mesh={"pp": r % 2, "dp": r // 2} if r % 7 else {}, dropped=r % 3,
            events={"checkpoint_saved": r, "exception": 1} if r % 2 else {},
            last_event=EventBody(name="finishing", time=5.0, fields={"step": r + 1, "why": ["done"]}) if r % 6 == 1
            else None,
            step=r if r % 9 else None, step_time=1.7e9 + r, step_seconds=0.5 + r / 100,
            phases={"forward_backward": 0.5, "optimizer": 0.1, "dp_reduce": 0.2, "a_later_phase": 1.0} if r % 8
            else {},
            loss=None if r % 10 == 3 else 2.0 + r, grad_norm=None if r % 10 == 3 else 1.0,
            nonfinite={"loss": "nan", "grad_norm": "inf"} if r % 10 == 3 else {},
            tokens_per_second=4e4 if r % 2 else None, mfu=0.4, dp_reduce_enter_ns=-5 if r == 2 else 10 ** 12 + r,
            dp_reduce_lag_s=0.01 if r % 3 else None, max_rss_mib=2e4, proc_state="T" if r == 5 else "S"))
    return HeartbeatBatch(schema=HEARTBEAT_SCHEMA, node=node, seq=first, sent_at=time.time(), ranks=entries,
                          gpus=[GpuEntry(gpu=0, uuid=f"GPU-{node}", xid_counts={"79": 1} if first else {})],
                          agent_url=f"http://{node}:9100")


def batches() -> list[HeartbeatBatch]:
    return [varied_batch(f"n{k}", 10 * k, 10) for k in range(4)] + [varied_batch("n-empty", 99, 0)]


def test_each_rank_entry_comes_back_from_its_row_as_the_node_sent_it() -> None:
    sent = batches()
    relayed = decode_relay_batch(encode_relay(columns_of("rack-1", 3, time.time(), [(0.5, b) for b in sent])))
    entries = [e for b in sent for e in b.ranks]
    assert len(relayed.rows) == len(entries) == 40
    for i, entry in enumerate(entries):
        assert relayed.rows.entry(i) == entry, i
    assert [(h.node, h.ranks, h.gpus, h.agent_url) for h in relayed.nodes] == [
        (b.node, len(b.ranks), b.gpus, b.agent_url) for b in sent]


def test_the_healer_holds_a_relayed_rank_as_it_holds_one_its_node_posted_itself() -> None:
    sent = batches()
    direct, relayed = HeartbeatTable(clock=lambda: 100.0), HeartbeatTable(clock=lambda: 100.0)
    for batch in sent:
        direct.ingest(batch)
    assert relayed.ingest_relayed(encode_relay(columns_of("rack-1", 1, 0.0, [(0.0, b) for b in sent]))) == (5, 40)

    mine, theirs = direct.columns(), relayed.columns()
    assert sorted(mine) == sorted(theirs) == ["job-a", "job-b"]
    for job, cols in mine.items():
        for name, column in cols.arrays.items():
            assert np.array_equal(column, theirs[job].arrays[name], equal_nan=True), (job, name)
        assert np.array_equal(cols.counts, theirs[job].counts)
    beats = {(b.job, b.rank): b for b in relayed.ranks()}
    for beat in direct.ranks():
        other = beats[(beat.job, beat.rank)]
        assert other.entry == beat.entry and other.node == beat.node and other.received_at == beat.received_at
        assert (other.pid, other.step, other.alive, other.last_seen_age_s) == (
            beat.entry.pid, beat.entry.step, beat.entry.alive, beat.entry.last_seen_age_s)
    nodes = {n.node: n for n in relayed.nodes()}
    for node in direct.nodes():
        other = nodes[node.node]
        assert (other.max_age_s, other.jobs, other.gpus, other.gpus_flagged, other.agent_url) == (
            node.max_age_s, node.jobs, node.gpus, node.gpus_flagged, node.agent_url)
        assert other.relay == "rack-1"


def test_a_relayed_batch_older_than_the_nodes_own_leaves_the_newer_one_in_place() -> None:
    table = HeartbeatTable(clock=lambda: 100.0)
    newer = varied_batch("n1", 0, 4)
    table.ingest(newer)
    older = HeartbeatBatch(schema=HEARTBEAT_SCHEMA, node="n1", seq=0, sent_at=0.0, ranks=[
        RankEntry(job="job-a", rank=1, alive=True, last_seen_age_s=0.0, step=1)])
    assert table.ingest_relayed(encode_relay(columns_of("rack-1", 1, 0.0, [(30.0, older)]))) == (1, 0)
    def by_rank(entries: list[RankEntry]) -> list[RankEntry]:
        return sorted(entries, key=lambda e: (e.job, e.rank))

    assert by_rank([b.entry for b in table.ranks()]) == by_rank(list(newer.ranks))
    assert table.columns()["job-a"].step.tolist() == [e.step for e in newer.ranks if e.job == "job-a"]


def _relayed(**change: object) -> bytes:
    """A relay batch of batches() with one part changed: `path__to__part=value`, where a column's part may be
    `rows__step__3` (one value of the column, as packed) or a whole column (`rows__step`, bytes or anything else)."""
    body = json.loads(encode_relay(columns_of("rack-1", 1, 0.0, [(0.0, b) for b in batches()])))
    for path, value in change.items():
        *parents, last = path.split("__")
        where = body
        for part in parents:
            where = where[int(part)] if isinstance(where, list) else where[part]
        if isinstance(where, str):  # one value of a packed column
            column = np.frombuffer(base64.b64decode(where), dtype="u1" if parents[-1] == "alive" else
                                   "<i8" if isinstance(value, int) else "<f8").copy()
            column[int(last)] = value
            value = base64.b64encode(column.tobytes()).decode()
            last = parents.pop()
            where = body
            for part in parents:
                where = where[int(part)] if isinstance(where, list) else where[part]
        elif isinstance(value, bytes):
            value = base64.b64encode(value).decode()
        where[int(last) if isinstance(where, list) else last] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(("change", "field", "reason"), [
    ({"rows__step": struct.pack("<2q", 1, 2)}, "rows.step", "has 16 bytes; the nodes' 40 ranks need 320"),
    ({"rows__phases__optimizer": b"\0" * 8}, "rows.phases.optimizer", "has 8 bytes; the nodes' 40 ranks need 320"),
    ({"nodes__0__ranks": 11}, "rows.job", "has 320 bytes; the nodes' 41 ranks need 328"),
    ({"rows__job__4": 7}, "rows.job[4]", "expected indices into rows.jobs, got 7"),
    ({"rows__step__3": -3}, "rows.step[3]", "expected integers >= 0 (or the missing value), got -3"),
    ({"rows__loss__0": math.inf}, "rows.loss[0]", "expected finite numbers (NaN: null), got inf"),
    ({"rows__last_seen_age_s__1": math.nan}, "rows.last_seen_age_s[1]", "expected finite numbers >= 0, got nan"),
    ({"rows__alive__2": 2}, "rows.alive[2]", "expected 0 or 1, got 2"),
    ({"rows__step": [1, 2]}, "rows.step", "expected the column's values, little-endian, in base64, got a list"),
    ({"rows__proc_state": "SS"}, "rows.proc_state", "has 2 states; the nodes have 40 ranks"),
    ({"rows__extras__0__row": 40}, "rows.extras[0].row", "40 is past the last row or listed twice"),
    ({"schema": 3}, "schema", "expected 1 or 2, got 3"),
])
def test_a_relay_batch_whose_columns_disagree_or_hold_a_bad_value_is_refused_naming_it_and_nothing_is_stored(
        change: dict[str, object], field: str, reason: str) -> None:
    with pytest.raises(SchemaError) as refused:
        decode_relay_batch(_relayed(**change))
    assert (refused.value.field, refused.value.reason) == (field, reason)
    table = HeartbeatTable()
    with pytest.raises(BadRequest) as exc:
        table.ingest_relayed(_relayed(**change))
    assert exc.value.field == field
    assert len(table) == 0 and table.nodes() == [] and table.columns() == {}


def test_a_value_no_column_can_hold_is_refused_to_its_node_when_it_comes() -> None:
    huge = varied_batch("n1", 0, 3)
    huge = msgspec.structs.replace(huge, ranks=[huge.ranks[0], msgspec.structs.replace(huge.ranks[1], step=2**64)])
    with pytest.raises(SchemaError) as refused:
        NodeColumns(huge)
    assert (refused.value.field, refused.value.reason) == ("ranks[1].step", f"{2**64} does not fit a 64-bit integer")


def test_the_checkpoints_a_program_said_it_saved_are_kept_by_job_whichever_hop_brought_them() -> None:
    def batch(node: str, first: int, seq: int, event: EventBody) -> HeartbeatBatch:
        entry = RankEntry(job="mine", rank=first, alive=True, last_seen_age_s=0.1, pid=100 + first, step=12,
                          last_event=event)
        return HeartbeatBatch(schema=HEARTBEAT_SCHEMA, node=node, seq=seq, sent_at=time.time(), ranks=[entry])

    saves = [EventBody(name="checkpoint_saved", time=1.0, fields={"step": s}) for s in (5, 10, 15)]
    # Not a save, or one without a whole step >= 0: not counted.
    noise = [EventBody(name="exception", time=1.0, fields={"step": 7}),
             EventBody(name="checkpoint_saved", time=1.0, fields={"step": "8"}),
             EventBody(name="checkpoint_saved", time=1.0, fields={"step": -1})]
    direct, relayed = HeartbeatTable(clock=lambda: 100.0), HeartbeatTable(clock=lambda: 100.0)
    sent = [batch("n1", 0, k, e) for k, e in enumerate([*saves, *noise])]
    for b in sent:
        direct.ingest(b)
        relayed.ingest_relayed(encode_relay(columns_of("rack-1", b.seq + 1, 0.0, [(0.0, b)])))
    assert direct.saved_steps("mine") == relayed.saved_steps("mine") == (5, 10, 15)
    direct.forget_saved_after("mine", 5)  # a rollback to step 5: the later saves are history
    assert direct.saved_steps("mine") == (5,) and direct.saved_steps("other") == ()
