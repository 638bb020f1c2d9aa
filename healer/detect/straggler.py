"""`straggler`: one rank that holds the others up, found by elimination as in MegaScale, one finding per job and host.

Every window of `window` job steps, over the phase table (per-rank medians of the window), within each
pipeline stage (ranks of one stage do the same work; across stages compute differs, and waiting for another
stage's activations is inside forward/backward):
1. compute: is one rank's compute (forward/backward less its waits, and the optimizer) above `ratio` x the median
   of the ranks? Then that rank is slow at computing (a slow GPU, a throttled CPU, a noisy neighbour).
2. data: is one rank's data wait above the median by more than `share` of the median step? Its input
   pipeline is the straggler.
3. late into the reduce: compute and data are flat, and the other ranks wait in the data-parallel reduce for
   one rank (its reduce is the shortest by more than `share` of the step, or its entry lag is largest):
   it starts late.
Otherwise nobody is named (a uniform slowdown is the collective_slowdown detector's). A rank is named
only after `consecutive` windows in a row name it; the phase table of the last window is the evidence.

A finding is keyed by the job and the named rank's node: another host that holds the job up later is another
incident, not the first one reopened under a summary that names the first host. A host's key is healthy again
once a window names nobody or another rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.phases import PhaseTable, evidence_rows, shared_phase_table
from healer.detect.suspects import Suspect
from healer.observe.history import RankHistory, prune
from healer.observe.jobview import Readings


@dataclass(frozen=True, slots=True)
class Attribution:
    """What one window says: the suspect rank (or None) and which test singled it out."""

    rank: int | None
    cause: str
    """compute | data | late-reduce | none"""
    detail: dict[str, float] = field(default_factory=dict)
    strength: float = 0.0
    """How far past its test the rank is, to rank findings of one cause: compute over the median, or the extra
    wait as a share of the step."""


CAUSE_ORDER = ("compute", "data", "late-reduce")
"""Across pipeline stages, the first cause found wins: a rank late into its reduce may only have waited for a slow
stage (in the demo's job rank 2 computes 6x slower than its stage peer and rank 0, its pipeline partner, reaches its
own reduce 0.34 s after its peer), while a rank's own slow work or data wait is nothing a peer made."""


def _median_without_top(values: np.ndarray) -> float:
    """The median of `values` less one of its largest (at least two values): the middle of the others' order is
    the whole's, so one partition, not a copy without it and a median of that."""
    m = len(values) - 1
    lower, upper = (m - 1) // 2, m // 2
    part = np.partition(values, (lower, upper))
    return float((part[lower] + part[upper]) / 2)


def attribute(table: PhaseTable, rows: np.ndarray, ratio: float, share: float) -> Attribution:
    """Pure: the elimination over one window's phase table, the rows at the indices `rows` (one stage's).
    NOTE: over the table's columns: at 131,072 ranks a pass over row objects cost most of a second per window."""
    if len(rows) < 2:
        return Attribution(None, "none", {"ranks": float(len(rows))})
    rank = table.rank[rows]
    compute, data, reduce = table.compute_s[rows], table.data_wait_s[rows], table.dp_reduce_s[rows]
    step = float(np.median(table.step_s[rows]))
    top = int(np.argmax(compute))
    # NOTE: against the median of the *other* ranks: with two ranks a median that includes the slow one is
    # their mean, which would halve any slowdown.
    compute_med = _median_without_top(compute)
    if compute_med > 0 and compute[top] > ratio * compute_med:
        return Attribution(int(rank[top]), "compute", {"compute_s": float(compute[top]),
                                                       "median_compute_s": compute_med,
                                                       "ratio": float(compute[top]) / compute_med,
                                                       "excess_s": float(compute[top]) - compute_med},
                           strength=float(compute[top]) / compute_med)
    top = int(np.argmax(data))
    data_med = _median_without_top(data)
    if data[top] - data_med > share * step:
        return Attribution(int(rank[top]), "data", {"data_wait_s": float(data[top]), "median_data_wait_s": data_med,
                                                    "step_s": step, "excess_s": float(data[top]) - data_med},
                           strength=(float(data[top]) - data_med) / step)
    reduce_med = float(np.median(reduce))
    low = int(np.argmin(reduce))
    others = reduce[rank != rank[low]]
    # Everyone else waits (their reduce is long) while one rank's is short: that rank arrives last.
    if reduce_med - reduce[low] > share * step and bool((others - reduce[low] > share * step).all()):
        return Attribution(int(rank[low]), "late-reduce", {"dp_reduce_s": float(reduce[low]),
                                                           "median_dp_reduce_s": reduce_med, "step_s": step,
                                                           "excess_s": reduce_med - float(reduce[low])},
                           strength=(reduce_med - float(reduce[low])) / step)
    lags = table.reduce_lag_s[rows]
    if not np.isnan(lags).all():
        late = int(np.nanargmax(lags))
        if lags[late] > share * step:
            return Attribution(int(rank[late]), "late-reduce", {"reduce_lag_s": float(lags[late]), "step_s": step,
                                                                "excess_s": float(lags[late])},
                               strength=float(lags[late]) / step)
    return Attribution(None, "none", {"step_s": step, "median_compute_s": compute_med})


