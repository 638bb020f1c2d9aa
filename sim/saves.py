"""The simulated job's training between two interruptions, closed-form (mixed into Simulation, sim/engine.py): a
snapshot every `snapshot_interval` of training and a save every `interval` (every k-th snapshot a save), each
stalling it, and with `tuning.enabled` both intervals moved at each attempt's start by the healer's own rule
(healer/decide/save_interval.py). No event is needed per step, per snapshot or per save.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from healer.decide.save_interval import tune

if TYPE_CHECKING:
    from sim.engine import Simulation

KEEP_CHECKPOINTS = 5


@dataclass(slots=True)
class Segment:
    """The job training since `start` from `p0`, `hosts` of its `size` running (speed hosts/size): a snapshot every
    `snap` of training, each stalling it `snap_stall`, and every `every`-th of them a save, stalling it `save_stall`
    instead (without snapshots: every = 1, each snapshot is a save)."""

    start: float
    p0: float
    hosts: int
    size: int
    snap: float
    every: int
    snap_stall: float
    save_stall: float

    @property
    def speed(self) -> float:
        return self.hosts / self.size


class SaveCadence:
    @property
    def _snapshots(self: Simulation) -> bool:
        """The job keeps in-memory snapshots between its saves (a warm job with checkpoint.snapshot_interval; the
        analytic baseline has saves only)."""
        return self.cfg.policy and self.cfg.restart == "warm" and self.cfg.checkpoint.snapshot_interval is not None

    def _start_training(self: Simulation) -> None:
        self._retune()
        ck = self.cfg.checkpoint
        every = max(1, round(self.save_s / self.snap_s)) if self._snapshots else 1
        self.segment = Segment(self.now, self.progress, len([h for h in self.hosts if h not in self.out]), self.size,
                                snap=self.snap_s, every=every, snap_stall=ck.snapshot_stall.total_seconds(),
                                save_stall=ck.stall.total_seconds())
        self.last_restart_warm_untrained = False
        for host, cat in self.broken.items():
            self._recur(host, cat)

    def _retune(self: Simulation) -> None:
        """tuning.enabled: each interval moved toward the optimum for the failures that resume from it: the
        snapshots' by every restart that lost work, the saves' by those that resumed from a save (without
        snapshots, the saves are what every restart resumes from)."""
        tuning, ck = self.cfg.tuning, self.cfg.checkpoint
        if not tuning.enabled or not self.cfg.policy:
            return  # NOTE: the analytic baseline's closed forms are of fixed saves
        if self._snapshots:
            assert ck.snapshot_interval is not None
            self.snap_s = self._moved("snapshot", self.snap_s, ck.snapshot_interval.total_seconds(),
                                      ck.snapshot_stall.total_seconds(), self.lossy_restarts)
            self.save_s = self._moved("save", self.save_s, ck.interval.total_seconds(), ck.stall.total_seconds(),
                                      self.disk_restarts)
        else:
            self.save_s = self.snap_s = self._moved("save", self.save_s, ck.interval.total_seconds(),
                                                    ck.stall.total_seconds(), self.lossy_restarts)

    def _moved(self: Simulation, what: str, current: float, configured: float, stall: float, failures: list[float]) -> float:
        change = tune(current, configured_s=configured, stall_s=stall, failures_at=failures, trained_s=self.progress,
                      bounds=self.cfg.tuning.bounds())
        if change is None:
            return current
        self.interval_changes.append({"at_day": round(self.now / 86400.0, 3), "what": what,
                                      "from_s": round(change.previous_s, 1), "to_s": round(change.interval_s, 1),
                                      "why": change.reason})
        return change.interval_s

    def _close_training(self: Simulation, t: float) -> None:
        """Stop the training segment at `t`: its work, stalls, snapshots and saves into the ledger and the
        checkpoints. A cycle is `every` snapshots, the last of them a save."""
        seg = self.segment
        if seg is None:
            return
        self.segment = None
        persist = self.cfg.checkpoint.persist.total_seconds()
        elapsed = t - seg.start
        k, s = seg.every, seg.snap
        cycle = k * s + (k - 1) * seg.snap_stall + seg.save_stall
        saves = int(elapsed // cycle)
        rest = elapsed - saves * cycle
        more = min(k - 1, int(rest // (s + seg.snap_stall)))  # snapshots since the last save, none of them a save
        rest -= more * (s + seg.snap_stall)
        work = (saves * k + more) * s + min(rest, s)
        stalled = saves * ((k - 1) * seg.snap_stall + seg.save_stall) + more * seg.snap_stall + max(0.0, rest - s)
        newest_durable = int((elapsed - persist) // cycle)  # a long persist: it may be older than the last saves
        for j in sorted({*range(max(1, saves - KEEP_CHECKPOINTS + 1), saves + 1), *([newest_durable]
                                                                                    if newest_durable >= 1 else [])}):
            done = seg.start + j * cycle
            self.durable.append((seg.p0 + seg.speed * j * k * s, done + persist))
        # Retention: the newest saves, and always the newest one already durable (what a cold restart would take).
        durable_now = max(i for i, (_, ready) in enumerate(self.durable) if ready <= t)
        del self.durable[:max(0, min(durable_now, len(self.durable) - KEEP_CHECKPOINTS))]
        if saves or more:
            self.memory = seg.p0 + seg.speed * (saves * k + more) * s
        self.progress = seg.p0 + seg.speed * work
        self.ledger.add("checkpoint_stall", stalled * seg.hosts * self.gpn)
        self.ledger.add("degraded", elapsed * (seg.size - seg.hosts) * self.gpn)

    def _durable_at(self: Simulation, t: float) -> float:
        """The newest checkpoint durable at `t` (a cold restart resumes from it)."""
        ready = [p for p, when in self.durable if when <= t]
        if not ready:
            raise AssertionError(f"no checkpoint durable at {t:.0f} s among {self.durable}")
        return max(ready)
