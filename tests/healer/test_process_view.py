"""ProcessView: what the node agents' reports of an attempt leave in the healer's view of its processes. Each
node's report replaces that node's part only (the view keeps an index per node rather than scanning every rank
on every report), and the job's pids are the union over its nodes."""

from __future__ import annotations

import pytest

from healer.observe.heartbeats import HeartbeatTable
from healer.observe.jobview import TickView
from healer.observe.processes import ProcessState, ProcessView
from wire.telemetry import AttemptReport, RankProcess

pytestmark = pytest.mark.unit


def report(attempt: int, node_rank: int, ranks: list[tuple[int, int, str]], job: str = "j") -> AttemptReport:
    """(rank, pid, state) of each rank running on the node."""
    return AttemptReport(job=job, attempt=attempt, node_rank=node_rank, ranks=[
        RankProcess(rank=r, local_rank=i, pid=pid, started=1.0, state=state, cpu_seconds=0.5)
        for i, (r, pid, state) in enumerate(ranks)])


def states(view: ProcessView) -> dict[int, tuple[str, str, int]]:
    return {s.rank: (s.node, s.state, s.pid) for s in view.states()}


def test_a_nodes_report_replaces_its_own_ranks_states_and_no_other_nodes() -> None:
    view = ProcessView()
    view.started("j", 1, ("a", "b"))
    view.report("a", report(1, 0, [(0, 100, "R"), (1, 101, "R")]), now=10.0)
    view.report("b", report(1, 1, [(2, 200, "R"), (3, 201, "R")]), now=10.0)
    view.report("a", report(1, 0, [(0, 100, "T")]), now=11.0)  # rank 1 gone from a's report
    assert states(view) == {0: ("a", "T", 100), 2: ("b", "R", 200), 3: ("b", "R", 201)}
    assert view.pids("j") == {100, 200, 201}
    assert sorted(view.reported_ranks("j")) == [("a", 100, 0, 0, 1.0), ("b", 200, 2, 0, 1.0), ("b", 201, 3, 1, 1.0)]


def test_a_rank_that_moved_to_another_node_keeps_its_new_state_when_the_old_node_reports_again() -> None:
    view = ProcessView()
    view.started("j", 1)
    view.report("a", report(1, 0, [(0, 100, "R")]), now=10.0)
    view.report("b", report(1, 1, [(0, 300, "S")]), now=11.0)  # rank 0 now runs on b
    view.report("a", report(1, 0, []), now=12.0)  # a reports nothing: b's state of rank 0 stays
    assert states(view) == {0: ("b", "S", 300)}
    assert view.pids("j") == {300}


def test_states_the_local_supervisor_set_are_replaced_by_that_nodes_report() -> None:
    view = ProcessView()
    view.started("j", 1)
    view.update_states([ProcessState(job="j", attempt=1, node="a", rank=5, pid=55, state="R", cpu_seconds=1.0,
                                     sampled_at=9.0)])
    view.report("a", report(1, 0, [(6, 66, "R")]), now=10.0)
    assert states(view) == {6: ("a", "R", 66)}


def test_a_new_attempt_starts_with_no_reported_pids_and_the_launchers_found_pids_win_until_the_next_report() -> None:
    view = ProcessView()
    view.started("j", 1)
    view.report("a", report(1, 0, [(0, 100, "R")]), now=10.0)
    view.found("j", frozenset({7}))
    assert view.pids("j") == {7}
    view.report("a", report(1, 0, [(0, 101, "R")]), now=11.0)
    assert view.pids("j") == {101}
    view.started("j", 2)
    assert view.pids("j") == frozenset() and view.reported_ranks("j") == []
    view.report("a", report(1, 0, [(0, 101, "R")]), now=12.0)  # a late report of attempt 1: left out
    assert view.pids("j") == frozenset()


def test_the_tick_view_counts_every_heartbeat_without_a_launcher_and_only_the_attempts_pids_with_one() -> None:
    from wire.telemetry import HEARTBEAT_SCHEMA, HeartbeatBatch, RankEntry

    def batch(node: str, job: str, pids: list[int]) -> HeartbeatBatch:
        # NOTE: a lower pid's record is older: a node's oldest record changes when the view leaves pids out
        return HeartbeatBatch(schema=HEARTBEAT_SCHEMA, node=node, seq=1, sent_at=1.0, ranks=[
            RankEntry(job=job, rank=i, pid=pid, local_rank=i, world_size=len(pids), alive=True,
                      last_seen_age_s=0.1 + len(pids) - i) for i, pid in enumerate(pids)])

    def times(view: TickView) -> list[tuple[float, float]]:
        received, max_age = view.node_times()
        return list(zip(received.tolist(), max_age.tolist()))

    table = HeartbeatTable(clock=lambda: 100.0)
    table.ingest(batch("a", "j", [100, 101]))
    table.ingest(batch("b", "other", [200]))
    plain = TickView.of(table)
    assert len(plain.ranks()) == 3 and [len(n.ranks) for n in plain.nodes()] == [2, 1]
    table.processes.started("j", 1)
    table.processes.found("j", frozenset({101}))
    launched = TickView.of(table)
    assert sorted((b.job, b.entry.pid) for b in launched.ranks()) == [("j", 101), ("other", 200)]
    a, b = launched.nodes()
    assert [r.entry.pid for r in a.ranks] == [101] and b is table.nodes()[1]
    # The view's node times follow its nodes: node a's oldest record is now pid 101's, pid 100's left out.
    assert times(launched) == [(100.0, 1.1), (100.0, 1.1)] and times(plain) == [(100.0, 2.1), (100.0, 1.1)]
    table.processes.stopping("j")
    assert [b.job for b in TickView.of(table).ranks()] == ["other"]


@pytest.mark.parametrize("relayed", [False, True])
def test_a_warm_workers_step_of_an_earlier_attempt_does_not_count_in_the_next_though_its_pid_does(
        relayed: bool) -> None:
    # A warm restart keeps the processes: pid 100 finished a step of attempt 1 (NaN weights the rollback is throwing
    # away) after attempt 2 was planned. Only its step of attempt 2 counts; a step that says no attempt counts by pid.
    from wire.relay import columns_of, encode_relay
    from wire.telemetry import HEARTBEAT_SCHEMA, HeartbeatBatch, RankEntry

    def beat(seq: int, attempts: list[int | None]) -> HeartbeatBatch:
        return HeartbeatBatch(schema=HEARTBEAT_SCHEMA, node="a", seq=seq, sent_at=1.0, ranks=[
            RankEntry(job="j", rank=i, pid=100 + i, alive=True, last_seen_age_s=0.1, step=17, attempt=attempt)
            for i, attempt in enumerate(attempts)])

    table = HeartbeatTable(clock=lambda: 100.0)

    def send(batch: HeartbeatBatch) -> None:
        if relayed:
            table.ingest_relayed(encode_relay(columns_of("rack-1", batch.seq, 0.0, [(0.0, batch)])))
        else:
            table.ingest(batch)

    table.processes.started("j", 2)
    table.processes.found("j", frozenset({100, 101, 102}))
    send(beat(1, [1, 2, None]))
    view = TickView.of(table)
    assert sorted(b.rank for b in view.ranks()) == [1, 2]
    assert view.columns()["j"].counts.tolist() == [False, True, True]
    send(beat(2, [2, 2, None]))  # its first step of attempt 2
    assert sorted(b.rank for b in TickView.of(table).ranks()) == [0, 1, 2]