def attribute_by_stage(table: PhaseTable, ratio: float, share: float) -> Attribution:
    """Pure: `attribute` within each pipeline stage (ranks of different stages do different work); of the stages'
    findings, the first cause in CAUSE_ORDER, and of that cause the strongest.
    NOTE: the trainer times a rank's waits for other stages apart (pp_wait, train/timing.py), so they are not in
    its compute; before that a slow rank's pipeline partner computed as slowly as it did, and the finding named one
    or the other by a hair each window (the demo's straggler was named in 8 runs of 10)."""
    stages = table.stages()
    found = [a for rows in stages if (a := attribute(table, rows, ratio, share)).rank is not None]
    if not found:
        return Attribution(None, "none", {"stages": float(len(stages))})
    return min(found, key=lambda a: (CAUSE_ORDER.index(a.cause), -a.strength))


@dataclass(slots=True)
class _JobWindows:
    window_end: int = -1
    """The job step at which the last window closed."""
    streak_rank: int | None = None
    streak: int = 0
    last: Attribution | None = None
    rows: PhaseTable | None = None
    evidence: list[dict[str, object]] | None = None
    """`rows` as evidence, made once per window while it fires (every cycle asks)."""
    last_key: str | None = None
    """The key of the rank the last window named (None: nobody)."""


class Straggler(Detector):
    name = "straggler"

    @dataclass(kw_only=True, slots=True)
    class Config:
        window: int = 5
        """Job steps per window."""
        consecutive: int = 3
        """Windows in a row that must name the same rank before it is reported (K)."""
        ratio: float = 1.3
        """Compute of the slowest rank over the median that counts as slow."""
        share: float = 0.2
        """Extra data wait, or waiting in the reduce, as a share of the median step, that counts."""

        def __post_init__(self) -> None:
            if self.window < 2:
                raise ValueError(f"window must be >= 2, got {self.window}")
            if self.consecutive < 1:
                raise ValueError(f"consecutive must be >= 1, got {self.consecutive}")
            if self.ratio <= 1:
                raise ValueError(f"ratio must be > 1, got {self.ratio}")
            if not 0 < self.share < 1:
                raise ValueError(f"share must be in (0, 1), got {self.share}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # The phase table reads each rank's last 2 x window samples; the healer's shared history keeps the deepest
        # any detector asks for, for every rank (131,072 at the largest): no more than is read.
        self.history = RankHistory(keep=2 * config.window)
        self._jobs: dict[str, _JobWindows] = {}
        self._named: dict[str, set[str]] = {}
        """Per job, the keys its findings had: which to call healthy again. Kept across restarts (an incident of
        the attempt before resolves once a window of the new one names nobody), forgotten with the job."""

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        self.history.update(table, now)
        prune(self._jobs, self.history.job_names(), self.history.restarted)
        prune(self._named, self.history.job_names())
        firing: list[Finding] = []
        healthy: set[str] = set()
        for job in self.history.jobs():
            low = self.history.low_step(job)
            state = self._jobs.setdefault(job, _JobWindows(window_end=low))
            if low < state.window_end:
                # Restarted or rolled back: other processes now, so the streak starts again.
                self._jobs[job] = state = _JobWindows(window_end=low)
            if low - state.window_end >= self.config.window:
                self._close_window(job, state, low)
            if state.streak_rank is not None and state.streak >= self.config.consecutive:
                finding = self._finding(job, state)
                self._named.setdefault(job, set()).add(finding.key)
                firing.append(finding)
            if state.last is not None and (named := self._named.get(job)):
                healthy.update(k for k in named if k != state.last_key)
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _close_window(self, job: str, state: _JobWindows, low: int) -> None:
        # NOTE: only samples of this window's steps: an older slowdown must not keep a rank named.
        rows = shared_phase_table(self.history, job, self.config.window * 2, state.window_end)
        state.window_end = low
        verdict = attribute_by_stage(rows, self.config.ratio, self.config.share)
        state.last, state.rows, state.evidence = verdict, rows, None
        state.last_key = _key(job, rows, verdict.rank) if verdict.rank is not None else None
        if verdict.rank is not None and verdict.rank == state.streak_rank:
            state.streak += 1
        else:
            state.streak_rank, state.streak = verdict.rank, 1 if verdict.rank is not None else 0

    def _finding(self, job: str, state: _JobWindows) -> Finding:
        assert state.last is not None and state.streak_rank is not None and state.rows is not None
        at = state.rows.index_of(state.streak_rank)
        row = state.rows.row(at) if at is not None else None
        if state.evidence is None:
            state.evidence = evidence_rows(state.rows, named=(state.streak_rank,))
        node = row.node if row is not None else None
        return Finding(
            key=state.last_key or job, job=job, node=node,
            summary=f"rank {state.streak_rank} on {node} holds the job up ({state.last.cause}) "
                    f"for {state.streak} windows of {self.config.window} steps",
            # NOTE: excess_s (what each step loses to the rank), the job's step time and the step it was named at:
            # what a swap's decision weighs (healer/decide/fail_slow.py).
            evidence={"cause": state.last.cause,
                      "excess_s": round(state.last.detail.get("excess_s", 0.0), 4),
                      "step_s": round(float(np.median(state.rows.step_s)), 4), "step": state.window_end,
                      "windows": state.streak, "window_steps": self.config.window,
                      "detail": {k: round(v, 4) for k, v in state.last.detail.items()},
                      "phase_table": state.evidence,
                      "ranks_in_table": len(state.rows)},
            labels={"suspect_node": node, "cause": state.last.cause} if node else {"cause": state.last.cause},
            suspects=(Suspect(node=node, rank=state.streak_rank),),
        )


def _key(job: str, rows: PhaseTable, rank: int) -> str:
    """A finding's key: the job and the node of the rank it names (the rank where the table lacks its row)."""
    at = rows.index_of(rank)
    return f"{job}/{rows.node_names[int(rows.node[at])]}" if at is not None else f"{job}/rank {rank}"
