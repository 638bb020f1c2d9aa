"""`hang`: a job whose slowest rank has made no step progress for longer than max(floor, k x p99 step time).

The p99 is learned online from the step times the ranks report (checkpoint steps included, so a slow save
is not a hang); until `min_samples` steps are seen the floor alone applies. Progress is the lowest step of
the job's ranks: when one rank stops, the others block in the next collective, so the whole job stops.
Which rank is to blame comes from the supervisor's view when it has one (a rank in the kernel's stopped
state 'T', or a rank whose CPU time stands still while the others spin), else from the heartbeats (the
rank whose last record is oldest).

Under a launcher, a stall while a host of the attempt is silent (no batch from its node agent) is held back for
`silent_host_hold`: the host is dead or cut off and its peers wait for it in a collective, which host_lost names
(and remedies by leaving the host out) once its silence lasts; a hang would instead diagnose a host that cannot
answer and restart on it. Past the hold the hang fires as usual.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

from healer.core.detectors.base import Detector, Evaluation, Finding
from healer.core.detectors.history import RankHistory, prune, quantile
from healer.core.detectors.silence import silent_hosts
from healer.core.heartbeats import RankBeat
from healer.core.jobview import Readings
from healer.core.processes import ProcessState


@dataclass(slots=True)
class _JobProgress:
    low_step: int
    since: float
    """Healer time at which `low_step` was first seen (the last progress)."""
    attempt: int | None


class Hang(Detector):
    name = "hang"

    @dataclass(kw_only=True, slots=True)
    class Config:
        floor: timedelta = timedelta(seconds=10)
        """Never call a hang before this long without progress."""
        k: float = 3.0
        """The timeout is k times the p99 step time, when that is above the floor."""
        min_samples: int = 5
        """Step times to see before the learned p99 counts."""
        silent_after: timedelta = timedelta(seconds=3)
        """A host is silent when its agent's last batch is older than this."""
        silent_host_hold: timedelta = timedelta(seconds=30)
        """How long a stall is held back while a host of the attempt is silent (above host_lost's `after`)."""

        def __post_init__(self) -> None:
            if self.silent_after <= timedelta(0) or self.silent_host_hold < timedelta(0):
                raise ValueError(f"silent_after must be > 0 and silent_host_hold >= 0, got {self.silent_after}, "
                                 f"{self.silent_host_hold}")
            if self.floor <= timedelta(0):
                raise ValueError(f"floor must be > 0, got {self.floor}")
            if self.k < 1:
                raise ValueError(f"k must be >= 1, got {self.k}")
            if self.min_samples < 1:
                raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._history = RankHistory(keep=8)
        self._jobs: dict[str, _JobProgress] = {}
        self._times: dict[str, deque[float]] = {}

    def timeout_s(self, job: str) -> tuple[float, float | None]:
        """(timeout, learned p99 or None) for `job` as things stand."""
        floor = self.config.floor.total_seconds()
        times = self._times.get(job)
        if times is None or len(times) < self.config.min_samples:
            return floor, None
        p99 = quantile(list(times), 0.99)
        return max(floor, self.config.k * p99), p99

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        new = self._history.update(table, now)
        beats: dict[str, list[RankBeat]] = {}
        for beat in table.ranks():
            beats.setdefault(beat.job, []).append(beat)
        # NOTE: a job still in the view keeps its state however long it has been silent (a hang that lasts must not
        # start its clock again); one the history still knows keeps its learned step times across a restart.
        known = self._history.job_names() | set(beats)
        prune(self._jobs, known, self._history.restarted)
        prune(self._times, known, self._history.restarted)
        for series, sample in new:
            if sample.step_seconds is not None:
                self._times.setdefault(series.job, deque(maxlen=512)).append(sample.step_seconds)
        firing, healthy = [], set()
        states = table.processes.states()
        for job, job_beats in beats.items():
            attempt = table.processes.attempt(job)
            if attempt is not None:
                # Under a supervisor only the current attempt's ranks count: the heartbeats of the ranks it
                # stopped linger in the sidecars (with their old steps) while the job restarts.
                pids = {st.pid for st in states if st.job == job and st.attempt == attempt}
                job_beats = [b for b in job_beats if b.entry.pid in pids]
                if not job_beats:
                    continue
            steps = [b.step for b in job_beats]
            if any(s is None for s in steps):
                continue  # a rank has not finished its first step: starting up, not hanging
            if any(_finishing(b) for b in job_beats):
                healthy.add(job)  # the final save and the teardown: the job is ending, not hanging
                continue
            low = min(s for s in steps if s is not None)
            prog = self._jobs.get(job)
            if prog is None or low != prog.low_step or attempt != prog.attempt:
                self._jobs[job] = prog = _JobProgress(low_step=low, since=now, attempt=attempt)
            stalled = now - prog.since
            timeout, p99 = self.timeout_s(job)
            if stalled > timeout:
                silent = silent_hosts(table, job, now, self.config.silent_after.total_seconds())
                if silent and min(silent.values()) <= self.config.silent_host_hold.total_seconds():
                    continue  # held: neither firing nor healthy while host_lost makes up its mind
                firing.append(self._finding(job, job_beats, states, stalled, timeout, p99, low, now))
            else:
                healthy.add(job)
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _finding(self, job: str, job_beats: list[RankBeat], states: list[ProcessState], stalled: float,
                 timeout: float, p99: float | None, low: int, now: float) -> Finding:
        job_states = {s.rank: s for s in states if s.job == job}
        suspects, how = suspect_ranks(job_beats, job_states, now)
        nodes = sorted({b.node for b in job_beats if b.rank in suspects})
        return Finding(
            key=job, job=job, node=nodes[0] if len(nodes) == 1 else None,
            summary=f"no step progress for {stalled:.0f} s (timeout {timeout:.1f} s) at step {low}; "
                    f"suspect rank(s) {', '.join(map(str, suspects))} ({how})",
            evidence={"stalled_s": round(stalled, 3), "timeout_s": round(timeout, 3),
                      "p99_step_s": round(p99, 4) if p99 is not None else None, "k": self.config.k,
                      "floor_s": self.config.floor.total_seconds(), "step": low,
                      "suspect_ranks": suspects, "suspect_nodes": nodes, "suspected_by": how,
                      "ranks": [{"rank": b.rank, "node": b.node, "step": b.step, "mesh": dict(b.entry.mesh),
                                 "staleness_s": round(b.staleness(now), 3),
                                 "proc_state": job_states[b.rank].state if b.rank in job_states else None}
                                for b in sorted(job_beats, key=lambda b: b.rank)][:64]},
            labels={"suspect_node": nodes[0]} if len(nodes) == 1 else {},
        )


def _finishing(beat: RankBeat) -> bool:
    """The rank left its training loop after its latest step (the trainer's `finishing` event)."""
    event = beat.entry.last_event
    # NOTE: an event's fields are free-form (whatever the trainer passed); `step` is the one finishing sets.
    return event is not None and event.name == "finishing" and event.fields.get("step") == (beat.step or 0) + 1


def suspect_ranks(beats: list[RankBeat], states: dict[int, ProcessState], now: float) -> tuple[list[int], str]:
    """Which ranks hold the job up, and how that was told: stopped by the kernel, then the lowest step, then
    the oldest heartbeat record. Every rank when nothing singles one out."""
    stopped = sorted(r for r, s in states.items() if s.state in ("T", "t"))
    if stopped:
        return stopped, "process stopped (state T)"
    low = min(b.step or 0 for b in beats)
    behind = sorted(b.rank for b in beats if (b.step or 0) == low)
    if len(behind) < len(beats):
        return behind, "lowest step"
    oldest = max(b.staleness(now) for b in beats)
    stale = sorted(b.rank for b in beats if oldest - b.staleness(now) < 0.5)
    if len(stale) < len(beats):
        return stale, "oldest heartbeat"
    return sorted(b.rank for b in beats), "all ranks alike"
