"""The simulated hosts: which are in the job, spare or in repair, which are lemons, and when the next one fails.

Failures are one Poisson process over the fleet: every host fails at the record's per-host rate (a lemon at
`lemon_factor` times a normal host's, the rates scaled so that the fleet's mean rate stays the record's), and the
category of each failure is drawn in proportion to the record's counts. Hosts in repair do not fail. From
`change_at` on (when set), every rate is `change_scale` times the record's.
Only rates matter here; what a failure does to the job is sim/engine.py's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from sim.config import Category, Failures


class Where(enum.IntEnum):
    JOB = 0
    SPARE = 1
    REPAIR = 2


def host_name(i: int) -> str:
    return f"h{i:06d}"


@dataclass(slots=True)
class Failure:
    at: float
    host: int
    category: Category


class Fleet:
    def __init__(self, failures: Failures, job_nodes: int, spares: int, rng: np.random.Generator) -> None:
        self.failures = failures
        self.rng = rng
        n = job_nodes + spares
        self.where = np.full(n, Where.SPARE, dtype=np.int8)
        self.where[:job_nodes] = Where.JOB
        lemons = rng.random(n) < failures.lemon_fraction
        weight = np.where(lemons, failures.lemon_factor, 1.0)
        # NOTE: the record's counts include its lemons: normalised, the fleet fails at the record's mean rate.
        self.weight = weight / weight.mean()
        self.lemon = lemons
        self.names = [host_name(i) for i in range(n)]
        self._host_cdf = np.cumsum(self.weight)
        self._category_cdf = np.cumsum([c.count for c in failures.categories], dtype=float)
        self._total_rate = failures.rate_per_node * float(self.weight.sum())

    def __len__(self) -> int:
        return len(self.where)

    def hosts(self, where: Where) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.where == where)]

    def next_failure(self, now: float) -> Failure:
        """The fleet's next failure after `now`, on any host (the caller drops one on a host in repair: thinning a
        process over every host is the process over the hosts that can fail, whatever moves in between)."""
        change = self.failures.change_at.total_seconds() if self.failures.change_at is not None else None
        changed = change is not None and now >= change
        rate = self._total_rate * (self.failures.change_scale if changed else 1.0)
        at = now + float(self.rng.exponential(1.0 / rate))
        if change is not None and not changed and at > change:
            return self.next_failure(change)  # memoryless: from the change on, drawn at the new rate
        host = int(np.searchsorted(self._host_cdf, self.rng.random() * self._host_cdf[-1], side="right"))
        category = self.failures.categories[
            int(np.searchsorted(self._category_cdf, self.rng.random() * self._category_cdf[-1], side="right"))]
        return Failure(at, min(host, len(self.where) - 1), category)

    def recurrence(self, now: float, host: int, category: Category) -> Failure:
        """A broken host left in the job fails again."""
        return Failure(now + float(self.rng.exponential(self.failures.recur_after.total_seconds())), host, category)
