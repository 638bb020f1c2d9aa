"""`healer_blind`: the healer hears from few of a job's hosts at once, one finding per job.

Every host's node agent posts a batch every second or so, whatever its ranks do. One host falling silent is that
host's fault (host_lost). Most of them falling silent together is far likelier the healer's own: its link is cut,
its process was paused, its report endpoint is flooded. Acting on that silence would exclude, drain and count as
lemons every host of the job until the restart budget paged; in a review of main it did. So while this finding
stands, the engine drops the findings of the silence detectors for the job (host_lost, heartbeat_stale, hang:
Healer.evaluate_detectors), and the shipped rule only tells on-call. It clears once enough hosts are heard again.

Blind, for a job whose current attempt runs on at least `min_hosts` hosts: more than `share` of them silent for
longer than `after`. A job of one host cannot tell its host's loss from the healer's blindness: host_lost decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.silence import host_silence
from healer.observe.jobview import Readings


class HealerBlind(Detector):
    name = "healer_blind"
    reads_processes = True
    blinds = True

    @dataclass(kw_only=True, slots=True)
    class Config:
        after: timedelta = timedelta(seconds=8)
        """Silence of a host that counts toward blindness: shorter than host_lost's `after` (15 s shipped) and the
        hang floor (10 s), so that the healer knows it is blind before it would act on the silence."""
        share: float = 0.5
        """More than this share of the job's hosts silent at once is blindness."""
        min_hosts: int = 2

        def __post_init__(self) -> None:
            if self.after <= timedelta(0):
                raise ValueError(f"after must be > 0, got {self.after}")
            if not 0 < self.share < 1:
                raise ValueError(f"share must be in (0, 1), got {self.share}")
            if self.min_hosts < 2:
                raise ValueError(f"min_hosts must be >= 2 (one host's silence is host_lost's), got {self.min_hosts}")

    config: Config

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        view = table.processes
        after = self.config.after.total_seconds()
        firing, healthy = [], set()
        for job in view.jobs():
            key = f"{job}/blind"
            if view.is_stopping(job):
                healthy.add(key)  # its silence is the healer's own doing
                continue
            silence = host_silence(table, job, now)
            silent = {n: s for n, s in silence.items() if s > after}
            if len(silence) < self.config.min_hosts or len(silent) <= self.config.share * len(silence):
                healthy.add(key)
                continue
            firing.append(Finding(
                key=key, job=job, node=None,
                summary=(f"the healer has heard from {len(silence) - len(silent)} of {len(silence)} hosts of {job} "
                         f"for over {after:.0f} s: its own link, process or report endpoint is the likelier fault; "
                         "no host is left out on this silence"),
                evidence={"silent_hosts": {n: round(s, 3) for n, s in sorted(silent.items())},
                          "heard_hosts": sorted(set(silence) - set(silent)), "after_s": after,
                          "share": self.config.share}))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))
