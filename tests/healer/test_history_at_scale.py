"""What the detectors' shared history does so that one healer can watch 131,072 ranks: the phase table is the
per-rank median of each phase (checked against a plain median), made once per cycle for every detector that asks;
the history keeps only what the garbage collector need not walk; a rollback keeps the samples before it; an
incident's evidence holds the table's most unusual rows, not every rank's."""

from __future__ import annotations

import gc
import json
import statistics

from healer.core.detectors.collective_slowdown import CollectiveSlowdown
from healer.core.detectors.history import HistoryPool, RankHistory, RankSeries, Sample
from healer.core.detectors.phases import EVIDENCE_ROWS, RankRow, evidence_rows, phase_table
from healer.core.detectors.straggler import Straggler
from healer.core.heartbeats import HeartbeatTable
from healer.core.jobview import TickView
from tests.healer.helpers import ManualClock, batch
from tests.selfheal.streams import JobStream


def _sample(step: int, step_s: float | None, compute: float | None, lag: float | None = None) -> Sample:
    return Sample(step, 0.0, "n1", step_s, compute, compute / 10 if compute else 0.0,
                  compute / 4 if compute else 0.0, 0.0, 1.0, 1.0, {}, lag)


def test_the_phase_table_is_each_ranks_median_over_its_window_after_the_step_given() -> None:
    series = [
        # 6 samples: the window of 4 takes steps 3..6, since_step=3 leaves 4..6
        RankSeries("j", 0, "n1", tuple(_sample(s, 1.0 + s, 0.5 * s, lag=0.1 * s) for s in range(1, 7))),
        # one sample without phases and one without a step time: neither counts; no lag at all
        RankSeries("j", 1, "n1", (_sample(4, 2.0, None), _sample(5, None, 1.0), _sample(6, 3.0, 2.0))),
        # nothing after step 3: no row
        RankSeries("j", 2, "n2", (_sample(2, 1.0, 1.0), _sample(3, 1.0, 1.0))),
        # lags on some samples only: the median of those
        RankSeries("j", 3, "n2", (_sample(4, 1.0, 1.0, lag=0.3), _sample(5, 2.0, 3.0), _sample(6, 4.0, 5.0, lag=0.5))),
    ]
    rows = {r.rank: r for r in phase_table(series, window=4, since_step=3)}
    assert sorted(rows) == [0, 1, 3]
    assert (rows[0].samples, rows[0].step_s, rows[0].compute_s) == (3, statistics.median([5.0, 6.0, 7.0]), 2.5)
    assert rows[0].reduce_lag_s == statistics.median([0.4, 0.5, 0.6])
    assert rows[0].data_wait_s == statistics.median([0.2, 0.25, 0.3])
    assert rows[0].dp_reduce_s == statistics.median([0.5, 0.625, 0.75])
    assert (rows[1].samples, rows[1].step_s, rows[1].compute_s, rows[1].reduce_lag_s) == (1, 3.0, 2.0, None)
    assert (rows[3].samples, rows[3].step_s, rows[3].compute_s, rows[3].reduce_lag_s) == (3, 2.0, 3.0, 0.4)
    assert rows[3].node == "n2" and phase_table(series, window=4, since_step=6) == []


def _ingest(table: HeartbeatTable, step: int, ranks: int = 8) -> None:
    for node in range(ranks // 4):
        body = batch(f"n{node}", list(range(4 * node, 4 * node + 4)), job="j")
        for r in body["ranks"]:
            r.update(step=step, step_seconds=1.0, phases={"forward_backward": 0.6, "optimizer": 0.1,
                                                          "data_wait": 0.01, "dp_reduce": 0.2, "dp_gather": 0.05})
        table.ingest(json.dumps(body).encode())


def test_straggler_and_collective_slowdown_share_one_phase_table_per_cycle(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    made = []
    import healer.core.detectors.phases as phases

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


def test_the_history_holds_nothing_the_garbage_collector_walks_and_a_rollback_keeps_the_steps_before_it() -> None:
    history = RankHistory(keep=4)
    table = HeartbeatTable()
    for step in range(1, 7):
        _ingest(table, step)
        history.update(table, 0.0)
    gc.collect()  # a tuple is untracked once a collection saw that nothing it holds is tracked
    series = history.jobs()["j"]
    assert [s.rank for s in series] == list(range(8)) and history.low_step("j") == 6
    assert not any(gc.is_tracked(s) or gc.is_tracked(s.samples) or any(gc.is_tracked(x) for x in s.samples)
                   for s in series)
    assert [x.step for x in series[0].samples] == [3, 4, 5, 6]  # the newest `keep`
    assert series[0].samples[-1].compute_s == 0.7 and series[0].samples[-1].dp_reduce_s == 0.25
    _ingest(table, 4)  # rolled back to step 4: 5 and 6 will be done again
    new = history.update(table, 0.0)
    assert len(new) == 8 and [x.step for x in series[0].samples] == [3, 4]
    assert history.low_step("j") == 4


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


def test_a_small_jobs_evidence_keeps_every_row() -> None:
    rows = [RankRow(rank=r, node="n1", samples=5, step_s=1.0, compute_s=0.9 if r == 4 else 0.5 + r / 1000,
                    data_wait_s=0.0, dp_reduce_s=0.3 if r == 7 else 0.1, reduce_lag_s=None) for r in range(10)]
    assert [r["rank"] for r in evidence_rows(rows)] == list(range(10))
    # Past `keep`: the named rank, then the furthest from their stage's median compute or reduce, by rank.
    assert [r["rank"] for r in evidence_rows(rows, named=(0,), keep=3)] == [0, 4, 7]
