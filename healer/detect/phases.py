"""The phase table: per rank, the median of each phase over its last samples, and the ratios the straggler
and collective-slowdown detectors reason with.

On CPU, the data-parallel collectives are timed inside themselves: the parameter all-gather that starts a
ZeRO-2 step (`dp_gather`) and the gradient reduce (`dp_reduce`), each the transfer plus the time a rank waits
there for the latest one. Their sum is the row's `dp_reduce_s`: its smallest value in a step is about the
transfer (what bandwidth costs), and the rest of each rank's is waiting. A rank that computes slowly (or
starts late) has the longest compute and the *shortest* collective time: everyone else waits for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

# NOTE: loaded with the detectors, not by the first np.median (its NaN check imports numpy.ma): ~34 ms that fell
# in every healer's first window close, its slowest detection cycle at 131,072 ranks (bench/healer_ingest.py).
import numpy.ma
from msgspec import Struct

from healer.observe.history import COMPUTE_PHASES, JobSamples, RankHistory

__all__ = ["COMPUTE_PHASES", "EVIDENCE_ROWS", "PhaseTable", "RankRow", "closed_windows", "evidence_rows",
           "masked_median", "phase_table", "shared_phase_table"]

EVIDENCE_ROWS = 64
"""The most phase-table rows an incident's evidence holds (hang's per-rank list holds as many)."""


class RankRow(Struct, frozen=True, kw_only=True, gc=False):
    """One rank's medians over a window: a row of a PhaseTable, as an incident's evidence shows it."""

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


@dataclass(frozen=True, slots=True)
class PhaseTable:
    """Per rank (by rank), its medians over a window, as columns: what the straggler and collective-slowdown
    detectors reason with. reduce_lag_s is NaN for a rank that reported no lag in the window."""

    rank: np.ndarray
    node: np.ndarray
    """Indices into node_names."""
    node_names: list[str]
    stage: np.ndarray
    samples: np.ndarray
    step_s: np.ndarray
    compute_s: np.ndarray
    data_wait_s: np.ndarray
    dp_reduce_s: np.ndarray
    reduce_lag_s: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)

    def row(self, i: int) -> RankRow:
        lag = float(self.reduce_lag_s[i])
        return RankRow(rank=int(self.rank[i]), node=self.node_names[int(self.node[i])], samples=int(self.samples[i]),
                       step_s=float(self.step_s[i]), compute_s=float(self.compute_s[i]),
                       data_wait_s=float(self.data_wait_s[i]), dp_reduce_s=float(self.dp_reduce_s[i]),
                       reduce_lag_s=None if np.isnan(lag) else lag, stage=int(self.stage[i]))

    def rows(self, which: Collection[int] | np.ndarray | None = None) -> list[RankRow]:
        """Rows as objects: those at the indices `which` (all when None; a pass in Python, for small tables)."""
        return [self.row(int(i)) for i in (range(len(self)) if which is None else which)]

    def index_of(self, rank: int) -> int | None:
        found = np.flatnonzero(self.rank == rank)
        return int(found[0]) if found.size else None

    def stages(self) -> list[np.ndarray]:
        """The row indices of each pipeline stage, the stages in the order their first row comes."""
        stage = self.stage
        if not len(stage):
            return []
        low, high = int(stage.min()), int(stage.max())
        if high - low < 4096:
            # NOTE: pipeline stages are a few small numbers: counted, not sorted (np.unique sorts all 131,072 rows)
            values = np.flatnonzero(np.bincount(stage - low)) + low
        else:
            values = np.unique(stage)
        groups = [np.flatnonzero(stage == v) for v in values.tolist()]
        return sorted(groups, key=lambda rows: int(rows[0]))


def masked_median(columns: np.ndarray, valid: np.ndarray, invalid: np.ndarray | None = None,
                  n: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per column of `columns` (samples x ranks: one row per sample, one column per rank), the median of the
    entries `valid` marks (the mean of the two middle ones for an even count, as statistics.median), and how many
    there were (NaN where none). `columns` is a copy the caller gives up (it is overwritten); `invalid` (~valid)
    and `n` (valid's count per column) are for a caller that has them. The valid entries are finite (the wire
    refuses anything else).

    NOTE: sorted by a sorting network over whole rows, not rank by rank: numpy sorts each of 131,072 ranks' few
    samples on its own (~40 ms a median), where the network's dozen or so minimum/maximum passes take a few."""
    np.copyto(columns, np.inf, where=~valid if invalid is None else invalid)  # NOTE: +inf sorts last
    n = valid.sum(axis=0) if n is None else n
    if not columns.shape[0]:
        return np.full(columns.shape[1], np.nan), n
    # NOTE: each compare-and-swap is two passes, the minimum into a spare row that then takes the low one's place
    # (rows by reference), not three (a minimum, a maximum and a copy back).
    rows, spare = list(columns), np.empty(columns.shape[1], dtype=columns.dtype)
    for a, b in _comparators(len(rows)):
        np.minimum(rows[a], rows[b], out=spare)
        np.maximum(rows[a], rows[b], out=rows[b])
        rows[a], spare = spare, rows[a]
    # NOTE: each rank's two middle entries taken row by row (stacking the rows back for a fancy index is a copy)
    low, high = np.maximum((n - 1) // 2, 0), n // 2
    lower, upper = np.empty(columns.shape[1], dtype=columns.dtype), np.empty(columns.shape[1], dtype=columns.dtype)
    for k, row in enumerate(rows):
        np.copyto(lower, row, where=low == k)
        np.copyto(upper, row, where=high == k)
    med = (lower + upper) / 2
    return np.where(n > 0, med, np.nan), n


@functools.cache
def _comparators(size: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort network for `size` inputs: the (low, high) pairs to compare and swap, in order.
    Made for the next power of two; a pair that reaches past `size` is left out (as if that input were +inf there,
    which would never move)."""
    width = 1
    while width < size:
        width *= 2
    pairs = []
    merged = 1
    while merged < width:
        k = merged
        while k >= 1:
            for j in range(k % merged, width - k, 2 * k):
                for i in range(min(k, width - j - k)):
                    if (i + j) // (2 * merged) == (i + j + k) // (2 * merged):
                        pairs.append((i + j, i + j + k))
            k //= 2
        merged *= 2
    return tuple((a, b) for a, b in pairs if b < size)


def phase_table(samples: JobSamples, window: int, since_step: int | None = None) -> PhaseTable:
    """One row per rank with at least one timed sample among its last `window` (after `since_step`).
    NOTE: at 131,072 ranks a window's close reads ~650,000 samples: gathered by age (JobSamples.newest_first) and
    sorted side by side, a few rows of 131,072 (~5 at a window of 5 steps), not 131,072 rows of `window`."""
    slots = samples.known()
    flat, valid = samples.newest_first(window, slots, -1 if since_step is None else since_step)
    ring = samples.ring
    step_s, compute = np.take(ring["step_seconds"], flat), np.take(ring["compute_s"], flat)
    valid &= ~np.isnan(step_s) & ~np.isnan(compute)
    kept = valid.any(axis=0)
    if not kept.all():
        flat, valid, slots, step_s, compute = flat[:, kept], valid[:, kept], slots[kept], step_s[:, kept], \
            compute[:, kept]
    invalid = ~valid
    step_med, n = masked_median(step_s, valid, invalid)
    # NOTE: the same samples count for each phase: their count and mask are made once
    lags = np.take(ring["dp_reduce_lag_s"], flat)
    return PhaseTable(rank=samples.rank[slots], node=samples.node[slots], node_names=samples.node_names,
                      stage=samples.stage[slots], samples=n, step_s=step_med,
                      compute_s=masked_median(compute, valid, invalid, n)[0],
                      data_wait_s=masked_median(np.take(ring["data_wait_s"], flat), valid, invalid, n)[0],
                      dp_reduce_s=masked_median(np.take(ring["dp_reduce_s"], flat), valid, invalid, n)[0],
                      reduce_lag_s=masked_median(lags, valid & ~np.isnan(lags))[0])


def shared_phase_table(history: RankHistory, job: str, window: int, since_step: int | None) -> PhaseTable:
    """phase_table, made once per cycle for the detectors that share `history`'s pool (straggler and
    collective_slowdown close their windows at the same steps)."""
    return history.memo(("phase_table", job, window, since_step),
                        lambda: phase_table(history.jobs()[job], window, since_step))


def evidence_rows(table: PhaseTable, named: Collection[int] = (),
                  keep: int = EVIDENCE_ROWS) -> list[dict[str, object]]:
    """The phase table as an incident's evidence, by rank: every row of a job of up to `keep` ranks. Past that, the
    `named` ranks' rows and the ranks furthest from their stage's median compute or data-parallel reduce (each as a
    share of that median), `keep` in all: the rows on-call reads to see why, where the whole table of a
    131,072-rank job made one incident ~22 MB. The evidence's `ranks_in_table` says how many there were."""
    if len(table) <= keep:
        return [r.to_payload() for r in table.rows()]
    unusual = np.zeros(len(table))
    for rows in table.stages():
        compute = float(np.median(table.compute_s[rows])) or 1.0
        reduce = float(np.median(table.dp_reduce_s[rows])) or 1.0
        unusual[rows] = np.maximum(np.abs(table.compute_s[rows] - compute) / compute,
                                   np.abs(table.dp_reduce_s[rows] - reduce) / reduce)
    is_named = np.isin(table.rank, np.fromiter(named, dtype=np.int64))
    chosen = np.flatnonzero(is_named)[:keep]
    others = np.flatnonzero(~is_named)
    by_unusual = others[np.argsort(-unusual[others], kind="stable")][: keep - len(chosen)]
    picked = np.sort(np.concatenate([chosen, by_unusual]))  # rows are by rank
    return [r.to_payload() for r in table.rows(picked)]


class Windowed(Protocol):
    """A detector's per-job state that closes windows of job steps: where the last one ended."""

    window_end: int


W = TypeVar("W", bound=Windowed)


def closed_windows(history: RankHistory, jobs: dict[str, W], make: Callable[[int], W], window: int,
                   min_ranks: int = 1) -> Iterator[tuple[str, W, PhaseTable]]:
    """Per job of `history` whose lowest rank has gone `window` steps past its state's last window (a rollback
    moves that back), the job, its state (made by `make(low step)` the first time) and the phase table of the
    window just closed (each rank's last 2 x `window` samples after it): what collective_slowdown and job_slowdown
    each read once a window."""
    for job, samples in history.jobs().items():
        if len(samples.known()) < min_ranks:
            continue
        low = history.low_step(job)
        state = jobs.setdefault(job, make(low))
        state.window_end = min(state.window_end, low)
        if low - state.window_end < window:
            continue
        rows = shared_phase_table(history, job, window * 2, state.window_end)
        state.window_end = low
        yield job, state, rows
