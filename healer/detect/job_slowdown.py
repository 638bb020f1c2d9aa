"""`job_slowdown`: the whole job trains slower than it did, and neither one rank (a straggler) nor the network (a
collective slowdown) explains it: power capping or thermal throttling on every GPU, a noisy neighbour on every
host, a data pipeline that got slower, a software regression after a restart. One finding per job, naming the
phase that grew.

The job's own throughput is its baseline: the median step time of its first `baseline_windows` windows after
`warmup_windows` (the first steps of an attempt compile, fill caches and allocate). A window is slow when its median
step time is more than `factor` x the baseline; `consecutive` slow windows fire. Each window's medians are over
2 x `window` samples of every rank, so a checkpoint save that stalls a step or two moves nothing. A new attempt
learns its baseline afresh (RankHistory.restarted): its layout, even its hosts, may differ, and its first steps are
warm-up again.

It leaves the other detectors' cases to them, so that one fault is one incident:
- a rank whose compute stands out (by `ratio` over the median) by as much time as the step grew: a straggler;
- the data-parallel reduce's transfer grew the most of the phases, and past the collective-slowdown detector's
  factor: the network (NOTE: whatever compute did meanwhile: network-triage, run beside the training for that
  incident, takes CPUs too).
The phase named is the one whose median grew the most in seconds: compute (forward, backward, optimizer), data
wait, the reduce, or `other` (what those do not cover: waits for the other pipeline stages' activations, the
gradient norm's all-reduce, a save's staging, the host's own work between phases).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.phases import PhaseTable, closed_windows, evidence_rows
from healer.observe.history import RankHistory, median, prune
from healer.observe.jobview import Readings

PHASES = ("compute", "data_wait", "reduce", "other")
NETWORK_FACTOR = 2.0
"""The transfer growth the collective-slowdown detector fires on (its default `factor`): past it, with compute flat,
the slowdown is the network's, and that detector's incident."""


@dataclass(slots=True)
class _Job:
    window_end: int
    seen: int = 0
    """Windows closed in this attempt (warm-up ones included)."""
    base: list[dict[str, float]] = field(default_factory=list)
    slow_windows: int = 0
    last: dict[str, object] = field(default_factory=dict)
    rows: PhaseTable | None = None
    evidence: list[dict[str, object]] | None = None


def window_phases(rows: PhaseTable) -> dict[str, float]:
    """A window's job-wide medians: the step, and the step cut into its phases. The reduce is the slowest stage's
    transfer (its smallest reduce time: what a rank that waits for nobody spends there); the rest of a rank's
    reduce time is waiting for a slower peer, counted where that peer spent it."""
    step = float(np.median(rows.step_s))
    compute = float(np.median(rows.compute_s))
    data = float(np.median(rows.data_wait_s))
    reduce = max(float(rows.dp_reduce_s[group].min()) for group in rows.stages())
    return {"step": step, "compute": compute, "data_wait": data, "reduce": reduce,
            "other": max(0.0, step - compute - data - reduce)}


class JobSlowdown(Detector):
    name = "job_slowdown"

    @dataclass(kw_only=True, slots=True)
    class Config:
        window: int = 5
        """Job steps per window."""
        warmup_windows: int = 1
        """Windows of each attempt left out of the baseline (the first steps compile and allocate)."""
        baseline_windows: int = 3
        """Windows that make the baseline before anything can fire."""
        factor: float = 1.5
        """Step time over the baseline that counts as a slowdown (1.5: the job trains at two thirds its speed)."""
        clear_factor: float = 1.2
        """Step time over the baseline under which the job is healthy again (at most `factor`)."""
        ratio: float = 1.3
        """A rank whose compute is this much over the median's explains the slowdown (the straggler detector's)."""
        consecutive: int = 3
        """Slow windows in a row before firing."""

        def __post_init__(self) -> None:
            if self.window < 2:
                raise ValueError(f"window must be >= 2, got {self.window}")
            if self.warmup_windows < 0 or self.baseline_windows < 1 or self.consecutive < 1:
                raise ValueError("warmup_windows must be >= 0, baseline_windows and consecutive >= 1, got "
                                 f"{self.warmup_windows}, {self.baseline_windows}, {self.consecutive}")
            if self.factor <= 1 or self.ratio <= 1:
                raise ValueError(f"factor and ratio must be > 1, got {self.factor}, {self.ratio}")
            if not 1 <= self.clear_factor <= self.factor:
                raise ValueError(f"clear_factor must be in [1, factor {self.factor}], got {self.clear_factor}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.history = RankHistory(keep=2 * config.window)
        self._jobs: dict[str, _Job] = {}

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        self.history.update(table, now)
        prune(self._jobs, self.history.job_names(), self.history.restarted)
        firing, healthy = [], set()
        for job, state, rows in closed_windows(self.history, self._jobs, lambda low: _Job(window_end=low),
                                               self.config.window):
            if not len(rows):
                continue
            state.seen += 1
            if state.seen <= self.config.warmup_windows:
                continue
            phases = window_phases(rows)
            if len(state.base) < self.config.baseline_windows:
                state.base.append(phases)
                continue
            base = {p: median([b[p] for b in state.base]) for p in ("step", *PHASES)}
            grew = {p: phases[p] - base[p] for p in PHASES}
            phase = max(grew, key=lambda p: grew[p])
            slow = phases["step"] > self.config.factor * base["step"] > 0 \
                and self._unexplained(rows, phases, base, phase)
            state.slow_windows = state.slow_windows + 1 if slow else 0
            state.last = {"step_s": round(phases["step"], 4), "baseline_step_s": round(base["step"], 4),
                          "factor": round(phases["step"] / base["step"], 2) if base["step"] > 0 else None,
                          "throughput": round(base["step"] / phases["step"], 3) if phases["step"] > 0 else None,
                          "phase": phase, "phase_grew_s": round(grew[phase], 4),
                          "phases_s": {p: round(phases[p], 4) for p in PHASES},
                          "baseline_phases_s": {p: round(base[p], 4) for p in PHASES}}
            state.rows, state.evidence = rows, None
            if phases["step"] <= self.config.clear_factor * base["step"]:
                healthy.add(job)
        for job, state in self._jobs.items():
            if state.slow_windows >= self.config.consecutive and state.rows is not None:
                if state.evidence is None:
                    state.evidence = evidence_rows(state.rows)
                last = state.last
                firing.append(Finding(
                    key=job, job=job, node=None,
                    summary=f"the whole job slower: {last['step_s']} s a step against its baseline of "
                            f"{last['baseline_step_s']} s (throughput x{last['throughput']}); {last['phase']} grew "
                            f"by {last['phase_grew_s']} s, on every rank alike",
                    evidence={**last, "windows": state.slow_windows, "window_steps": self.config.window,
                              "phase_table": state.evidence, "ranks_in_table": len(state.rows)}))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _unexplained(self, rows: PhaseTable, phases: dict[str, float], base: dict[str, float], grown: str) -> bool:
        """False where another detector's case explains the slowdown (see the module's docstring); `grown`: the
        phase that grew the most."""
        grew = phases["step"] - base["step"]
        top = float(rows.compute_s.max())
        if top > self.config.ratio * phases["compute"] and top - phases["compute"] >= grew:
            return False  # a straggler
        return not (grown == "reduce" and phases["reduce"] > NETWORK_FACTOR * base["reduce"])  # or the network
