"""`collective_slowdown`: every rank slower at once, with the time going into the collectives rather than into
compute, which points at the network (or the collective library), not at one rank. One finding per job.

The transfer time of a data-parallel group (the ranks of one pipeline stage) is the smallest `dp_reduce` median
among its ranks (the time a rank that waits for nobody spends in the reduce); the window's transfer time is that of
its slowest group. NOTE: per group, not the smallest over the whole job: with pipeline stages, a slow link slows the
groups whose ranks it carries, and the smallest over every rank would be a group it does not touch.

The job's baseline is the median of its first `baseline_windows` windows. A window is slow when the transfer time
grew more than `factor` times as much as compute did (a machine that got slower as a whole, as a shared one does,
slows both alike: that is not the network) and no rank's compute stands out (by `ratio`) by as much time as the
transfer grew (the straggler detector's case). The job is healthy again once the transfer time is back under `clear_factor` x the
baseline: lower than `factor`, so that a transfer time that wavers around the threshold (the windows are short, and a
shared machine is noisy) does not resolve the incident while network-triage is still looking at it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.phases import PhaseTable, closed_windows, evidence_rows
from healer.observe.history import RankHistory, median, prune
from healer.observe.jobview import Readings


@dataclass(slots=True)
class _Job:
    window_end: int
    transfer: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    slow_windows: int = 0
    last: dict[str, object] = field(default_factory=dict)
    rows: PhaseTable | None = None
    """The phase table of the last window (the evidence, once it fires)."""
    evidence: list[dict[str, object]] | None = None
    """`rows` as evidence, made once per window while it fires (every cycle asks)."""


class CollectiveSlowdown(Detector):
    name = "collective_slowdown"

    @dataclass(kw_only=True, slots=True)
    class Config:
        window: int = 5
        """Job steps per window."""
        baseline_windows: int = 3
        """Windows that make the baseline before anything can fire."""
        factor: float = 2.0
        """Transfer time over the baseline that counts as a slowdown."""
        clear_factor: float = 1.5
        """Transfer time over the baseline under which the slowdown is over (at most `factor`)."""
        ratio: float = 1.3
        """No rank's compute may be more than this over the median rank's for the slowdown to be put on the
        network (a rank that stands out is a straggler)."""
        consecutive: int = 2
        """Slow windows in a row before firing."""

        def __post_init__(self) -> None:
            if self.window < 2:
                raise ValueError(f"window must be >= 2, got {self.window}")
            if self.baseline_windows < 1:
                raise ValueError(f"baseline_windows must be >= 1, got {self.baseline_windows}")
            if self.factor <= 1 or self.ratio <= 1:
                raise ValueError(f"factor and ratio must be > 1, got {self.factor}, {self.ratio}")
            if not 1 <= self.clear_factor <= self.factor:
                raise ValueError(f"clear_factor must be in [1, factor {self.factor}], got {self.clear_factor}")
            if self.consecutive < 1:
                raise ValueError(f"consecutive must be >= 1, got {self.consecutive}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # The phase table reads each rank's last 2 x window samples; the healer's shared history keeps the deepest
        # any detector asks for, for every rank (131,072 at the largest): no more than is read.
        self.history = RankHistory(keep=2 * config.window)
        self._jobs: dict[str, _Job] = {}

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        self.history.update(table, now)
        prune(self._jobs, self.history.job_names(), self.history.restarted)
        firing, healthy = [], set()
        for job, state, rows in closed_windows(self.history, self._jobs, lambda low: _Job(window_end=low),
                                               self.config.window, min_ranks=2):
            if len(rows) < 2:
                continue
            # NOTE: per stage, each stage's ranks reduce together (tensor parallelism stays inside a host)
            transfer = max(float(rows.dp_reduce_s[group].min()) for group in rows.stages())
            compute = float(np.median(rows.compute_s))
            if len(state.transfer) < self.config.baseline_windows:
                state.transfer.append(transfer)
                state.compute.append(compute)
                continue
            base_t, base_c = median(state.transfer), median(state.compute)
            compute_growth = max(1.0, compute / base_c) if base_c > 0 else 1.0
            slow = base_t > 0 and transfer > self.config.factor * compute_growth * base_t \
                and not _straggler_explains(rows, compute, transfer - base_t, self.config.ratio)
            state.slow_windows = state.slow_windows + 1 if slow else 0
            # NOTE: excess_s (what each step loses to the slower transfer), the step time and the step: what a
            # swap of the host network-triage names weighs (healer/decide/fail_slow.py), as a straggler's do.
            state.last = {"transfer_s": round(transfer, 4), "baseline_transfer_s": round(base_t, 4),
                          "compute_s": round(compute, 4), "baseline_compute_s": round(base_c, 4),
                          "factor": round(transfer / base_t, 2) if base_t > 0 else None,
                          "compute_growth": round(compute_growth, 2),
                          "excess_s": round(max(0.0, transfer - base_t), 4),
                          "step_s": round(float(np.median(rows.step_s)), 4), "step": state.window_end}
            # NOTE: made evidence only when it fires, once per window (a pass over every row at 131,072 ranks)
            state.rows, state.evidence = rows, None
            if transfer <= self.config.clear_factor * base_t:
                # NOTE: healthy only once the transfer itself is back: a window that is not slow because compute
                # grew too (a network test running beside the training takes CPUs too) must not resolve the incident.
                healthy.add(job)
        for job, state in self._jobs.items():
            if state.slow_windows >= self.config.consecutive and state.rows is not None:
                if state.evidence is None:
                    state.evidence = evidence_rows(state.rows)
                firing.append(Finding(
                    key=job, job=job, node=None,
                    summary=f"the data-parallel reduce slower: {state.last['transfer_s']} s against a baseline of "
                            f"{state.last['baseline_transfer_s']} s, compute x{state.last['compute_growth']} "
                            "(network suspected)",
                    evidence={**state.last, "windows": state.slow_windows, "window_steps": self.config.window,
                              "phase_table": state.evidence, "ranks_in_table": len(state.rows)}))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))


def _straggler_explains(rows: PhaseTable, compute: float, transfer_growth_s: float, ratio: float) -> bool:
    """True when a rank's compute stands out (more than `ratio` x the median `compute`) by at least as much time as
    the transfer grew: a straggler (descheduled inside the reduce, say) may have held its group that long, so the
    network is not to blame. A slow link lengthens the compute of the ranks it carries pipeline sends for, too, but
    by far less than it lengthens the reduce (on the bed: the reduce by 0.94 s, the slowest rank's compute by 0.24 s
    over the median); before this, any rank standing out by 1.3x vetoed, and the slowdown went unseen under load."""
    top = float(rows.compute_s.max())
    return top > ratio * compute and top - compute >= transfer_growth_s
