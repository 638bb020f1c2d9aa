"""What each incident cost, in lost GPU-time: the ranks of the job times the seconds of the goodput ledger that the
incident took (healer/ledger/goodput.py).

The ledger names the incident of its detection, diagnosis and restart intervals and of the work that its restart
made lost; the startup of the attempt its restart began (imports, rendezvous, checkpoint load) is the incident's
too, matched by the attempt's start time (the restart's `started_at` is the attempts' journal time).

Time the job went on training is productive in the ledger, but a straggler (or a collective slowdown) made every
rank's steps longer while it lasted: its Slowdown, counted from the step records where the run directory is known,
is the excess of each step over the median step before it began, summed over the steps it lasted, times every
rank of the attempt (in a synchronous job the slowest rank sets every rank's pace).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from healer.ledger.goodput import Interval

PARTS = ("detection", "diagnosis", "restart", "lost", "startup")
SLOWDOWN_KINDS = frozenset({"straggler", "collective_slowdown", "job_slowdown"})
"""Kinds whose cost is the time they added to steps the job went on running."""
SAME_START_S = 0.01
"""A startup interval begins at its attempt's start; the database keeps microseconds."""


class Step(Protocol):
    """A step record as a slowdown reads it (healer.pages.rundir.StepRecord)."""

    @property
    def step(self) -> int: ...
    @property
    def time(self) -> float: ...
    @property
    def step_seconds(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Slowdown:
    """The time a slowdown added to the steps it lasted, from one rank's step records."""

    baseline_s: float
    """The median step before it began."""
    first_step: int
    last_step: int
    steps: int
    excess_s: float
    """The sum over those steps of what each took past baseline_s."""


@dataclass(frozen=True, slots=True)
class Cost:
    seconds: dict[str, float] = field(default_factory=dict)
    """Per part of PARTS, the ledger's seconds."""
    ranks: int | None = None
    """The ranks of the attempt the incident happened in (None: not known, e.g. no run directory)."""
    slowdown: Slowdown | None = None
    """A straggler's: the time it added to the steps it lasted (None: not a slowdown, or no step records)."""
    until: float | None = None
    """When the last of its seconds in the ledger ended (None: the ledger charged it none): when it was over."""

    @property
    def ledger_s(self) -> float:
        """The ledger's seconds charged: of the job's unproductive time, this incident's (a slowdown's is not in it:
        the job trained)."""
        return sum(self.seconds.values())

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values()) + (self.slowdown.excess_s if self.slowdown is not None else 0.0)

    @property
    def gpu_seconds(self) -> float | None:
        return self.ranks * self.total_s if self.ranks is not None else None


def incident_costs(spans: Iterable[Interval], restarts: Iterable[tuple[int, float]],
                   ranks: dict[int, int | None]) -> dict[int, Cost]:
    """Per incident id of `ranks` (incident -> its attempt's rank count), its Cost. `spans`: the ledger's intervals;
    `restarts`: (incident id, start time of the attempt its restart began)."""
    seconds: dict[int, dict[str, float]] = {i: dict.fromkeys(PARTS, 0.0) for i in ranks}
    until: dict[int, float] = {}
    spans = list(spans)

    def charge(incident: int, part: str, span: Interval) -> None:
        seconds[incident][part] += span.seconds
        until[incident] = max(until.get(incident, span.end), span.end)

    for span in spans:
        if span.incident is not None and span.incident in seconds and span.kind in PARTS:
            charge(span.incident, span.kind, span)
    startups = [s for s in spans if s.kind == "startup"]
    for incident, started in restarts:
        if incident not in seconds:
            continue
        for span in startups:
            if abs(span.start - started) < SAME_START_S:
                charge(incident, "startup", span)
    return {i: Cost({k: round(v, 3) for k, v in parts.items()}, ranks[i],
                    until=round(until[i], 3) if i in until else None) for i, parts in seconds.items()}


def slowdown(records: Sequence[Step], incident: dict[str, Any], ended_at: float | None) -> Slowdown | None:
    """The Slowdown of a straggler-like `incident` (detected_at, resolved_at, evidence: windows, window_steps) from
    the step records of one rank of the attempt it happened in, in time order; `ended_at`: the attempt's end. It
    began where the detector's windows began (`windows` x `window_steps` steps before the detection; the detection
    itself where the evidence does not say) and lasted until the incident was resolved or the attempt ended. None
    where no step ran before it began (nothing to compare with) or none in it."""
    detected = incident["detected_at"]
    ev = incident.get("evidence") or {}
    windows, width = ev.get("windows"), ev.get("window_steps")
    back = windows * width if isinstance(windows, int) and isinstance(width, int) else 0
    seen = [i for i, r in enumerate(records) if r.time <= detected]
    if not seen:
        return None
    begin = max(seen[-1] - back + 1, 1)  # NOTE: never the attempt's first step: it holds the warm-up
    ends = [t for t in (incident.get("resolved_at"), ended_at) if t is not None]
    end = min(ends) if ends else float("inf")
    before = [r.step_seconds for r in records[1:begin]]
    during = [r for r in records[begin:] if r.time <= end]
    if not before:
        # NOTE: the detector's windows are of the job's steps, and a loaded machine's slow rank can be named before
        # `back` of its own steps ran slow (a fresh make test: slowed from step 5, named at its step 6): its window
        # then reaches back to the attempt's start. The faster half of its steps until the detection stands for the
        # pace before: the slowdown cannot have been more than half of them, or nothing would have stood out.
        seen_steps = sorted(r.step_seconds for r in records[1:seen[-1] + 1])
        before = seen_steps[:len(seen_steps) // 2]
    if not before or not during:
        return None
    base = statistics.median(before)
    excess = sum(max(0.0, r.step_seconds - base) for r in during)
    return Slowdown(round(base, 4), during[0].step, during[-1].step, len(during), round(excess, 3))
