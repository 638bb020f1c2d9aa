"""`nonfinite`: NaN or Inf in a rank's loss or grad norm, one finding per job, naming the first step and the
ranks that saw it. The heartbeat carries a non-finite value as null with `nonfinite` saying which it was.
Healthy once every rank of the job reports finite values at a step after the last bad one, or once the job
was rolled back to before the first bad step (the redone steps are judged afresh).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.suspects import Suspect, on_hosts
from healer.observe.history import RankHistory, prune
from healer.observe.jobview import Readings


PROGRAM_SETTLE = timedelta(seconds=1.5)
"""`settle` for a user's program (healer/runner/build.py), which records its steps nowhere megaheal reads: above the
heartbeat interval (1 s)."""


@dataclass(slots=True)
class _Bad:
    first_step: int
    last_step: int
    seen_at: float
    """Healer time of the first sight (the finding waits `settle` past it)."""
    ranks: dict[int, dict[str, str]] = field(default_factory=dict)
    first_of: dict[int, int] = field(default_factory=dict)
    """rank -> the first step it was seen non-finite at."""
    nodes: set[str] = field(default_factory=set)
    fired: bool = False
    """Reported once: from then on a job that trains on with finite values is healthy again."""


class NonFinite(Detector):
    name = "nonfinite"

    @dataclass(kw_only=True, slots=True)
    class Config:
        fields: tuple[str, ...] = ("loss", "grad_norm")
        """Which values are watched."""
        settle: timedelta = timedelta(0)
        """How long after the first sight the finding waits for the other hosts' batches: each carries its ranks'
        first non-finite step (exporters/ranks.py), and a NaN on one rank reaches the others a step later, through
        the gradient reduce. Then the first bad step (what a rollback goes back before) and the rank it began on are
        the job's, not those of the host whose batch came first. 0 for megaheal's trainer, whose every step is on
        disk (the first bad one is read from there): the job trains on, and saves, while the finding waits, and a
        save can push out the checkpoint the rollback needs; `megaheal run SCRIPT` sets PROGRAM_SETTLE."""

        def __post_init__(self) -> None:
            if self.settle < timedelta(0):
                raise ValueError(f"settle must be >= 0, got {self.settle}")
            unknown = set(self.fields) - {"loss", "grad_norm"}
            if not self.fields or unknown:
                raise ValueError(f"fields must be some of loss, grad_norm, got {list(self.fields)}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.history = RankHistory(keep=4)
        self._bad: dict[str, _Bad] = {}

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        new = self.history.update(table, now)
        prune(self._bad, self.history.job_names(), self.history.restarted)
        fields = self.config.fields
        samples = self.history.jobs()
        columns = table.columns()
        for job, slots in new.items():
            held = samples[job]
            flagged = held.newest("nonfinite", slots)
            bad = self._bad.get(job)
            if not flagged.any() and bad is None:
                continue  # NOTE: the common case, one vectorised test per job (131,072 new samples at the largest)
            steps = held.newest("step", slots)
            if bad is not None and (steps[~flagged] < bad.first_step).any():
                # Rolled back to before the bad steps: what comes next is judged afresh (a NaN that comes back
                # is a new finding, not this one still open).
                del self._bad[job]
            beats = columns[job].beats
            for slot, step in zip(slots[flagged].tolist(), steps[flagged].tolist()):
                beat = beats[slot]
                which = {k: v for k, v in beat.entry.nonfinite.items() if k in fields} if beat is not None else {}
                if not which:
                    continue
                bad = self._bad.get(job)
                if bad is None:
                    bad = self._bad[job] = _Bad(first_step=step, last_step=step, seen_at=now)
                bad.first_step = min(bad.first_step, step)
                bad.last_step = max(bad.last_step, step)
                rank = int(held.rank[slot])
                bad.ranks[rank] = which
                bad.first_of[rank] = min(bad.first_of.get(rank, step), step)
                bad.nodes.add(held.node_of(slot))
        firing, healthy = [], set()
        for job, held in samples.items():
            bad = self._bad.get(job)
            if bad is None:
                healthy.add(job)
                continue
            if not bad.fired and now - bad.seen_at < self.config.settle.total_seconds():
                continue  # the other hosts' first bad steps may still be on their way (reported even if it passed)
            slots = held.known()
            recovered = bool(np.all((held.newest("step", slots) > bad.last_step)
                                    & ~held.newest("nonfinite", slots)))
            if recovered and bad.fired:
                del self._bad[job]
                healthy.add(job)
                continue
            bad.fired = True
            # The ranks it began on: those non-finite at the first bad step (the others followed through the reduce).
            bad_ranks = sorted(r for r, first in bad.first_of.items() if first == bad.first_step)
            nodes = sorted(bad.nodes)
            kinds = sorted({f"{name}={value}" for which in bad.ranks.values() for name, value in which.items()})
            firing.append(Finding(
                key=job, job=job, node=nodes[0] if len(nodes) == 1 else None,
                summary=f"non-finite {', '.join(kinds)} from step {bad.first_step} on rank(s) "
                        f"{', '.join(map(str, bad_ranks[:16]))}",
                first_bad_step=bad.first_step, evidence={"last_step": bad.last_step,
                          "values": {str(r): v for r, v in bad.ranks.items()}},
                labels={"first_step": str(bad.first_step)},
                suspects=(*(Suspect(rank=r) for r in bad_ranks), *on_hosts(nodes))))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

