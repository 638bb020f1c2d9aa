"""`hang`: a job whose slowest rank has made no step progress for longer than its timeout.

The timeout is learned per phase. For a training step it is max(floor, k x p99 step time), the p99 learned online
from the step times the ranks report, less the time a step spent saving a checkpoint (until `min_samples` steps
are seen the floor alone applies): a hang inside a step is called about k p99 step times after the job's last
progress. A phase that takes longer than a step has a timeout of its own, max(its floor, k x the p99 of how long it
took before): a checkpoint save (`checkpoint_save`: a slow store is not a hang), the start of a rank (`startup`,
`restore`) and, under a launcher, the first step of an attempt (`first_step`: from the moment its ranks are seen
to their first step, startup and restore included). Which phase each rank is in now comes from the phase file it
keeps (wire/phase_now.py), as its node agent read it; how long each such phase took is learned from the
same reports (a rank seen to leave it), and kept across the job's restarts: a save takes as long after one.
A rank the kernel has stopped (state T) does no work in any phase: while one is, the job is timed as a step.

Progress is the lowest step of the job's ranks: when one rank stops, the others block in the next collective, so
the whole job stops. Which rank is to blame comes first from the kernel (a rank in the stopped state 'T', as the
node agent or the sidecar read it), else from the heartbeats (the rank whose last record is oldest); the responder then
reads every rank's stack, state and phase (healer/detect/hang_attribution.py).

Under a launcher, a stall while a host of the attempt is silent (no batch from its node agent) is held back for
`silent_host_hold`: the host is dead or cut off and its peers wait for it in a collective, which host_lost names
(and remedies by leaving the host out) once its silence lasts; a hang would instead diagnose a host that cannot
answer and restart on it. Past the hold the hang fires as usual. A stall of an attempt one of whose ranks died
is never a hang: the crash detector owns it (it may wait for the report of how the rank died).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.silence import silent_hosts
from healer.detect.suspects import Suspect
from healer.observe.heartbeats import RankBeat
from healer.observe.history import JobSamples, RankHistory, prune, quantile
from healer.observe.jobview import Readings
from healer.observe.processes import ProcessState
from healer.observe.rank_columns import FINISHING, STOPPED_STATES

STEP_TIMES_KEPT = 512
"""Per job, the newest step times the p99 is learned from (of any of its ranks)."""
FIRST_STEP = "first_step"
"""Not a phase a rank names: the time from an attempt's ranks being seen to the end of their first step."""
DEFAULT_PHASE_FLOORS = {"startup": timedelta(minutes=5), "restore": timedelta(minutes=5),
                        "checkpoint_save": timedelta(minutes=5), FIRST_STEP: timedelta(minutes=2)}
"""Before any has been seen to end: loading a large model or writing its checkpoint to a shared store takes
minutes, and calling it a hang would restart a job that was only slow."""


@dataclass(slots=True)
class _JobProgress:
    low_step: int | None
    """None: a rank of the attempt has not finished its first step."""
    since: float
    """Healer time at which `low_step` was first seen (the last progress)."""
    attempt: int | None


@dataclass(slots=True)
class _InPhase:
    phase: str
    entered: float
    last_seen: float


@dataclass(slots=True)
class PhaseDurations:
    """How long each long phase took, per job, from the rank processes seen to enter and then leave it (a phase whose
    process was stopped or died in it tells nothing and is dropped). By pid: a new attempt's ranks are other
    processes, and what the old ones were in ended unseen."""

    phases: frozenset[str]
    keep: int = 64
    done: dict[str, deque[float]] = field(default_factory=dict)
    _open: dict[int, _InPhase] = field(default_factory=dict)
    """pid -> the long phase it is in."""

    def observe(self, states: list[ProcessState]) -> None:
        seen = set()
        for st in states:
            seen.add(st.pid)
            was = self._open.get(st.pid)
            same = was is not None and st.phase == was.phase and st.phase_entered is not None \
                and abs(st.phase_entered - was.entered) < 1.0  # NOTE: re-derived from each report: a little jitter
            if same:
                assert was is not None
                was.last_seen = st.sampled_at
                continue
            if was is not None:
                self.add(was.phase, was.last_seen - was.entered)
                del self._open[st.pid]
            if st.phase in self.phases and st.phase_entered is not None:
                self._open[st.pid] = _InPhase(st.phase, st.phase_entered, st.sampled_at)
        for pid in [p for p in self._open if p not in seen]:
            del self._open[pid]

    def add(self, phase: str, seconds: float) -> None:
        self.done.setdefault(phase, deque(maxlen=self.keep)).append(max(0.0, seconds))

    def p99(self, phase: str) -> float | None:
        times = self.done.get(phase)
        return quantile(list(times), 0.99) if times else None


