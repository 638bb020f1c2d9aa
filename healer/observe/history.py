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
import weakref
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from healer.observe.jobview import Readings
from healer.observe.rank_columns import COMPUTE_PHASES, NONFINITE, JobView

__all__ = ["COMPUTE_PHASES", "HistoryPool", "JobSamples", "RankHistory", "median", "prune", "quantile"]

T = TypeVar("T")


RING_FIELDS = ("step_seconds", "compute_s", "data_wait_s", "dp_reduce_s", "checkpoint_s", "loss", "grad_norm",
               "dp_reduce_lag_s")
"""What a sample keeps of its step (the columns of healer/observe/rank_columns.py; NaN: the record had none)."""


class JobSamples:
    """One job's samples: per rank (by the slots of the job's columns), its last `keep` steps, as ring arrays of
    keep x slots (one row per ring position). NOTE: arrays, not an object per rank and step: at 131,072 ranks a
    cycle's new samples were a second of Python; as arrays they are a few vectorised stores. NOTE: position-major:
    the ranks of a job step together, so a cycle's new samples land mostly in one row (`add`: 131,072 stores scattered
    over slots x keep took ~8 ms a cycle), and a window's samples are gathered a row per age (newest_first).

    A slot's samples are in step order from its oldest (at `pos - count`, modulo keep) to its newest (`pos - 1`);
    `count` 0: the history does not know the rank (never seen, or forgotten)."""

    def __init__(self, job: str, epoch: int, keep: int) -> None:
        self.job, self.epoch, self.keep = job, epoch, keep
        self.n = 0
        self.rank = np.empty(0, dtype=np.int64)
        self.node = np.empty(0, dtype=np.int64)
        """Where each rank last made a step (an index into node_names)."""
        self.stage = np.empty(0, dtype=np.int64)
        """Each rank's pipeline stage (mesh `pp`): ranks of one stage do the same work."""
        self.last_step = np.empty(0, dtype=np.int64)
        self.count = np.empty(0, dtype=np.int64)
        self.pos = np.empty(0, dtype=np.int64)
        self.written = np.empty(0, dtype=np.int64)
        """Samples ever added per slot: a sample is new to a reader that saw fewer."""
        self.heard_at = np.empty(0)
        """Healer time of each rank's newest record (when its batch came, less the record's age then)."""
        self.steps = np.empty((keep, 0), dtype=np.int64)
        self.nonfinite = np.empty((keep, 0), dtype=bool)
        self.ring = {name: np.empty((keep, 0)) for name in RING_FIELDS}
        self.node_names: list[str] = []
        self._order: np.ndarray | None = None

    def grow(self, n: int) -> None:
        if n <= self.n:
            return
        extra = n - self.n

        def more(values: np.ndarray, fill: float | int | bool) -> np.ndarray:  # slots are the last axis
            return np.concatenate([values, np.full((*values.shape[:-1], extra), fill, dtype=values.dtype)], axis=-1)

        self.rank, self.node, self.stage = more(self.rank, -1), more(self.node, -1), more(self.stage, 0)
        self.last_step, self.count, self.pos = more(self.last_step, -1), more(self.count, 0), more(self.pos, 0)
        self.written, self.heard_at = more(self.written, 0), more(self.heard_at, -math.inf)
        self.steps, self.nonfinite = more(self.steps, -1), more(self.nonfinite, False)
        self.ring = {name: more(values, math.nan) for name, values in self.ring.items()}
        self.n = n

    def known(self) -> np.ndarray:
        """The slots of the ranks the history knows, by rank (made once per change of them)."""
        if self._order is None:
            slots = np.flatnonzero(self.count > 0)
            self._order = slots[np.argsort(self.rank[slots], kind="stable")]
        return self._order

    def newest(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Each of `slots`' newest sample's `name` (slots the history knows)."""
        # NOTE: by flat position (np.take): a fancy index of rows and columns took ~3 ms at 131,072 slots
        at = (self.pos[slots] - 1) % self.keep * self.steps.shape[1] + slots
        values = self.steps if name == "step" else self.nonfinite if name == "nonfinite" else self.ring[name]
        return np.take(values, at)

    def newest_first(self, window: int, slots: np.ndarray, since_step: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """Where `slots`' newest `window` samples after step `since_step` lie, newest first, as ages x slots: their
        flat positions in a ring array (for np.take: position x width + slot) and whether each slot has a sample
        there. Only as many ages as some slot has a sample at: a slot's samples in the window are its newest few
        (its steps rise with its ring positions), so the first age none has ends them.
        NOTE: by age, one row per age: a window's medians then run over whole rows (phases.masked_median), and the
        rows are gathered straight from the ring, not copied out row by row and transposed (~30 ms at 131,072)."""
        count, width = self.count[slots], self.steps.shape[1]
        steps = self.steps.reshape(-1)
        flat = np.empty((min(window, self.keep), len(slots)), dtype=np.int64)
        valid = np.empty(flat.shape, dtype=bool)
        at = (self.pos[slots] - 1) % self.keep * width + slots  # the newest
        ages = 0
        for age in range(flat.shape[0]):
            if age:  # one position older: a row up the ring, from its first row round to its last
                at = np.subtract(flat[age - 1], width, out=flat[age])
                np.add(at, self.keep * width, out=at, where=at < 0)
            else:
                flat[0] = at
            np.logical_and(count > age, np.take(steps, at) > since_step, out=valid[age])
            if not valid[age].any():
                break
            ages = age + 1
        return flat[:ages], valid[:ages]

    def samples_of(self, slot: int) -> list[dict[str, float | int | None]]:
        """One rank's samples, oldest first, as plain values (None for NaN): for the few ranks a detector follows."""
        out = []
        for i in range(int(self.count[slot])):
            at = (int(self.pos[slot]) - int(self.count[slot]) + i) % self.keep
            row: dict[str, float | int | None] = {"step": int(self.steps[at, slot])}
            for name, values in self.ring.items():
                x = float(values[at, slot])
                row[name] = None if math.isnan(x) else x
            out.append(row)
        return out

    def node_of(self, slot: int) -> str:
        return self.node_names[int(self.node[slot])]

    def forget(self, slots: np.ndarray) -> None:
        self.count[slots] = 0
        self.pos[slots] = 0
        self.last_step[slots] = -1
        self.heard_at[slots] = -math.inf
        self.steps[:, slots] = -1
        self._order = None

    def add(self, cols: JobView, now: float, forget_after_s: float, started_at: float) -> np.ndarray:
        """Take this cycle's columns of the job; returns the slots that got a new sample."""
        self.grow(cols.n)
        n = cols.n
        self.node_names = cols.node_names
        step = cols.step
        heard = cols.heard_at
        # NOTE: a sidecar goes on listing a dead rank for minutes, and the table keeps its last beat for an hour: a
        # rank silent past forget_after_s is not brought back by its stale beat. A step from before the job's current
        # attempt started is not this attempt's: after a warm restart the same processes (same pids, same ranks) are
        # listed with their last step of the generation before until they report a new one, and a NaN of that one is
        # not this one's. A step that says its attempt was kept by the view only if it is this one's (jobview.py);
        # one that does not is judged by its own time (the rank's host clock, not when the sidecar last heard the
        # rank: other records come in between), which a host clock behind the healer's would make look old.
        step_at = np.where(np.isnan(cols.step_time), heard, cols.step_time)
        ok = cols.counts & (step >= 0) & (now - heard <= forget_after_s) & \
            ((cols.attempt >= 0) | (step_at >= started_at))
        fresher = ok & (heard > self.heard_at[:n])
        self.heard_at[:n][fresher] = heard[fresher]
        slots = np.flatnonzero(ok & (step != self.last_step[:n]))
        if not slots.size:
            return slots
        # NOTE: at scale nearly every cycle brings every rank of a job a new sample: then a slice, not a fancy index
        # (each a copy of 131,072), picks them.
        pick: slice | np.ndarray = slice(0, n) if slots.size == n else slots
        fresh = self.count[pick] == 0
        if fresh.any():
            self._order = None  # ranks the history did not know
            if not fresh.all():
                # NOTE: a rank new to the history starts at the ring position the others are at (it has no sample:
                # any position will do). From position 0 the ranks a job's first cycles did not hear yet (its
                # relays' batches come over a second or two) stayed a position or two behind for good: at
                # 131,072 ranks 60% of them, stored one by one below (~4 ms a cycle, bench/healer_ingest.py).
                known_at = self.pos[pick][~fresh]
                self.pos[slots[fresh]] = int(np.bincount(known_at).argmax())
        new_step = step[pick]
        back = slots[new_step < self.last_step[pick]]
        if back.size:
            # Restarted or rolled back: what comes after this step will be computed again.
            held = self.steps[:, back]
            drop = held >= step[back]
            dropped = drop.sum(axis=0)
            held[drop] = -1
            self.steps[:, back] = held
            self.pos[back] = (self.pos[back] - dropped) % self.keep
            self.count[back] -= dropped
        at = self.pos[pick]
        # NOTE: the ranks of a job step together, so the new samples go mostly in one row of the ring (the one most of
        # them are at): copied into it under a mask, a pass along the row; the others one by one (np.put). Scattered
        # stores of all 131,072 cost ~7 ms a cycle, the masked row ~2. A rank that misses a batch still stays a
        # ring position behind for good (~0.2% of the ranks a cycle in the loaded bench): a position set by the step
        # number would keep it in the row, but then a window would count steps, not samples.
        row = int(np.bincount(at).argmax())
        in_row = at == row
        mask = np.zeros(n, dtype=bool)
        mask[slots[in_row]] = True
        rest = slots[~in_row]
        flat = at[~in_row] * self.n + rest
        for values, new in ((self.steps, step), (self.nonfinite, (cols.flags & NONFINITE).astype(bool)),
                            *((self.ring[name], cols.arrays[name]) for name in self.ring)):
            np.copyto(values[row, :n], new, where=mask)
            if rest.size:
                np.put(values, flat, new[rest])
        self.pos[pick] = (at + 1) % self.keep
        self.count[pick] = np.minimum(self.count[pick] + 1, self.keep)
        self.written[pick] += 1
        self.last_step[pick] = new_step
        # NOTE: where a rank is, and its stage, are taken with its steps: they change only when it starts again
        self.node[pick], self.stage[pick], self.rank[pick] = cols.node[pick], cols.stage[pick], cols.rank[pick]
        return slots


@dataclass(slots=True)
class RankHistory:
    """Per job and rank, the last `keep` samples (JobSamples). `update` returns, per job, the slots that got a new
    sample this cycle.

    Bounded: a rank not heard of for `forget_after_s` is forgotten (its job ended, moved, or came back smaller:
    a healer that runs for months sees every rank of every job it ever watched), and at most `max_series` ranks
    are kept; past that, those heard of longest ago make room. A detector keeps its per-job state only for
    the jobs left here (`prune`).
    """

    keep: int = 256
    forget_after_s: float = 1800.0
    max_series: int = 262_144
    """Room for a 131,072-rank job and the next attempt's or job's ranks beside it."""
    samples: dict[str, JobSamples] = field(default_factory=dict)
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

    def update(self, table: Readings, now: float) -> dict[str, np.ndarray]:
        pool = table.histories
        if pool is not None and pool.serves(self):
            # NOTE: every learning detector reads the same samples: one update per cycle, not one per detector.
            # This history then is a view of the pool's.
            new = pool.update(table, now)
            self.samples, self.restarted = pool.history.samples, pool.history.restarted
            self._shared = pool
            return new
        return self._update(table, now)

    def _update(self, table: Readings, now: float) -> dict[str, np.ndarray]:
        columns = table.columns()
        self._new_attempts(table, columns)
        new: dict[str, np.ndarray] = {}
        for job, cols in columns.items():
            held = self.samples.get(job)
            if held is None or held.epoch != cols.epoch:
                # NOTE: the table renumbered the job's ranks (it had forgotten all of them): start it afresh
                held = self.samples[job] = JobSamples(job, cols.epoch, self.keep)
            slots = held.add(cols, now, self.forget_after_s, table.processes.placement(job)[1])
            if slots.size:
                new[job] = slots
        self._make_room(now, new)
        if now >= self._next_sweep:
            self.forget(now)
        for job in [j for j, held in self.samples.items() if not held.known().size]:
            del self.samples[job]
            new.pop(job, None)
        return new

    def _new_attempts(self, table: Readings, columns: Mapping[str, JobView]) -> None:
        """Drop the samples of every job whose attempt (as its launcher numbers them) is not the one seen before."""
        self.restarted = set()
        attempts: dict[str, int] = {}
        if not table.processes.jobs():  # no launcher (the service alone): a restart shows only as a lower step
            self._attempts = attempts
            return
        for job in set(self.samples) | set(columns):
            attempt = table.processes.attempt(job)
            if attempt is None:  # no launcher (the service alone): a restart shows only as a lower step
                continue
            if self._attempts.get(job, attempt) != attempt:
                self.restarted.add(job)
                self.samples.pop(job, None)
            attempts[job] = attempt
        self._attempts = attempts  # NOTE: only the jobs still known: bounded like the samples

    def forget(self, now: float) -> int:
        """Drop the ranks not heard of for forget_after_s; returns how many."""
        # NOTE: a sweep costs a pass over every rank: at most a few times per forget_after_s, not every cycle.
        self._next_sweep = now + min(60.0, self.forget_after_s / 4)
        gone = 0
        for held in self.samples.values():
            old = np.flatnonzero((held.count > 0) & (now - held.heard_at > self.forget_after_s))
            if old.size:
                held.forget(old)
                gone += old.size
        return gone

    def _make_room(self, now: float, new: dict[str, np.ndarray]) -> None:
        total = sum(int((held.count > 0).sum()) for held in self.samples.values())
        if total <= self.max_series:
            return
        total -= self.forget(now)
        if total <= self.max_series:
            return
        # NOTE: those heard of longest ago, a sixteenth of the room at a time, by one sort over every rank.
        chunk = max(1, self.max_series // 16)
        excess = -(-(total - self.max_series) // chunk) * chunk
        jobs = list(self.samples.values())
        slots = [np.flatnonzero(held.count > 0) for held in jobs]
        heard = np.concatenate([held.heard_at[s] for held, s in zip(jobs, slots)])
        owner = np.concatenate([np.full(s.size, i) for i, s in enumerate(slots)])
        where = np.concatenate(slots)
        oldest = np.argsort(heard, kind="stable")[:excess]
        for i, held in enumerate(jobs):
            gone = where[oldest[owner[oldest] == i]]
            if gone.size:
                held.forget(gone)
                if held.job in new:
                    new[held.job] = np.setdiff1d(new[held.job], gone)
        self.evicted += len(oldest)

    def jobs(self) -> dict[str, JobSamples]:
        """Per job, its samples (shared with the pool's other readers: not to be changed)."""
        return self.samples

    def keys(self) -> set[tuple[str, int]]:
        """(job, rank) of every rank the history knows (a pass in Python: for tests and tools, not every cycle)."""
        return {(job, int(r)) for job, held in self.samples.items() for r in held.rank[held.known()]}

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """make(), made once per cycle for all the detectors that share this history's pool under the same key
        (e.g. a job's phase table over the same window: straggler and collective_slowdown both read it)."""
        if self._shared is not None:
            return self._shared.memo(key, make)
        return make()

    def low_step(self, job: str) -> int:
        """The lowest newest step of the job's ranks (a job of `jobs()`)."""
        held = self.samples[job]
        return self.memo(("low_step", job), lambda: int(held.last_step[held.known()].min()))

    def job_names(self) -> set[str]:
        return set(self.samples)


class HistoryPool:
    """One RankHistory that the learning detectors of one healer share, updated once per detection cycle: the
    first detector to ask in a cycle (a TickView carrying the pool) updates it, the others get its new samples.
    Its keep is the largest any of them asked for; each reads only the samples it needs (the last one, or a window
    of the last ones), so a longer history does not change what they find."""

    def __init__(self, keep: int) -> None:
        self.history = RankHistory(keep=keep)
        self._view: weakref.ref[object] | None = None
        """The view this cycle's update was made on. NOTE: a weak reference: holding the last view kept the
        previous second's heartbeats alive until the next cycle, which then freed them (131,072 of them, ~0.2 s)."""
        self._new: dict[str, np.ndarray] = {}
        self._memo: dict[Hashable, object] = {}

    @classmethod
    def for_detectors(cls, detectors: Collection[object]) -> HistoryPool | None:
        """The pool for the detectors that keep a RankHistory (as `history`); None when none does."""
        keeps = [d.history.keep for d in detectors if isinstance(getattr(d, "history", None), RankHistory)]
        return cls(max(keeps)) if keeps else None

    def serves(self, history: RankHistory) -> bool:
        return (history.keep <= self.history.keep and history.forget_after_s == self.history.forget_after_s
                and history.max_series == self.history.max_series)

    def update(self, view: object, now: float) -> dict[str, np.ndarray]:
        if self._view is None or self._view() is not view:
            self._new = self.history._update(view, now)  # type: ignore[arg-type]  # noqa: SLF001 - its own update
            self._view, self._memo = weakref.ref(view), {}
        return self._new

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]  # type: ignore[return-value]


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
