"""What the detectors' shared history does so that one healer can watch 131,072 ranks: the phase table is the
per-rank median of each phase (checked against a plain median), made once per cycle for every detector that asks;
the history is arrays, with no object per rank or sample; a rollback keeps the samples before it; an incident's
evidence holds the table's most unusual rows, not every rank's."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
from typing import Any

import numpy as np
import pytest

from healer.detect.collective_slowdown import CollectiveSlowdown
from healer.detect.phases import EVIDENCE_ROWS, PhaseTable, evidence_rows, masked_median, phase_table
from healer.detect.straggler import Straggler, _median_without_top
from healer.observe.heartbeats import HeartbeatTable
from healer.observe.history import HistoryPool, RankHistory
from healer.observe.jobview import TickView
from tests.healer.helpers import ManualClock, batch
from tests.selfheal.streams import JobStream

pytestmark = pytest.mark.unit


def _entry(rank: int, step: int, step_s: float | None, compute: float | None,
           lag: float | None = None) -> dict[str, Any]:
    """A heartbeat batch of one rank at `step`: compute as its forward/backward (None: no phases at all), a tenth of
    it waiting for data and a quarter in the reduce."""
    body = batch("n1" if rank < 2 else "n2", [rank], job="j")
    phases = {} if compute is None else {"forward_backward": compute, "data_wait": compute / 10,
                                         "dp_reduce": compute / 4}
    body["ranks"][0].update(step=step, step_seconds=step_s, phases=phases, dp_reduce_lag_s=lag)
    return body


def test_the_phase_table_is_each_ranks_median_over_its_window_after_the_step_given() -> None:
    steps = {
        # 6 samples: the window of 4 takes steps 3..6, since_step=3 leaves 4..6
        0: [(s, 1.0 + s, 0.5 * s, 0.1 * s) for s in range(1, 7)],
        # one sample without phases and one without a step time: neither counts; no lag at all
        1: [(4, 2.0, None, None), (5, None, 1.0, None), (6, 3.0, 2.0, None)],
        # nothing after step 3: no row
        2: [(2, 1.0, 1.0, None), (3, 1.0, 1.0, None)],
        # lags on some samples only: the median of those
        3: [(4, 1.0, 1.0, 0.3), (5, 2.0, 3.0, None), (6, 4.0, 5.0, 0.5)],
    }
    table, history = HeartbeatTable(), RankHistory(keep=6)
    for step in range(1, 7):
        for rank, samples in steps.items():
            for at, step_s, compute, lag in samples:
                if at == step:
                    table.ingest(json.dumps(_entry(rank, at, step_s, compute, lag)).encode())
        history.update(table, 0.0)
    t = phase_table(history.jobs()["j"], window=4, since_step=3)
    rows = {r.rank: r for r in t.rows()}
    assert sorted(rows) == [0, 1, 3]
    assert (rows[0].samples, rows[0].step_s, rows[0].compute_s) == (3, statistics.median([5.0, 6.0, 7.0]), 2.5)
    assert rows[0].reduce_lag_s == statistics.median([0.4, 0.5, 0.6])
    assert rows[0].data_wait_s == statistics.median([0.2, 0.25, 0.3])
    assert rows[0].dp_reduce_s == statistics.median([0.5, 0.625, 0.75])
    assert (rows[1].samples, rows[1].step_s, rows[1].compute_s, rows[1].reduce_lag_s) == (1, 3.0, 2.0, None)
    assert (rows[3].samples, rows[3].step_s, rows[3].compute_s, rows[3].reduce_lag_s) == (3, 2.0, 3.0, 0.4)
    assert rows[3].node == "n2" and len(phase_table(history.jobs()["j"], window=4, since_step=6)) == 0
    # The window counts each rank's own newest samples: 2 of rank 0's are steps 5 and 6.
    assert {r.rank: r.samples for r in phase_table(history.jobs()["j"], window=2).rows()} == {0: 2, 1: 1, 2: 2, 3: 2}


def _ingest(table: HeartbeatTable, step: int, ranks: int = 8) -> None:
    for node in range(ranks // 4):
        body = batch(f"n{node}", list(range(4 * node, 4 * node + 4)), job="j")
        for r in body["ranks"]:
            r.update(step=step, step_seconds=1.0, phases={"forward_backward": 0.6, "optimizer": 0.1,
                                                          "data_wait": 0.01, "dp_reduce": 0.2, "dp_gather": 0.05})
        table.ingest(json.dumps(body).encode())


def test_straggler_and_collective_slowdown_share_one_phase_table_per_cycle(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    made = []
    import healer.detect.phases as phases

    real = phases.phase_table
    monkeypatch.setattr(phases, "phase_table", lambda *a, **k: made.append(a[1:]) or real(*a, **k))
    detectors = [Straggler(Straggler.Config()), CollectiveSlowdown(CollectiveSlowdown.Config())]
    pool = HistoryPool.for_detectors(detectors)
    table = HeartbeatTable()
    for step in range(1, 13):
        _ingest(table, step)
        view = TickView.of(table, pool)
        for d in detectors:
            d.evaluate(view, 0.0)
    # Both close a window at steps 6 and 11 (5 steps each after the first seen): one table each time, not two.
    assert made == [(10, 1), (10, 6)]
    alone = [Straggler(Straggler.Config()), CollectiveSlowdown(CollectiveSlowdown.Config())]
    made.clear()
    table = HeartbeatTable()
    for step in range(1, 13):
        _ingest(table, step)
        for d in alone:
            d.evaluate(table, 0.0)
    assert made == [(10, 1), (10, 1), (10, 6), (10, 6)]  # without a pool each makes its own


def test_the_history_is_arrays_with_no_object_per_rank_and_a_rollback_keeps_the_steps_before_it() -> None:
    history = RankHistory(keep=4)
    table = HeartbeatTable()
    for step in range(1, 7):
        _ingest(table, step)
        history.update(table, 0.0)
    held = history.jobs()["j"]
    slots = held.known()
    assert held.rank[slots].tolist() == list(range(8)) and history.low_step("j") == 6
    assert [x["step"] for x in held.samples_of(int(slots[0]))] == [3, 4, 5, 6]  # the newest `keep`
    assert held.newest("compute_s", slots).tolist() == [0.7] * 8 and held.newest("dp_reduce_s", slots)[0] == 0.25
    _ingest(table, 4)  # rolled back to step 4: 5 and 6 will be done again
    new = history.update(table, 0.0)
    assert len(new["j"]) == 8 and [x["step"] for x in held.samples_of(int(slots[0]))] == [3, 4]
    assert history.low_step("j") == 4
    # 4,000 more ranks add no object the garbage collector tracks per rank or per sample (the table's RankBeats
    # are its own: gc=False structs).
    gc.collect()
    before = len(gc.get_objects())
    _ingest(table, 5, ranks=4000)
    history.update(table, 0.0)
    gc.collect()
    assert len(gc.get_objects()) - before < 200 and len(history.jobs()["j"].known()) == 4000
    # One row per ring position in each of the job's ring arrays, a column per rank.
    assert held.steps.shape == (4, 4000) and {v.shape for v in held.ring.values()} == {(4, 4000)}


def test_ranks_out_of_step_keep_each_their_own_newest_samples_in_order() -> None:
    # Each cycle a different part of the ranks reports a new step (a batch late, a node that skipped one), so their
    # ring positions part: most samples go in the row most ranks are at, the others one by one. Every rank's
    # history is still its own newest `keep` steps, oldest first, with each step's own numbers.
    rng = np.random.default_rng(11)
    history, table, keep, ranks = RankHistory(keep=4), HeartbeatTable(), 4, 12
    step = [0] * ranks
    reported: dict[int, list[int]] = {r: [] for r in range(ranks)}
    for _ in range(15):
        for node in range(ranks // 4):
            body = batch(f"n{node}", list(range(4 * node, 4 * node + 4)), job="j")
            for r in body["ranks"]:
                rank = r["rank"]
                if rng.random() < 0.7:
                    step[rank] += 1
                    reported[rank].append(step[rank])
                r.update(step=step[rank], step_seconds=float(step[rank]), phases={"forward_backward": rank / 10})
            table.ingest(json.dumps(body).encode())
        history.update(table, 0.0)
    held = history.jobs()["j"]
    slots = held.known()
    for slot in slots.tolist():
        rank = int(held.rank[slot])
        want = [s for s in reported[rank] if s > 0][-keep:]
        got = held.samples_of(slot)
        assert [x["step"] for x in got] == want, rank
        assert [x["step_seconds"] for x in got] == [float(s) for s in want] and {x["compute_s"] for x in got} <= {rank / 10}
    assert len({int(p) for p in held.pos[slots]}) > 1  # they did part


def test_ranks_a_job_reports_over_several_cycles_join_the_ring_position_of_those_heard_first() -> None:
    # A large job's ranks reach the healer over its first cycles (its relays' batches come over a second or two).
    # Those heard later start where the others are, so that from then on all step together in one row of the ring.
    history, table = RankHistory(keep=4), HeartbeatTable()
    _ingest(table, 1, ranks=4)
    history.update(table, 0.0)
    for step in (2, 3, 4, 5):
        _ingest(table, step, ranks=8 if step == 2 else 12)
        history.update(table, 0.0)
    held = history.jobs()["j"]
    slots = held.known()
    assert held.rank[slots].tolist() == list(range(12)) and {int(p) for p in held.pos[slots]} == {1}
    assert [[x["step"] for x in held.samples_of(int(s))] for s in slots[[0, 4, 8]]] == [[2, 3, 4, 5], [2, 3, 4, 5],
                                                                                         [3, 4, 5]]


def test_a_large_jobs_straggler_evidence_is_its_most_unusual_rows_with_the_suspect_not_the_whole_table() -> None:

    clock = ManualClock()
    nodes = {f"n{n}": list(range(8 * n, 8 * n + 8)) for n in range(32)}  # 256 ranks
    # Rank 201 computes slowly from step 10; rank 17 reaches the reduce a little late (no straggler: too little).
    s = JobStream(table=HeartbeatTable(clock=clock), clock=clock, nodes=nodes, late={17: 0.02},
                  shape=lambda rank, step: {"forward_backward": 0.4} if rank == 201 and step > 10 else {})
    detector = Straggler(Straggler.Config(window=5, consecutive=3))
    firing = ()
    for _ in range(40):
        s.advance()
        firing = detector.evaluate(s.table, s.clock.now).firing
    (f,) = firing
    rows = f.evidence["phase_table"]
    assert f.evidence["suspect_rank"] == 201 and f.evidence["ranks_in_table"] == 256
    assert len(rows) == EVIDENCE_ROWS and [r["rank"] for r in rows] == sorted(r["rank"] for r in rows)
    assert {201, 17} <= {r["rank"] for r in rows}, "the suspect, and the one other rank out of the ordinary"
    assert len(json.dumps(f.evidence)) < 20_000
    # The same rows every cycle while it fires (made once per window).
    assert detector.evaluate(s.table, s.clock.now).firing[0].evidence["phase_table"] is rows


def _table(compute: list[float], reduce: list[float]) -> PhaseTable:
    n = len(compute)
    return PhaseTable(rank=np.arange(n), node=np.zeros(n, dtype=np.int64), node_names=["n1"],
                      stage=np.zeros(n, dtype=np.int64), samples=np.full(n, 5), step_s=np.ones(n),
                      compute_s=np.array(compute), data_wait_s=np.zeros(n), dp_reduce_s=np.array(reduce),
                      reduce_lag_s=np.full(n, np.nan))


def test_a_small_jobs_evidence_keeps_every_row() -> None:
    rows = _table([0.9 if r == 4 else 0.5 + r / 1000 for r in range(10)], [0.3 if r == 7 else 0.1 for r in range(10)])
    assert [r["rank"] for r in evidence_rows(rows)] == list(range(10))
    # Past `keep`: the named rank, then the furthest from their stage's median compute or reduce, by rank.
    assert [r["rank"] for r in evidence_rows(rows, named=(0,), keep=3)] == [0, 4, 7]


def test_the_masked_median_is_statistics_median_of_each_rows_valid_samples_for_any_window() -> None:
    rng = np.random.default_rng(7)
    for samples in range(0, 19):  # the sorting network is made per width: none, odd, even, powers of two and past
        values = rng.normal(size=(40, samples)).round(2)  # ties too
        valid = rng.random((40, samples)) < 0.6
        medians, counts = masked_median(values.T.copy(), valid.T)
        for row in range(40):
            kept = values[row][valid[row]].tolist()
            assert counts[row] == len(kept)
            if kept:
                assert medians[row] == statistics.median(kept), (samples, row)
            else:
                assert np.isnan(medians[row]), (samples, row)


def test_the_median_without_the_top_value_is_that_of_the_others() -> None:
    rng = np.random.default_rng(5)
    for n in range(2, 24):
        for _ in range(20):
            values = rng.integers(0, 4, n).astype(float)  # ties of the top too
            others = np.delete(values, int(np.argmax(values))).tolist()
            assert _median_without_top(values) == statistics.median(others), values


def test_a_tables_stages_are_its_rows_by_stage_in_the_order_their_first_row_comes() -> None:
    for stage in ([2, 0, 2, 1, 0], [7000, 3, 7000], [5]):  # few small stages, then numbers too far apart to count
        t = dataclasses.replace(_table([0.5] * len(stage), [0.1] * len(stage)), stage=np.array(stage))
        want = {}
        for i, s in enumerate(stage):
            want.setdefault(s, []).append(i)
        assert [g.tolist() for g in t.stages()] == list(want.values())