class Hang(Detector):
    name = "hang"
    reads_processes = True  # it times an attempt's first step, before any rank of it reports one
    measures_silence = True

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
        phase_floors: dict[str, timedelta] = field(default_factory=dict)
        """Phase -> its timeout before one has been seen to end (and its least after); merged over
        DEFAULT_PHASE_FLOORS (startup, restore, checkpoint_save, first_step)."""

        def __post_init__(self) -> None:
            self.phase_floors = {**DEFAULT_PHASE_FLOORS, **self.phase_floors}
            bad = sorted(name for name, floor in self.phase_floors.items() if floor <= timedelta(0))
            if bad:
                raise ValueError(f"phase_floors must be > 0, got {', '.join(bad)}")
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
        self.history = RankHistory(keep=8)
        self._jobs: dict[str, _JobProgress] = {}
        self._times: dict[str, deque[float]] = {}
        self._phases: dict[str, PhaseDurations] = {}
        """Per job, kept across its attempts (pruned only when the job is forgotten)."""

    def timeout_s(self, job: str) -> tuple[float, float | None]:
        """(timeout, learned p99 or None) of a training step of `job` as things stand."""
        floor = self.config.floor.total_seconds()
        times = self._times.get(job)
        if times is None or len(times) < self.config.min_samples:
            return floor, None
        p99 = quantile(list(times), 0.99)
        return max(floor, self.config.k * p99), p99

    def phase_timeout_s(self, job: str, phase: str) -> tuple[float, float | None]:
        """(timeout, learned p99 or None) of one of the long phases (phase_floors) of `job`."""
        floor = self.config.phase_floors[phase].total_seconds()
        p99 = self._phases[job].p99(phase) if job in self._phases else None
        return (floor, None) if p99 is None else (max(floor, self.config.k * p99), p99)

    def _timeout(self, job: str, starting: bool, states: list[ProcessState]) -> tuple[float, float | None, str]:
        """The job's timeout now: that of a step (or of the first step, while the attempt makes it), or that of the
        longest phase one of its ranks is in, when that is longer."""
        timeout, p99 = self.phase_timeout_s(job, FIRST_STEP) if starting else self.timeout_s(job)
        phase = FIRST_STEP if starting else "step"
        # NOTE: a long phase is waited out because its work goes on (a slow store is still written to). A rank the
        # kernel has stopped does no work in any phase, and the job waits on it whatever its peers are in (a save's
        # commit gathers from every rank): it is timed as a step, as when it is stopped between saves.
        if any(s.state in STOPPED_STATES for s in states):
            return timeout, p99, phase
        for name in sorted({s.phase for s in states if s.phase in self.config.phase_floors}):
            t, q = self.phase_timeout_s(job, name)
            if t > timeout:
                timeout, p99, phase = t, q, name
        return timeout, p99, phase

    def _learn_step_times(self, new: dict[str, np.ndarray], samples: dict[str, JobSamples]) -> None:
        """Each job's newest step times, at most STEP_TIMES_KEPT of them (at the largest a cycle brings 131,072 new
        samples of one job, and all but the last 512 would be pushed out within the cycle)."""
        for job, slots in new.items():
            held = samples[job]
            # A step that saved a checkpoint spent it in its `checkpoint` phase: that is a save's time, timed as a
            # phase of its own, not a step's.
            times = held.newest("step_seconds", slots) - held.newest("checkpoint_s", slots)
            times = np.maximum(times[~np.isnan(times)][-STEP_TIMES_KEPT:], 0.0)
            if times.size:
                self._times.setdefault(job, deque(maxlen=STEP_TIMES_KEPT)).extend(times.tolist())

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        new = self.history.update(table, now)
        columns = table.columns()
        # NOTE: a job still in the view keeps its state however long it has been silent (a hang that lasts must not
        # start its clock again); a new attempt learns its step times afresh (its hosts, even its layout, may have
        # changed) but keeps how long a save or a first step took.
        known = self.history.job_names() | set(columns) | set(table.processes.jobs())
        prune(self._jobs, known, self.history.restarted)
        prune(self._times, known, self.history.restarted)
        prune(self._phases, known)
        self._learn_step_times(new, self.history.jobs())
        firing, healthy = [], set()
        states = table.processes.states()
        # NOTE: a rank of the attempt that died is a crash, however long the crash detector waits to learn how it
        # died (torchrun's report can take its stop grace): its peers' stall is the crash's, not a second fault.
        died = {(e.job, e.attempt) for e in table.processes.exits() if e.failed}
        for job in sorted(set(columns) | set(table.processes.jobs())):
            cols = columns.get(job)
            counted = cols.counts if cols is not None else np.zeros(0, dtype=bool)
            attempt = table.processes.attempt(job)
            job_states = [st for st in states if st.job == job and st.attempt == attempt]
            if attempt is not None:
                self._phases.setdefault(job, PhaseDurations(frozenset(self.config.phase_floors))).observe(job_states)
                if table.processes.is_stopping(job):
                    continue  # being stopped (its heartbeats are no longer shown): neither hung nor healthy
                # Under a launcher only the current attempt's ranks count: the heartbeats of the ranks it
                # stopped linger in the sidecars (with their old steps) while the job restarts.
                if cols is not None:
                    pids = np.fromiter({st.pid for st in job_states}, dtype=np.int64)
                    counted = counted & np.isin(cols.pid, pids)
                if not job_states:
                    continue
            elif not counted.any():
                continue
            # NOTE: over the job's columns: at 131,072 ranks a pass over its heartbeats cost ~0.3 s a cycle.
            steps = cols.step[counted] if cols is not None else np.zeros(0, dtype=np.int64)
            reporting = len(steps)
            prog = self._jobs.get(job)
            stepped = prog is not None and prog.attempt == attempt and prog.low_step is not None
            # A rank that has not finished its first step (or not yet said hello): the attempt is starting. Under a
            # launcher that is timed too (its first step has a timeout of its own); without one, nothing tells a
            # rank starting from one that restarted, and it is left alone. In an attempt that has made steps, the
            # ranks that report are the ones that count.
            unsure = bool((steps < 0).any()) or not reporting
            starting = attempt is not None and not stepped and (unsure or reporting < len(job_states))
            if unsure and not starting:
                continue
            assert cols is not None or starting
            if cols is not None and (cols.flags[counted] & FINISHING).any():
                healthy.add(job)  # the final save and the teardown: the job is ending, not hanging
                continue
            low = None if starting else int(steps[steps >= 0].min())
            if prog is None or low != prog.low_step or attempt != prog.attempt:
                if prog is not None and prog.low_step is None and low is not None and attempt == prog.attempt:
                    self._phases[job].add(FIRST_STEP, now - prog.since)
                self._jobs[job] = prog = _JobProgress(low_step=low, since=now, attempt=attempt)
            stalled = now - prog.since
            timeout, p99, phase = self._timeout(job, starting, job_states)
            if stalled > timeout:
                if (job, attempt) in died:
                    continue  # held: the crash detector names the rank that died
                silent = silent_hosts(table, job, now, self.config.silent_after.total_seconds())
                if silent and min(silent.values()) <= self.config.silent_host_hold.total_seconds():
                    continue  # held: neither firing nor healthy while host_lost makes up its mind
                job_beats = cols.only(counted).counted_beats() if cols is not None else []
                firing.append(self._finding(job, job_beats, job_states, stalled, timeout, p99, phase, low, now))
            else:
                healthy.add(job)
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _finding(self, job: str, job_beats: list[RankBeat], states: list[ProcessState], stalled: float,
                 timeout: float, p99: float | None, phase: str, low: int | None, now: float) -> Finding:
        job_states = {s.rank: s for s in states}
        suspects, how = suspect_ranks(job_beats, job_states, now)
        node_of = {b.rank: b.node for b in job_beats} | {s.rank: s.node for s in states}
        nodes = sorted({node_of[r] for r in suspects if r in node_of})
        where = f"at step {low}" if low is not None else "before the attempt's first step"
        timed = f"timeout {timeout:.1f} s" + (f", that of {phase}" if phase != "step" else "")
        beat_of = {b.rank: b for b in job_beats}
        return Finding(
            key=job, job=job, node=nodes[0] if len(nodes) == 1 else None,
            summary=f"no step progress for {stalled:.0f} s ({timed}) {where}; "
                    f"suspect rank(s) {', '.join(map(str, suspects))} ({how})",
            evidence={"stalled_s": round(stalled, 3), "timeout_s": round(timeout, 3), "timed_as": phase,
                      "p99_step_s": round(p99, 4) if p99 is not None else None, "k": self.config.k,
                      "floor_s": self.config.floor.total_seconds(), "step": low,
                      "suspected_by": how,
                      "ranks": [_rank_row(r, beat_of.get(r), job_states.get(r), node_of.get(r), now)
                                for r in sorted(set(beat_of) | set(job_states))[:64]]},
            labels={"suspect_node": nodes[0]} if len(nodes) == 1 else {},
            suspects=tuple(Suspect(node=node_of.get(r), rank=r) for r in suspects),
        )


