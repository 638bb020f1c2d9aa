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
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from msgspec import Struct

from healer.core.heartbeats import RankBeat
from healer.core.jobview import Readings

T = TypeVar("T")


# NOTE: not `grad_norm_clip`: the global gradient norm is all-reduced over the data-parallel and pipeline groups,
# so that phase is mostly a wait for the other stages' reduce. Counted as compute, a slow link under one stage made
# every rank of the other stage look slow (0.55 s of 0.6 s on the bed).
COMPUTE_PHASES = ("forward_backward", "optimizer")
"""The phases of a step that are the rank's own work (healer/core/detectors/phases.py)."""
_FORWARD_BACKWARD, _OPTIMIZER = COMPUTE_PHASES  # NOTE: Sample.of sums them by name, the cheapest way per rank
NO_VALUES: dict[str, str] = {}
"""The `nonfinite` of every sample without any (shared: never changed)."""


class Sample(Struct, gc=False):
    """One step of one rank, as its heartbeat carried it. Never changed once made.
    NOTE: a gc=False struct: a history holds up to `keep` of them per rank (millions at 131,072 ranks), and as
    objects the garbage collector tracks each full collection walked them all. They hold no reference cycles.
    The step's phases are kept as the sums the detectors read, not as the record's dict: a dict of 7 phases is
    ~0.4 KiB, kept 10 times for each of 131,072 ranks, and the phase table summed them again at every window."""

    step: int
    received_at: float
    node: str
    step_seconds: float | None
    compute_s: float | None
    """COMPUTE_PHASES summed; None: the record had no phases."""
    data_wait_s: float
    dp_reduce_s: float
    """The data-parallel collectives (`dp_reduce` and `dp_gather`) summed."""
    checkpoint_s: float
    loss: float | None
    grad_norm: float | None
    nonfinite: dict[str, str]
    dp_reduce_lag_s: float | None

    @classmethod
    def of(cls, beat: RankBeat) -> Sample:
        e = beat.entry
        phases = e.phases
        if phases:
            get = phases.get
            compute: float | None = get(_FORWARD_BACKWARD, 0.0) + get(_OPTIMIZER, 0.0)
            data, reduce, save = get("data_wait", 0.0), get("dp_reduce", 0.0) + get("dp_gather", 0.0), \
                get("checkpoint", 0.0)
        else:
            compute, data, reduce, save = None, 0.0, 0.0, 0.0
        # NOTE: positional: a keyword call costs ~1.5x as much, once per rank and step
        return cls(e.step or 0, beat.received_at, beat.node, e.step_seconds, compute, data, reduce, save, e.loss,
                   e.grad_norm, e.nonfinite or NO_VALUES, e.dp_reduce_lag_s)


class RankSeries(Struct, gc=False):
    """One rank's newest samples, oldest first.
    NOTE: a gc=False struct holding a tuple, not a dataclass holding a deque: 131,072 ranks were 262,144 objects the
    garbage collector tracked, and walked at each full collection (~0.3 s each, about twice a cycle). A tuple of
    untracked samples is untracked itself; a new sample makes a new tuple of at most `keep` (10 by default)."""

    job: str
    rank: int
    node: str
    samples: tuple[Sample, ...] = ()
    """Never empty once the history has it: a series is made with a rank's first sample, and a rollback drops the
    samples from its step on only to add that step's."""
    last_step: int = -1
    """The step of the newest sample."""
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
    _by_job: dict[str, dict[int, RankSeries]] = field(default_factory=dict)
    """The same series by job, then rank. NOTE: kept as the series come and go, so that which jobs there are, and
    each job's ranks in order, cost nothing per cycle (a pass over 131,072 series did, up to six times a cycle)."""
    _ordered: dict[str, list[RankSeries]] = field(default_factory=dict)
    """Per job, its series by rank, made when first asked for after the job's ranks changed."""

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
        series, forget_after_s, keep = self.series, self.forget_after_s, self.keep
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
                s = self._add(RankSeries(job, e.rank, beat.node))
            if heard_at > s.heard_at:
                s.heard_at = heard_at
            if step == s.last_step:
                continue
            # NOTE: where a rank is, and its stage, are taken with its steps: they change only when it starts again
            s.node = beat.node
            s.stage = e.mesh.get("pp", s.stage)
            kept = s.samples
            if step < s.last_step:
                # Restarted or rolled back: what comes after this step will be computed again.
                n = len(kept)
                while n and kept[n - 1].step >= step:
                    n -= 1
                kept = kept[:n]
            sample = Sample.of(beat)
            s.samples = (*kept[1:], sample) if len(kept) >= keep else (*kept, sample)
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
                for rank in list(self._by_job.get(job, ())):
                    self._drop((job, rank))
            attempts[job] = attempt
        self._attempts = attempts  # NOTE: only the jobs still known: bounded like the series

    def forget(self, now: float) -> int:
        """Drop the ranks not heard of for forget_after_s; returns how many."""
        # NOTE: a sweep costs a pass over every rank: at most a few times per forget_after_s, not every cycle.
        self._next_sweep = now + min(60.0, self.forget_after_s / 4)
        old = [key for key, s in self.series.items() if now - s.heard_at > self.forget_after_s]
        for key in old:
            self._drop(key)
        return len(old)

    def _add(self, s: RankSeries) -> RankSeries:
        self.series[(s.job, s.rank)] = s
        self._by_job.setdefault(s.job, {})[s.rank] = s
        self._ordered.pop(s.job, None)
        return s

    def _drop(self, key: tuple[str, int]) -> None:
        job, rank = key
        del self.series[key]
        ranks = self._by_job[job]
        del ranks[rank]
        if not ranks:
            del self._by_job[job]
        self._ordered.pop(job, None)

    def _make_room(self, now: float) -> None:
        if len(self.series) < self.max_series:
            return
        if self.forget(now) == 0:
            # NOTE: the oldest sixteenth at once, by one sort: one by one, each new rank of a job larger than the
            # room would scan every series (a cycle of hours at 131,072 ranks).
            oldest = sorted(self.series, key=lambda k: self.series[k].heard_at)[:max(1, self.max_series // 16)]
            for key in oldest:
                self._drop(key)
            self.evicted += len(oldest)

    def jobs(self) -> dict[str, list[RankSeries]]:
        """Per job, its ranks' series by rank (shared with the pool's other readers: not to be changed)."""
        if self._shared is not None:
            return self._shared.jobs()
        return self._jobs()

    def _jobs(self) -> dict[str, list[RankSeries]]:
        out: dict[str, list[RankSeries]] = {}
        for job, ranks in self._by_job.items():
            ordered = self._ordered.get(job)
            if ordered is None:
                ordered = self._ordered[job] = [ranks[r] for r in sorted(ranks)]
            out[job] = ordered
        return out

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """make(), made once per cycle for all the detectors that share this history's pool under the same key
        (e.g. a job's phase table over the same window: straggler and collective_slowdown both read it)."""
        if self._shared is not None:
            return self._shared.memo(key, make)
        return make()

    def low_step(self, job: str) -> int:
        """The lowest newest step of the job's ranks (a job of `jobs()`; every series has a sample)."""
        return self.memo(("low_step", job), lambda: min(s.last_step for s in self.jobs()[job]))

    def job_names(self) -> set[str]:
        if self._shared is not None:
            return self._shared.history.job_names()
        return set(self._by_job)


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
        self._memo: dict[Hashable, object] = {}

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
            self._view, self._jobs, self._memo = view, None, {}
        return self._new

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]  # type: ignore[return-value]

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
