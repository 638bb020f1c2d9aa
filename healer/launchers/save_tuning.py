"""The job's save and snapshot intervals, tuned by the failures it has (healer/decide/save_interval.py) and applied
at its restarts: megaheal's trainer takes `checkpoint.every_steps` and `snapshot_every_steps` as `--set` items of a
cold attempt, and from a warm generation's plan (wire/warm_plan.py): no new channel into a running trainer, and a
restart is a save boundary (every rank resumes from a save or a snapshot).

What it measures, from rank 0's step records (every step, wire/step_record.py) of the last hour before a restart:
the median step, and the `checkpoint` phase of the steps that saved (the save's stall) and of those that only took a
snapshot (the snapshot's). Its failures are the job's restarts that lost work (not a replica group's, not a planned
grow): every one counts for the snapshots (what a warm restart resumes from), those that resumed from the disk for
the saves; with no warm pool every one counts for the saves. Their clock is the wall time since the job started
(close to the training time at the ETTR this is for). Every move is journalled (wire/journal.py `Retuned`) with why.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from healer.decide.save_interval import IntervalBounds, IntervalChange, tune
from healer.launchers import rank_records
from wire.journal import Retuned
from wire.step_record import StepRecord

log = logging.getLogger(__name__)

MEASURE_WINDOW_S = 3600.0
"""How far back before a restart the step records are read for the step time and the stalls."""
MIN_SAMPLES = 2
"""Saves (or snapshots) measured before their stall is trusted: until then that interval is not moved."""


@dataclass(frozen=True, slots=True)
class Intervals:
    every_steps: int
    """checkpoint.every_steps: a save every this many steps."""
    snapshot_every_steps: int | None
    """snapshot_every_steps under a warm pool (None: the job keeps no snapshots apart from its saves)."""

    def overrides(self) -> tuple[str, ...]:
        items = (f"checkpoint.every_steps={self.every_steps}",)
        return items + ((f"snapshot_every_steps={self.snapshot_every_steps}",)
                        if self.snapshot_every_steps is not None else ())


@dataclass(frozen=True, slots=True)
class Move:
    what: str
    """save or snapshot."""
    steps: int
    previous_steps: int
    change: IntervalChange


@dataclass(slots=True)
class SaveTuning:
    configured: Intervals
    bounds: IntervalBounds = field(default_factory=IntervalBounds)
    started_at: float = 0.0
    """Wall time of the job's start: the failures' clock counts from it."""
    now: Intervals | None = None
    """The intervals in force (None: the configured ones)."""
    failures: list[float] = field(default_factory=list)
    disk_failures: list[float] = field(default_factory=list)

    @property
    def current(self) -> Intervals:
        return self.now or self.configured

    def failed(self, at: float, *, from_disk: bool) -> None:
        """A restart that lost the work since a save or a snapshot, at wall time `at`."""
        self.failures.append(at - self.started_at)
        if from_disk:
            self.disk_failures.append(at - self.started_at)

    def overrides(self) -> tuple[str, ...]:
        """The `--set` items of the next attempt (nothing until a move)."""
        return () if self.now is None else self.now.overrides()

    def at_restart(self, run_dir: Path, attempt: tuple[int, float] | None, *, warm: bool,
                   journal: Callable[[Retuned], None]) -> None:
        """A restart of the job that loses the work since a snapshot (`warm`) or a save: the failure counted, the
        intervals moved from the stalls the failed `attempt` (number, start) measured, each move journalled for the
        next attempt. Nothing here holds up the restart: an unreadable record leaves the intervals as they are."""
        now = time.time()
        self.failed(now, from_disk=not warm)
        number, started = attempt if attempt is not None else (None, now)
        try:
            records = rank_records.rank0_steps(run_dir, max(started, now - MEASURE_WINDOW_S), attempt=number)
            moves = self.retune(records, now)
        except (OSError, ValueError) as exc:
            log.warning("the save intervals were not tuned: %s", exc)
            return
        for move in moves:
            log.info("%s interval every %d steps (was %d): %s", move.what, move.steps, move.previous_steps,
                     move.change.reason)
            journal(Retuned(at=now, attempt=number + 1 if number is not None else 0, what=move.what,
                            steps=move.steps, previous_steps=move.previous_steps, why=move.change.reason))

    def retune(self, records: Sequence[StepRecord], at: float) -> list[Move]:
        """Move the intervals toward the optimum for the failures so far, from the stalls `records` show; the moves
        made (none while a stall is not measured yet)."""
        step_s, save_s, snap_s = measure(records, self.current)
        if step_s is None:
            return []
        cur, conf = self.current, self.configured
        trained = at - self.started_at
        moves: list[Move] = []
        snapshot_steps = cur.snapshot_every_steps
        if snapshot_steps is not None and conf.snapshot_every_steps is not None and snap_s is not None:
            change = tune(snapshot_steps * step_s, configured_s=conf.snapshot_every_steps * step_s, stall_s=snap_s,
                          failures_at=self.failures, trained_s=trained, bounds=self.bounds)
            if change is not None and (steps := max(1, round(change.interval_s / step_s))) != snapshot_steps:
                moves.append(Move("snapshot", steps, snapshot_steps, change))
                snapshot_steps = steps
        every = cur.every_steps
        if save_s is not None:
            failures = self.disk_failures if conf.snapshot_every_steps is not None else self.failures
            change = tune(every * step_s, configured_s=conf.every_steps * step_s, stall_s=save_s,
                          failures_at=failures, trained_s=trained, bounds=self.bounds)
            if change is not None and (steps := max(1, round(change.interval_s / step_s))) != every:
                moves.append(Move("save", steps, every, change))
                every = steps
        if moves:
            self.now = Intervals(every_steps=every, snapshot_every_steps=snapshot_steps)
        return moves


def measure(records: Sequence[StepRecord], intervals: Intervals) -> tuple[float | None, float | None, float | None]:
    """(median step, mean save stall, mean snapshot stall) in seconds from rank 0's records; None for what they do
    not show (fewer than MIN_SAMPLES of it). The trainer saves and snapshots after step s when (s + 1) is a
    multiple of the interval, inside the step's `checkpoint` phase."""
    plain, saves, snaps = [], [], []
    for r in records:
        done = r.step + 1
        stall = r.phases.get("checkpoint", 0.0)
        if done % intervals.every_steps == 0:
            saves.append(stall)
        elif intervals.snapshot_every_steps and done % intervals.snapshot_every_steps == 0:
            snaps.append(stall)
        else:
            plain.append(r.step_seconds - stall)
    if not plain:
        return None, None, None
    return (statistics.median(plain), statistics.fmean(saves) if len(saves) >= MIN_SAMPLES else None,
            statistics.fmean(snaps) if len(snaps) >= MIN_SAMPLES else None)
