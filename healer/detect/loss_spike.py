"""`loss_spike`: a loss far above its recent level, by a robust z-score, one finding per job.

z = (loss - median) / (1.4826 x MAD) over the previous `window` losses of the job (the lowest rank's
reports: every rank logs the same, all-reduced loss). Median and MAD shrug off the spike itself and the
odd outlier that a mean and a standard deviation would chase. A spike is a z above `threshold` with the
loss above the median; only upward jumps count. The finding names the first spiking step, which the
rollback remediation needs (restore a checkpoint before it, skip the batches that caused it). It stays
firing until `clear_after` losses in a row past the spike are calm, or the job is rolled back before it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding
from healer.observe.history import JobSamples, RankHistory, median, prune
from healer.observe.jobview import Readings

MAD_TO_SIGMA = 1.4826


def robust_z(value: float, window: list[float], min_mad: float) -> tuple[float, float, float]:
    """(z, median, mad) of value against window; the MAD is floored at min_mad so a flat window cannot make
    every wiggle a spike."""
    med = median(window)
    mad = max(median([abs(x - med) for x in window]), min_mad)
    return (value - med) / (MAD_TO_SIGMA * mad), med, mad


@dataclass(slots=True)
class _Lead:
    """A job's lowest rank and its last (step, loss) pairs."""

    rank: int
    node: str
    losses: deque[tuple[int, float | None]]
    last: int = 0
    """How many samples of the rank the history had added when it was followed last (JobSamples.written)."""


@dataclass(slots=True)
class _Spike:
    step: int
    loss: float
    z: float
    median: float
    mad: float
    node: str
    rank: int
    calm: int = 0
    """Losses past the spike in a row that were not spikes."""


class LossSpike(Detector):
    name = "loss_spike"

    @dataclass(kw_only=True, slots=True)
    class Config:
        window: int = 20
        """Losses before the current one that make the baseline."""
        min_samples: int = 8
        """Losses needed before a spike can be called."""
        threshold: float = 6.0
        """Robust z-score above which a loss is a spike."""
        min_mad: float = 0.01
        """Floor of the MAD, in loss units."""
        clear_after: int = 5
        """Calm losses in a row past the spike before it counts as over (a spike that lasts is still one)."""

        def __post_init__(self) -> None:
            if self.window < 3:
                raise ValueError(f"window must be >= 3, got {self.window}")
            if not 3 <= self.min_samples <= self.window:
                raise ValueError(f"min_samples must be in 3..window, got {self.min_samples}")
            if self.clear_after < 1:
                raise ValueError(f"clear_after must be >= 1, got {self.clear_after}")
            if self.threshold <= 0 or self.min_mad <= 0:
                raise ValueError(f"threshold and min_mad must be > 0, got {self.threshold}, {self.min_mad}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # NOTE: the job's losses are the lowest rank's, kept here (`_leads`), as deep as a spike that lasts needs. The
        # rank history is the healer's shared one, which keeps its depth for every rank: asking it for this one's
        # (46 by default) kept 46 samples of each of 131,072 ranks to read one rank's.
        self.history = RankHistory(keep=1)
        self._keep = 2 * config.window + config.clear_after + 1
        self._leads: dict[str, _Lead] = {}
        self._spikes: dict[str, _Spike] = {}

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        firing, healthy = [], set()
        self.history.update(table, now)
        prune(self._spikes, self.history.job_names(), self.history.restarted)
        prune(self._leads, self.history.job_names(), self.history.restarted)
        for job, held in self.history.jobs().items():
            lead = int(held.known()[0])  # the lowest rank's slot
            spike = self._spikes.get(job)
            # NOTE: the lead's newest sample, when it came since it was followed last: not every rank's (131,072).
            track = self._leads.get(job)
            if track is None or track.rank != held.rank[lead] or track.last != held.written[lead]:
                spike = self._observe(job, self._follow(job, held, lead), spike)
            if spike is None:
                healthy.add(job)
                continue
            firing.append(Finding(
                key=job, job=job, node=None,
                summary=f"loss spike at step {spike.step}: {spike.loss:.4g} against a median of {spike.median:.4g} "
                        f"(robust z {spike.z:.1f} > {self.config.threshold})",
                first_bad_step=spike.step, evidence={"loss": spike.loss, "median": spike.median, "mad": spike.mad,
                          "z": round(spike.z, 2), "threshold": self.config.threshold, "window": self.config.window,
                          "rank": spike.rank},
                labels={"first_step": str(spike.step)}))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _follow(self, job: str, held: JobSamples, lead: int) -> _Lead:
        """The job's lead losses with the lead's newest sample, dropped from a lower step on as the rank history
        drops samples (a restart or rollback: those steps are redone)."""
        track = self._leads.get(job)
        rank, node, written = int(held.rank[lead]), held.node_of(lead), int(held.written[lead])
        if track is None or track.rank != rank:  # first seen, or another rank is the lowest now
            track = self._leads[job] = _Lead(rank, node, deque(
                ((int(x["step"] or 0), x["loss"]) for x in held.samples_of(lead)), maxlen=self._keep), written)
            return track
        step = int(held.last_step[lead])
        loss = float(held.newest("loss", np.array([lead]))[0])
        while track.losses and track.losses[-1][0] >= step:
            track.losses.pop()
        track.losses.append((step, None if loss != loss else loss))  # NaN: the record had no loss
        track.node, track.last = node, written
        return track

    def _observe(self, job: str, lead: _Lead, spike: _Spike | None) -> _Spike | None:
        losses = [(step, loss) for step, loss in lead.losses if loss is not None]
        if len(losses) < self.config.min_samples + 1 or lead.losses[-1][1] is None:
            return spike
        step, loss = losses[-1]
        if spike is not None and step < spike.step:
            del self._spikes[job]  # rolled back to before the spike: the redone steps are judged afresh
            spike = None
        # NOTE: the baseline leaves out losses from the spike on, so that a long spike cannot become the norm.
        base = [v for st, v in losses[:-1] if spike is None or st < spike.step][-self.config.window:]
        if len(base) < self.config.min_samples:
            return spike
        z, med, mad = robust_z(loss, base, self.config.min_mad)
        if z > self.config.threshold:
            if spike is None or step <= spike.step:
                spike = self._spikes[job] = _Spike(step, loss, z, med, mad, lead.node, lead.rank)
            spike.calm = 0
        elif spike is not None and step > spike.step:
            spike.calm += 1
            if spike.calm >= self.config.clear_after:
                del self._spikes[job]
                return None
        return spike
