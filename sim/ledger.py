"""Where the job's GPU time went, in GPU-seconds of the job's own GPUs (spares are not the job's until they join).

    productive        training whose result was kept
    lost_work         training that a restart threw away (back to the checkpoint it resumed from)
    checkpoint_stall  the blocking part of each save
    degraded          GPUs of hosts the job is short of while it trains smaller
    detection, diagnosis, restart, person, planned
                      the whole job waiting: for the fault to be noticed, for its diagnosis (the stop of the
                      attempt included), for the restart to train again, for a person after a page, for a
                      planned maintenance

The categories add up to wall x GPUs (`check` asserts it): nothing is counted twice or left out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

CATEGORIES = ("productive", "lost_work", "checkpoint_stall", "degraded", "detection", "diagnosis", "restart",
              "person", "planned")
LOSSES = CATEGORIES[1:]


@dataclass(slots=True)
class Ledger:
    gpus: int
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    """Category -> GPU-seconds."""
    by_cause: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    """Failure category -> loss category -> GPU-seconds it cost (detection to recovery, and its lost work)."""

    def add(self, category: str, gpu_seconds: float, cause: str | None = None) -> None:
        if category not in self.seconds:
            raise KeyError(f"unknown ledger category {category!r}")
        if gpu_seconds < -1e-6:
            raise ValueError(f"{category}: negative time {gpu_seconds}")
        self.seconds[category] += gpu_seconds
        if cause is not None:
            self.by_cause[cause][category] += gpu_seconds

    def total(self) -> float:
        return sum(self.seconds.values())

    def ettr(self, wall_s: float) -> float:
        return self.seconds["productive"] / (wall_s * self.gpus)

    def check(self, wall_s: float) -> None:
        """Conservation: the categories add up to the job's GPU time."""
        want = wall_s * self.gpus
        if abs(self.total() - want) > 1e-6 * want:
            raise AssertionError(f"ledger {self.total():.6g} GPU-s != wall x GPUs {want:.6g}: {self.seconds}")

    def gpu_hours(self) -> dict[str, float]:
        return {k: round(v / 3600.0, 3) for k, v in self.seconds.items()}

    def causes_gpu_hours(self) -> dict[str, dict[str, float]]:
        return {cause: {k: round(v / 3600.0, 3) for k, v in cats.items()} for cause, cats in sorted(self.by_cause.items())}