def _rank_row(rank: int, beat: RankBeat | None, st: ProcessState | None, node: str | None,
              now: float) -> dict[str, object]:
    return {"rank": rank, "node": node, "step": beat.step if beat else None,
            "mesh": dict(beat.entry.mesh) if beat else {},
            "staleness_s": round(beat.staleness(now), 3) if beat else None,
            "proc_state": st.state if st else (beat.proc_state if beat else None),
            "phase": st.phase if st else None,
            "in_phase_s": round(now - st.phase_entered, 3) if st and st.phase_entered is not None else None}


def suspect_ranks(beats: list[RankBeat], states: dict[int, ProcessState], now: float) -> tuple[list[int], str]:
    """Which ranks hold the job up, and how that was told: stopped by the kernel, then the ranks not through their
    first step while others are, then the lowest step, then the oldest heartbeat record. Every rank when nothing
    singles one out. The kernel state comes from the node agents' reports under a launcher, else from the
    sidecars' heartbeats (each reads its ranks' /proc: the healer on its own has no other way to tell)."""
    stopped = sorted({r for r, s in states.items() if s.state in STOPPED_STATES}
                     | {b.rank for b in beats if b.proc_state in STOPPED_STATES})
    if stopped:
        return stopped, "process stopped (state T)"
    ranks = sorted({b.rank for b in beats} | set(states))
    started = {b.rank for b in beats if b.step is not None}
    if started and len(started) < len(ranks):
        return sorted(set(ranks) - started), "not through its first step"
    if not started:
        return ranks, "all ranks alike"
    low = min(b.step or 0 for b in beats)
    behind = sorted(b.rank for b in beats if (b.step or 0) == low)
    if len(behind) < len(beats):
        return behind, "lowest step"
    oldest = max(b.staleness(now) for b in beats)
    stale = sorted(b.rank for b in beats if oldest - b.staleness(now) < 0.5)
    if len(stale) < len(beats):
        return stale, "oldest heartbeat"
    return sorted(b.rank for b in beats), "all ranks alike"
