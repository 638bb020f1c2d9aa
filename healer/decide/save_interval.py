"""The save interval a job should run at, from the failures it has seen and what a save costs it.

A save every `t` of training costs the job its stall `d` each time, and a failure costs it the training since the
newest save, `t / 2` on average. With failures every `M` on average the overhead is about d/t + t/(2M), least at
Young's t = sqrt(2 d M); Daly's higher-order optimum (2006) corrects it where d is not small against M:

    t = sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + d / 18M) - d        (d < 2M; else t = M)

The job's M is not known in advance and changes (a bad batch of hosts, a fabric that degrades, an old fleet): it is
estimated from the failures the job has had over its last `window` of training. A few failures are noise, so the
estimate starts from the interval the job was configured with, as one failure's worth of evidence (a Gamma prior:
the configured interval is Young's optimum for M0 = t0^2 / 2d): M = (T + M0) / (n + 1) for n failures in T. The
interval moves toward the optimum at a save boundary, by at most `step` times per move, and not at all while the
optimum is within `dead_band` of the interval (each change is recorded, and a change of a few percent is not worth
a line in a person's timeline).

Pure: the healer's loop and the simulation (sim/engine.py) call the same function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True, slots=True)
class IntervalBounds:
    least: timedelta = timedelta(seconds=30)
    most: timedelta = timedelta(hours=2)
    window: timedelta = timedelta(days=7)
    """Failures older than this much training are forgotten: the estimate follows a failure rate that changes."""
    step: float = 2.0
    """The most one move changes the interval by (times or divided by)."""
    dead_band: float = 0.1
    """No move while the optimum is within this fraction of the interval."""

    def __post_init__(self) -> None:
        if not timedelta(0) < self.least <= self.most:
            raise ValueError(f"the interval's bounds must be 0 < least <= most, got {self.least} and {self.most}")
        if self.window <= timedelta(0):
            raise ValueError(f"window must be > 0, got {self.window}")
        if self.step <= 1.0:
            raise ValueError(f"step must be > 1, got {self.step}")
        if not 0.0 <= self.dead_band < 1.0:
            raise ValueError(f"dead_band must be in [0, 1), got {self.dead_band}")


@dataclass(frozen=True, slots=True)
class IntervalChange:
    interval_s: float
    previous_s: float
    mtbf_s: float
    """The failure interval the move aimed at (the estimate, prior included)."""
    stall_s: float
    failures: int
    """Failures in the window the estimate counted."""
    optimum_s: float

    @property
    def reason(self) -> str:
        return (f"{self.failures} failure(s) in the window: MTBF ~{_human(self.mtbf_s)}; a save stalls "
                f"{self.stall_s:.3g} s; the optimum is {_human(self.optimum_s)}; interval "
                f"{_human(self.previous_s)} -> {_human(self.interval_s)}")


def optimum(stall_s: float, mtbf_s: float) -> float:
    """Daly's optimum interval of training between saves for a stall `stall_s` and failures every `mtbf_s`."""
    if mtbf_s <= 0:
        raise ValueError(f"the MTBF must be > 0, got {mtbf_s}")
    if stall_s <= 0:
        return 0.0  # a free save: save at every chance (the bounds decide)
    if stall_s >= 2 * mtbf_s:
        return mtbf_s
    r = stall_s / (2 * mtbf_s)
    return math.sqrt(2 * stall_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - stall_s


def prior_mtbf(configured_s: float, stall_s: float) -> float:
    """The failure interval for which the configured interval is Young's optimum (what the estimate starts from)."""
    return configured_s * configured_s / (2 * stall_s) if stall_s > 0 else math.inf


def tune(current_s: float, *, configured_s: float, stall_s: float, failures_at: Sequence[float], trained_s: float,
         bounds: IntervalBounds) -> IntervalChange | None:
    """The interval to move to now, or None to keep `current_s`.

    `failures_at`: training time (seconds of it since the job began, not wall time) of each failure that cost the job
    its work since a save; `trained_s`: the training done so far, on the same clock."""
    if stall_s <= 0:
        return None  # nothing to trade: the stall was not measured yet
    window = bounds.window.total_seconds()
    since = max(0.0, trained_s - window)
    seen = sum(1 for t in failures_at if since <= t <= trained_s)
    prior = prior_mtbf(configured_s, stall_s)
    mtbf = (trained_s - since + prior) / (seen + 1)
    best = optimum(stall_s, mtbf)
    target = min(max(best, bounds.least.total_seconds()), bounds.most.total_seconds())
    if abs(target - current_s) <= bounds.dead_band * current_s:
        return None
    moved = min(max(target, current_s / bounds.step), current_s * bounds.step)
    return IntervalChange(interval_s=moved, previous_s=current_s, mtbf_s=mtbf, stall_s=stall_s, failures=seen,
                          optimum_s=best)


def _human(seconds: float) -> str:
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"
