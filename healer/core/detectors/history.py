"""What detectors remember between cycles: each rank's step samples, taken from the heartbeat table.

The table keeps only each rank's latest heartbeat. A detector that learns (step-time p99, loss baseline,
phase medians over a window) keeps its own `RankHistory` and feeds it the table every cycle: a sample is
added when a rank reports a step it had not reported before. A step lower than the last one means the
job was restarted or rolled back: the samples from that step on are dropped, since they will be redone.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from healer.core.heartbeats import RankBeat
from healer.core.jobview import Readings


@dataclass(frozen=True, slots=True)
class Sample:
    """One step of one rank, as its heartbeat carried it."""

    step: int
    received_at: float
    node: str
    step_seconds: float | None
    phases: dict[str, float]
    loss: float | None
    grad_norm: float | None
    nonfinite: dict[str, str]
    dp_reduce_lag_s: float | None

    @classmethod
    def of(cls, beat: RankBeat) -> Sample:
        e = beat.entry
        return cls(step=e.step or 0, received_at=beat.received_at, node=beat.node, step_seconds=e.step_seconds,
                   phases=e.phases, loss=e.loss, grad_norm=e.grad_norm, nonfinite=e.nonfinite,
                   dp_reduce_lag_s=e.dp_reduce_lag_s)


@dataclass(slots=True)
class RankSeries:
    job: str
    rank: int
    node: str
    samples: deque[Sample]
    last_step: int = -1
    stage: int = 0
    """The rank's pipeline stage (mesh `pp` coordinate): ranks of one stage do the same work."""


@dataclass(slots=True)
class RankHistory:
    """Per (job, rank), the last `keep` samples. `update` returns the samples that are new this cycle."""

    keep: int = 256
    series: dict[tuple[str, int], RankSeries] = field(default_factory=dict)

    def update(self, table: Readings) -> list[tuple[RankSeries, Sample]]:
        new: list[tuple[RankSeries, Sample]] = []
        for beat in table.ranks():
            if beat.step is None:
                continue
            key = (beat.job, beat.rank)
            s = self.series.get(key)
            if s is None:
                s = self.series[key] = RankSeries(beat.job, beat.rank, beat.node, deque(maxlen=self.keep))
            s.node = beat.node
            s.stage = beat.entry.mesh.get("pp", s.stage)
            if beat.step == s.last_step:
                continue
            if beat.step < s.last_step:
                # Restarted or rolled back: what comes after this step will be computed again.
                while s.samples and s.samples[-1].step >= beat.step:
                    s.samples.pop()
            sample = Sample.of(beat)
            s.samples.append(sample)
            s.last_step = beat.step
            new.append((s, sample))
        return new

    def jobs(self) -> dict[str, list[RankSeries]]:
        out: dict[str, list[RankSeries]] = {}
        for s in self.series.values():
            out.setdefault(s.job, []).append(s)
        for series in out.values():
            series.sort(key=lambda r: r.rank)
        return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of nothing")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of nothing")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
