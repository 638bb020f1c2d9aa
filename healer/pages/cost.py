"""What each incident cost, in lost GPU-time: the ranks of the job times the seconds of the goodput ledger that the
incident took (healer/ledger/goodput.py).

The ledger names the incident of its detection, diagnosis and restart intervals and of the work that its restart
made lost; the startup of the attempt its restart began (imports, rendezvous, checkpoint load) is the incident's
too, matched by the attempt's start time (the restart's `started_at` is the attempts' journal time). Time the
job went on training (a straggler's slow steps) is productive in the ledger and not counted here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from healer.ledger.goodput import Interval

PARTS = ("detection", "diagnosis", "restart", "lost", "startup")
SAME_START_S = 0.01
"""A startup interval begins at its attempt's start; the database keeps microseconds."""


@dataclass(frozen=True, slots=True)
class Cost:
    seconds: dict[str, float] = field(default_factory=dict)
    """Per part of PARTS, the ledger's seconds."""
    ranks: int | None = None
    """The ranks of the attempt the incident happened in (None: not known, e.g. no run directory)."""

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def gpu_seconds(self) -> float | None:
        return self.ranks * self.total_s if self.ranks is not None else None


def incident_costs(spans: Iterable[Interval], restarts: Iterable[tuple[int, float]],
                   ranks: dict[int, int | None]) -> dict[int, Cost]:
    """Per incident id of `ranks` (incident -> its attempt's rank count), its Cost. `spans`: the ledger's intervals;
    `restarts`: (incident id, start time of the attempt its restart began)."""
    seconds: dict[int, dict[str, float]] = {i: dict.fromkeys(PARTS, 0.0) for i in ranks}
    spans = list(spans)
    for span in spans:
        if span.incident in seconds and span.kind in PARTS:
            seconds[span.incident][span.kind] += span.seconds
    startups = [s for s in spans if s.kind == "startup"]
    for incident, started in restarts:
        if incident not in seconds:
            continue
        for span in startups:
            if abs(span.start - started) < SAME_START_S:
                seconds[incident]["startup"] += span.seconds
    return {i: Cost({k: round(v, 3) for k, v in parts.items()}, ranks[i]) for i, parts in seconds.items()}
