"""What detectors remember between cycles: each rank's step samples, taken from the heartbeat table.

The table keeps only each rank's latest heartbeat. A detector that learns (step-time p99, loss baseline,
phase medians over a window) keeps its own `RankHistory` and feeds it the table every cycle: a sample is
added when a rank reports a step it had not reported before. A step lower than the last one means the
job was restarted or rolled back: the samples from that step on are dropped, since they will be redone. Under a
launcher a new attempt of a job starts its history afresh (its hosts, even its layout, may have changed: the old
attempt's samples would speak for a host that was left out), and with it the detectors' per-job state. Ranks not
heard of for a while are forgotten, and with them the per-job state of the detectors (see RankHistory).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TypeVar

from msgspec import Struct

from healer.core.heartbeats import RankBeat
from healer.core.jobview import Readings

T = TypeVar("T")


class Sample(Struct, gc=False):
    """One step of one rank, as its heartbeat carried it. Never changed once made.
    NOTE: a gc=False struct: a history holds up to `keep` of them per rank (millions at 131,072 ranks), and as
    objects the garbage collector tracks each full collection walked them all. They hold no reference cycles."""

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
    heard_at: float = 0.0
    """Healer time of the rank's newest record (when its batch came, less the record's age then)."""


@dataclass(slots=True)
class RankHistory:
    """Per (job, rank), the last `keep` samples. `update` returns the samples that are new this cycle.

    Bounded: a rank not heard of for `forget_after_s` is forgotten (its job ended, moved, or came back smaller:
    a healer that runs for months sees every rank of every job it ever watched), and at most `max_series` ranks
    are kept; past that, the one heard of longest ago makes room. A detector keeps its per-job state only for
    the jobs left here (`prune`).
    """

    keep: int = 256
    forget_after_s: float = 1800.0
    max_series: int = 262_144
    """Room for a 131,072-rank job and the next attempt's or job's ranks beside it."""
    series: dict[tuple[str, int], RankSeries] = field(default_factory=dict)
    evicted: int = 0
    """Ranks dropped to stay under max_series (not counting those forgotten for their silence)."""
    restarted: set[str] = field(default_factory=set)
    """The jobs whose attempt changed in the last `update` (their samples were dropped): a detector forgets its
    per-job state of them too (`prune`)."""
    _attempts: dict[str, int] = field(default_factory=dict)
    _next_sweep: float = 0.0
    _shared: HistoryPool | None = None

    def __post_init__(self) -> None:
        if self.keep < 1 or self.max_series < 1 or self.forget_after_s <= 0:
            raise ValueError(f"keep and max_series must be >= 1 and forget_after_s > 0, got {self.keep}, "
                             f"{self.max_series}, {self.forget_after_s}")

    def update(self, table: Readings, now: float) -> list[tuple[RankSeries, Sample]]:
        pool = getattr(table, "histories", None)
        if isinstance(pool, HistoryPool) and pool.serves(self):
            # NOTE: every learning detector reads the same samples: one pass over the ranks per cycle, not one per
            # detector (at 131,072 ranks each pass costs ~0.1 s). This history then is a view of the pool's.
            new = pool.update(table, now)
            self.series, self.restarted = pool.history.series, pool.history.restarted
            self._shared = pool
            return new
        return self._update(table, now)

    def _update(self, table: Readings, now: float) -> list[tuple[RankSeries, Sample]]:
        new: list[tuple[RankSeries, Sample]] = []
        self._new_attempts(table)
        since: dict[str, float] = {}
        series, forget_after_s = self.series, self.forget_after_s
        # NOTE: one pass over every rank per cycle (131,072 at the largest): the entry's fields are read once each,
        # straight from the struct, not through RankBeat's properties.
        for beat in table.ranks():
            e = beat.entry
            step = e.step
            heard_at = beat.received_at - e.last_seen_age_s
            # NOTE: a sidecar goes on listing a dead rank for minutes, and the table keeps its last beat for an hour:
            # a rank silent past forget_after_s is not brought back by its stale beat.
            if step is None or now - heard_at > forget_after_s:
                continue
            job = e.job
            start = since.get(job)
            if start is None:
                start = since[job] = table.processes.placement(job)[1]
            step_at = e.step_time if e.step_time is not None else heard_at
            if step_at < start:
                # A step from before the job's current attempt started: after a warm restart the same processes
                # (same pids, same ranks) are listed with their last step of the generation before until they
                # report a new one, and a NaN of that one is not this one's. NOTE: the step's own time (the rank's
                # host clock), not when the sidecar last heard the rank: other records (events) come in between.
                continue
            key = (job, e.rank)
            s = series.get(key)
            if s is None:
                self._make_room(now)
                s = series[key] = RankSeries(job, e.rank, beat.node, deque(maxlen=self.keep))
            s.node = beat.node
            s.stage = e.mesh.get("pp", s.stage)
            if heard_at > s.heard_at:
                s.heard_at = heard_at
            if step == s.last_step:
                continue
            if step < s.last_step:
                # Restarted or rolled back: what comes after this step will be computed again.
                while s.samples and s.samples[-1].step >= step:
                    s.samples.pop()
            sample = Sample.of(beat)
            s.samples.append(sample)
            s.last_step = step
            new.append((s, sample))
        if now >= self._next_sweep:
            self.forget(now)
        return new

    def _new_attempts(self, table: Readings) -> None:
        """Drop the samples of every job whose attempt (as its launcher numbers them) is not the one seen before."""
        self.restarted = set()
        attempts: dict[str, int] = {}
        if not table.processes.jobs():  # no launcher (the service alone): a restart shows only as a lower step
            self._attempts = attempts
            return
        for job in {s.job for s in self.series.values()} | {b.job for b in table.ranks()}:
            attempt = table.processes.attempt(job)
            if attempt is None:  # no launcher (the service alone): a restart shows only as a lower step
                continue
            if self._attempts.get(job, attempt) != attempt:
                self.restarted.add(job)
                for key in [k for k in self.series if k[0] == job]:
                    del self.series[key]
            attempts[job] = attempt
        self._attempts = attempts  # NOTE: only the jobs still known: bounded like the series

    def forget(self, now: float) -> int:
        """Drop the ranks not heard of for forget_after_s; returns how many."""
        # NOTE: a sweep costs a pass over every rank: at most a few times per forget_after_s, not every cycle.
        self._next_sweep = now + min(60.0, self.forget_after_s / 4)
        old = [key for key, s in self.series.items() if now - s.heard_at > self.forget_after_s]
        for key in old:
            del self.series[key]
        return len(old)

    def _make_room(self, now: float) -> None:
        if len(self.series) < self.max_series:
            return
        if self.forget(now) == 0:
            # NOTE: the oldest sixteenth at once, by one sort: one by one, each new rank of a job larger than the
            # room would scan every series (a cycle of hours at 131,072 ranks).
            oldest = sorted(self.series, key=lambda k: self.series[k].heard_at)[:max(1, self.max_series // 16)]
            for key in oldest:
                del self.series[key]
            self.evicted += len(oldest)

    def jobs(self) -> dict[str, list[RankSeries]]:
        """Per job, its ranks' series by rank (shared with the pool's other readers: not to be changed)."""
        if self._shared is not None:
            return self._shared.jobs()
        return self._jobs()

    def _jobs(self) -> dict[str, list[RankSeries]]:
        out: dict[str, list[RankSeries]] = {}
        for s in self.series.values():
            out.setdefault(s.job, []).append(s)
        for series in out.values():
            series.sort(key=lambda r: r.rank)
        return out

    def job_names(self) -> set[str]:
        return {job for job, _ in self.series}


class HistoryPool:
    """One RankHistory that the learning detectors of one healer share, updated once per detection cycle: the
    first detector to ask in a cycle (a TickView carrying the pool) does the pass over the ranks, the others get
    its new samples. Its keep is the largest any of them asked for; each reads only the samples it needs
    (the last one, or a window of the last ones), so a longer history does not change what they find."""

    def __init__(self, keep: int) -> None:
        self.history = RankHistory(keep=keep)
        self._view: object | None = None
        self._new: list[tuple[RankSeries, Sample]] = []
        self._jobs: dict[str, list[RankSeries]] | None = None

    @classmethod
    def for_detectors(cls, detectors: Collection[object]) -> HistoryPool | None:
        """The pool for the detectors that keep a RankHistory (as `history`); None when none does."""
        keeps = [d.history.keep for d in detectors if isinstance(getattr(d, "history", None), RankHistory)]
        return cls(max(keeps)) if keeps else None

    def serves(self, history: RankHistory) -> bool:
        return (history.keep <= self.history.keep and history.forget_after_s == self.history.forget_after_s
                and history.max_series == self.history.max_series)

    def update(self, view: object, now: float) -> list[tuple[RankSeries, Sample]]:
        if view is not self._view:
            self._new = self.history._update(view, now)  # type: ignore[arg-type]  # noqa: SLF001 - its own pass
            self._view, self._jobs = view, None
        return self._new

    def jobs(self) -> dict[str, list[RankSeries]]:
        if self._jobs is None:
            self._jobs = self.history._jobs()  # noqa: SLF001
        return self._jobs


def prune(state: dict[str, T], jobs: Collection[str], restarted: Collection[str] = ()) -> None:
    """Forget a detector's per-job `state` of every job not in `jobs` (what its history still knows), and of the
    jobs `restarted` (a new attempt: RankHistory.restarted)."""
    for job in [j for j in state if j not in jobs or j in restarted]:
        del state[job]


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
