"""The phase table: per rank, the median of each phase over its last samples, and the ratios the straggler
and collective-slowdown detectors reason with.

On CPU, the data-parallel collectives are timed inside themselves: the parameter all-gather that starts a
ZeRO-2 step (`dp_gather`) and the gradient reduce (`dp_reduce`), each the transfer plus the time a rank waits
there for the latest one. Their sum is the row's `dp_reduce_s`: its smallest value in a step is about the
transfer (what bandwidth costs), and the rest of each rank's is waiting. A rank that computes slowly (or
starts late) has the longest compute and the *shortest* collective time: everyone else waits for it.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

from msgspec import Struct

from healer.core.detectors.history import COMPUTE_PHASES, RankHistory, RankSeries, median

__all__ = ["COMPUTE_PHASES", "EVIDENCE_ROWS", "RankRow", "evidence_rows", "phase_table", "shared_phase_table"]

EVIDENCE_ROWS = 64
"""The most phase-table rows an incident's evidence holds (hang's per-rank list holds as many)."""


class RankRow(Struct, frozen=True, kw_only=True, gc=False):
    """One rank's medians over a window. NOTE: a struct, not a frozen dataclass: a table at 131,072 ranks makes that
    many, and a frozen dataclass sets each field through object.__setattr__ (~3x the cost)."""

    rank: int
    node: str
    samples: int
    step_s: float
    compute_s: float
    data_wait_s: float
    dp_reduce_s: float
    reduce_lag_s: float | None
    stage: int = 0

    def to_payload(self) -> dict[str, object]:
        return {"rank": self.rank, "node": self.node, "stage": self.stage, "samples": self.samples,
                "step_s": round(self.step_s, 4),
                "compute_s": round(self.compute_s, 4), "data_wait_s": round(self.data_wait_s, 4),
                "dp_reduce_s": round(self.dp_reduce_s, 4),
                "reduce_lag_s": round(self.reduce_lag_s, 4) if self.reduce_lag_s is not None else None}


def phase_table(series: list[RankSeries], window: int, since_step: int | None = None) -> list[RankRow]:
    """One row per rank with at least one timed sample among its last `window` (after `since_step`).
    NOTE: at 131,072 ranks a window's close reads ~650,000 samples: one pass over each rank's, reading the sums
    each sample already holds."""
    rows = []
    since = -1 if since_step is None else since_step
    for s in series:
        steps, computes, waits, reduces, lags = [], [], [], [], []
        for x in s.samples[-window:]:
            if x.step > since and x.step_seconds is not None and x.compute_s is not None:
                steps.append(x.step_seconds)
                computes.append(x.compute_s)
                waits.append(x.data_wait_s)
                reduces.append(x.dp_reduce_s)
                if x.dp_reduce_lag_s is not None:
                    lags.append(x.dp_reduce_lag_s)
        if steps:
            rows.append(RankRow(rank=s.rank, node=s.node, samples=len(steps), step_s=median(steps),
                                compute_s=median(computes), data_wait_s=median(waits), dp_reduce_s=median(reduces),
                                reduce_lag_s=median(lags) if lags else None, stage=s.stage))
    return rows


def shared_phase_table(history: RankHistory, job: str, series: list[RankSeries], window: int,
                       since_step: int | None) -> list[RankRow]:
    """phase_table, made once per cycle for the detectors that share `history`'s pool (straggler and
    collective_slowdown close their windows at the same steps: ~0.5 s each at 131,072 ranks)."""
    return history.memo(("phase_table", job, window, since_step), lambda: phase_table(series, window, since_step))


def evidence_rows(rows: list[RankRow], named: Collection[int] = (),
                  keep: int = EVIDENCE_ROWS) -> list[dict[str, object]]:
    """The phase table as an incident's evidence, by rank: every row of a job of up to `keep` ranks. Past that, the
    `named` ranks' rows and the ranks furthest from their stage's median compute or data-parallel reduce (each as a
    share of that median), `keep` in all: the rows on-call reads to see why, where the whole table of a
    131,072-rank job made one incident ~22 MB. The evidence's `ranks_in_table` says how many there were."""
    if len(rows) <= keep:
        return [r.to_payload() for r in rows]
    stages: dict[int, list[RankRow]] = {}
    for r in rows:
        stages.setdefault(r.stage, []).append(r)
    norm = {stage: (median([r.compute_s for r in group]) or 1.0, median([r.dp_reduce_s for r in group]) or 1.0)
            for stage, group in stages.items()}

    def unusual(r: RankRow) -> float:
        compute, reduce = norm[r.stage]
        return max(abs(r.compute_s - compute) / compute, abs(r.dp_reduce_s - reduce) / reduce)

    chosen = [r for r in rows if r.rank in named][:keep]
    taken = {r.rank for r in chosen}
    chosen += heapq.nlargest(keep - len(chosen), (r for r in rows if r.rank not in taken), key=unusual)
    return [r.to_payload() for r in sorted(chosen, key=lambda r: r.rank)]
