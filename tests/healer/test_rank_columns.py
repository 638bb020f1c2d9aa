"""The heartbeat table's columns (healer/observe/rank_columns.py), which the detectors compute over: each rank's latest
numbers and flags as its heartbeat carried them, and ranks the table forgets leaving them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from healer.observe.heartbeats import HeartbeatTable
from healer.observe.rank_columns import ALIVE, FINISHING, NONFINITE, STOPPED
from tests.healer.helpers import ManualClock, batch

pytestmark = pytest.mark.unit


def test_the_columns_hold_each_ranks_latest_numbers_and_flags_as_its_heartbeat_carried_them() -> None:
    clock = ManualClock()
    table = HeartbeatTable(clock=clock)
    body = batch("n1", [5, 2], age=0.5)
    first, second = body["ranks"]
    first.update(step=7, step_time=clock.now - 2.0, pid=4242, mesh={"pp": 3},
                 phases={"forward_backward": 0.3, "optimizer": 0.1, "data_wait": 0.02, "dp_reduce": 0.2,
                         "dp_gather": 0.05, "checkpoint": 1.5}, dp_reduce_lag_s=0.01,
                 last_event={"name": "finishing", "time": clock.now, "fields": {"step": 8}})
    second.update(step=None, step_seconds=None, phases={}, loss=None, nonfinite={"loss": "nan"}, proc_state="T")
    table.ingest(body)
    (cols,) = table.columns().values()
    slot = {int(r): i for i, r in enumerate(cols.rank)}
    a, b = slot[5], slot[2]
    assert cols.counts.tolist() == [True, True] and cols.node_names[cols.node[a]] == "n1"
    assert (cols.step[a], cols.pid[a], cols.stage[a], cols.step[b]) == (7, 4242, 3, -1)
    assert cols.heard_at[a] == clock.now - 0.5 and cols.step_time[a] == clock.now - 2.0
    assert math.isclose(cols.compute_s[a], 0.4) and cols.data_wait_s[a] == 0.02
    assert math.isclose(cols.dp_reduce_s[a], 0.25) and cols.checkpoint_s[a] == 1.5 and cols.dp_reduce_lag_s[a] == 0.01
    assert cols.flags[a] == ALIVE | FINISHING, "finishing after step 7 is the trainer's event for step 8"
    # No phases: no compute (NaN), nothing waited; no loss: NaN, and said which.
    assert np.isnan(cols.compute_s[b]) and cols.dp_reduce_s[b] == 0.0 and np.isnan(cols.loss[b])
    assert np.isnan(cols.step_seconds[b]) and cols.flags[b] == ALIVE | NONFINITE | STOPPED
    assert cols.beats[b].entry.nonfinite == {"loss": "nan"}, "what evidence needs stays in the RankBeat"
    # A later batch replaces the rank's numbers; the copy a cycle took does not change.
    first.update(step=8, last_event=None)
    table.ingest(body)
    now = table.columns()["job"]
    assert (now.step[a], now.flags[a], cols.step[a]) == (8, ALIVE, 7)


def test_ranks_the_table_forgets_leave_its_columns_and_a_job_heard_again_starts_afresh() -> None:
    clock = ManualClock()
    table = HeartbeatTable(clock=clock, forget_after_s=60)
    table.ingest(batch("n1", [0, 1], job="old"))
    table.ingest(batch("n2", [0, 1], job="both"))
    epoch = table.columns()["old"].epoch
    clock.now += 50
    table.ingest(batch("n3", [2, 3], job="both"))
    clock.now += 20
    assert table.forget_old() == 4
    columns = table.columns()
    assert sorted(columns) == ["both"], "a job with no rank left loses its columns"
    both = columns["both"]
    assert sorted(int(r) for r in both.rank[both.counts]) == [2, 3] and both.beats[0] is None
    table.ingest(batch("n1", [0, 1], job="old"))
    assert table.columns()["old"].epoch != epoch, "its ranks numbered afresh: whoever kept state by slot starts again"


def test_the_node_times_are_each_nodes_batch_time_and_oldest_record_age_in_the_tables_order_after_forgetting_too(
) -> None:
    clock = ManualClock()
    table = HeartbeatTable(clock=clock, forget_after_s=60)

    def times() -> list[tuple[float, float]]:
        received, max_age = table.node_times()
        return list(zip(received.tolist(), max_age.tolist()))

    def beats() -> list[tuple[float, float]]:
        return [(n.received_at, n.max_age_s) for n in table.nodes()]

    for i, node in enumerate(["n1", "n2", "n3", "n4"]):
        body = batch(node, [2 * i, 2 * i + 1], job="j")
        body["ranks"][1]["last_seen_age_s"] = 0.5 + i  # the oldest record of the node's batch
        table.ingest(body)
        clock.now += 10
    assert times() == beats() and [age for _, age in times()] == [0.5, 1.5, 2.5, 3.5]
    table.ingest(batch("n1", [0, 1], job="j"))  # a later batch keeps the node's place
    clock.now += 45  # n2 and n3 are past 60 s
    assert table.forget_old() == 4
    assert [n.node for n in table.nodes()] == ["n1", "n4"] and times() == beats()
    table.ingest(batch("n5", [9], job="j"))
    assert [n.node for n in table.nodes()] == ["n1", "n4", "n5"] and times() == beats()
