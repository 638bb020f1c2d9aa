"""The sidecar's view of the ranks on its node: last record, liveness, drops and events of each, and the running
totals of every step record received (a scrape every 15 s sees one step in many; the totals see them all).

The receiver thread writes into a RankTable; scrapes and heartbeats read consistent snapshots of
it. The clock and the process probe (the kernel's state of a pid) are injected so that tests can move time and
kill or stop processes without sleeping or forking.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from ground import procfs
from wire.rerun import EVENT as RERUN_EVENT
from wire.telemetry import PHASE_ORDER, Event, EventBody, Hello, Message, StepBody, StepRecord

# Events counted per rank in the metrics; any other kind is kept for the heartbeat only, so that
# a rank cannot grow its series count by inventing event names.
COUNTED_EVENTS = ("checkpoint_saved", "checkpoint_failed", "exception")
# The phases that are a rank's own work, not waiting for others: what tells a straggler apart in a synchronous job,
# whose total step time is the same on every rank. NOTE: the healer's definition
# (healer/observe/rank_columns.py COMPUTE_PHASES), written out here because exporters/ stands below healer/; a test
# checks they agree.
COMPUTE_PHASES = ("forward_backward", "optimizer")
# Upper bounds of the step-duration histogram's buckets, in seconds: from a 10 ms step (a tiny model) to a 10-minute
# one (a huge batch, or a step that includes a blocking save), about 2.5x apart.
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0, 600.0)


@dataclass(slots=True)
class StepTotals:
    """Running totals of one rank's compute over its step records since its process started (counters: they only
    grow, and start at 0 again with a new process, which Prometheus' rate() reads as a counter reset). The whole
    step's duration is counted per node (StepHistogram): in a synchronous job it is the same on every rank."""

    compute_steps: int = 0
    """Records that carried a compute phase (a trainer that reports no phases has none)."""
    compute_seconds: float = 0.0

    def add(self, step: StepBody) -> None:
        # NOTE: a negative duration (the wire only asks for a finite number) counts as 0: a sum that went down
        # would read to rate() as a counter reset.
        if any(p in step.phases for p in COMPUTE_PHASES):
            self.compute_steps += 1
            self.compute_seconds += sum(max(step.phases.get(p, 0.0), 0.0) for p in COMPUTE_PHASES)


@dataclass(slots=True)
class StepHistogram:
    """Every step of every rank of one job on this node, by duration: cumulative counts per STEP_BUCKETS bound (and
    +Inf), their sum and count. It outlives the ranks (a restart does not reset it), so it only grows."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    sum: float = 0.0
    count: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds of each of the trainer's phases (PHASE_ORDER) over the same steps; other names are left out, as the
    receiver leaves them out (wire/telemetry.py, known_phases_only), so the series stay bounded."""

    def observe(self, step: StepBody) -> None:
        seconds = max(step.step_seconds, 0.0)  # as in StepTotals.add
        self.buckets[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1
        for phase, value in step.phases.items():
            if phase in PHASE_ORDER:
                self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + max(value, 0.0)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of steps <= le) for each bound and +Inf, as a Prometheus histogram exposes them."""
        bounds = [*(f"{b:g}" for b in STEP_BUCKETS), "+Inf"]
        return list(zip(bounds, itertools.accumulate(self.buckets)))


@dataclass(slots=True)
class RankState:
    """Everything the sidecar knows about one rank of one job."""

    job: str
    rank: int
    pid: int
    started: float | None = None
    """When the process started (seconds after boot), read at its first record: a later process given the same pid
    is not this rank (None: it was gone before it could be read)."""
    local_rank: int | None = None
    node: str | None = None
    world_size: int | None = None
    mesh: dict[str, int] = field(default_factory=dict)
    first_seen: float = 0.0
    last_seen: float = 0.0
    last_step: StepBody | None = None
    first_nonfinite: StepBody | None = None
    """The step at which the rank's loss or gradient norm turned non-finite, held until a heartbeat carried it: the
    batches carry each rank's newest step (one in five at 0.2 s a step), and the healer rolls back to the checkpoint
    before the step it sees first (a later one seen first can put a poisoned checkpoint before it)."""
    dropped: int = 0
    totals: StepTotals = field(default_factory=StepTotals)
    events: Counter[str] = field(default_factory=Counter)
    last_event: EventBody | None = None
    held_events: list[EventBody] = field(default_factory=list)
    """Events a heartbeat must carry (HELD_EVENTS), oldest first, each until one did: a batch carries a rank's last
    event only, and a checkpoint's or the next verdict's would replace a re-run's verdict before it left."""
    # Filled in by snapshots only:
    age_seconds: float = 0.0
    alive: bool = True
    proc_state: str | None = None
    """The kernel's state letter of the rank's process (T: stopped); None when it is gone."""
    reduce_lag_seconds: float | None = None


HELD_EVENTS = frozenset({RERUN_EVENT})
"""Events every one of which the healer must see (a re-run's verdict), not only the last of a heartbeat's interval."""
MAX_HELD_EVENTS = 16


class RankTable:
    """Thread-safe table of ranks keyed by (job, rank); the newest process of a rank replaces the old one.

    A rank is alive while its process is (a zombie, dead but not yet reaped, is not), the same process: its pid and
    the start time read at its first record (a pid the kernel gave to another process since is not the rank). Its
    kernel state goes with it: a rank stopped by a signal (T) is alive and does nothing, which names it when its job hangs.
    NOTE: that needs the sidecar in the ranks' PID namespace (same host, or a pod sharing its PID namespace).

    A rank silent for forget_after_s is forgotten, whether its process lives or not: a process that stopped
    sending is not a rank the table must keep a place for (a live pid may even be a later process given the same
    number). A hung rank is not lost to the healer by this: it keeps the rank's last heartbeat and watches it age.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        process_state: Callable[[int], str | None] = procfs.state,
        forget_after_s: float = 600.0,
        max_ranks: int = 256,
        start_time: Callable[[int], float | None] = procfs.start_time,
    ) -> None:
        if forget_after_s <= 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        if max_ranks < 1:
            raise ValueError(f"max_ranks must be >= 1, got {max_ranks}")
        self._clock, self._process_state, self._start_time = clock, process_state, start_time
        self._forget_after_s, self._max_ranks = forget_after_s, max_ranks
        self._ranks: dict[tuple[str, int], RankState] = {}
        self._histograms: dict[str, StepHistogram] = {}  # job -> its steps on this node
        self._lock = threading.Lock()
        self.rejected = 0  # records refused because the table already holds max_ranks ranks
        self.forgotten = 0  # ranks dropped after forget_after_s of silence

    def observe(self, message: Message) -> None:
        key = (message.job, message.rank)
        now = self._clock()
        with self._lock:
            state = self._ranks.get(key)
            if state is None or state.pid != message.pid:
                if state is None and len(self._ranks) >= self._max_ranks:
                    self._forget_silent(now)  # make room from ranks gone silent before refusing a new one
                if state is None and len(self._ranks) >= self._max_ranks:
                    self.rejected += 1
                    return
                # A new process for this rank (a restart): start afresh, the old one's numbers are not its own.
                state = RankState(job=message.job, rank=message.rank, pid=message.pid, first_seen=now,
                                  started=self._start_time(message.pid))
                self._ranks[key] = state
            state.last_seen = now
            state.dropped = max(state.dropped, message.dropped)
            if isinstance(message, Hello):
                hello = message.body
                state.local_rank, state.node = hello.local_rank, hello.node
                state.world_size, state.mesh = hello.world_size, dict(hello.mesh)
            elif isinstance(message, StepRecord):
                if _nonfinite(message.body) and (state.last_step is None or not _nonfinite(state.last_step)) \
                        and state.first_nonfinite is None:
                    state.first_nonfinite = message.body
                state.last_step = message.body
                state.totals.add(message.body)
                self._histograms.setdefault(message.job, StepHistogram()).observe(message.body)
                _adopt_identity(state, message.body)
            elif isinstance(message, Event):
                state.events[message.body.name] += 1
                state.last_event = message.body
                if message.body.name in HELD_EVENTS and len(state.held_events) < MAX_HELD_EVENTS:
                    state.held_events.append(message.body)

    def heartbeat_snapshot(self) -> list[RankState]:
        """snapshot() as a heartbeat batch reports it: a rank whose loss turned non-finite since the last batch is
        reported at the step it turned (RankState.first_nonfinite, released here); its newer steps go in the next.
        A held event (HELD_EVENTS) is its last event in one batch, the oldest first."""
        with self._lock:
            held = {key: s.first_nonfinite for key, s in self._ranks.items() if s.first_nonfinite is not None}
            for key in held:
                self._ranks[key].first_nonfinite = None
            events = {key: s.held_events.pop(0) for key, s in self._ranks.items() if s.held_events}
        states = self.snapshot()
        out = [replace(s, last_step=held[(s.job, s.rank)]) if (s.job, s.rank) in held else s for s in states]
        return [replace(s, last_event=events[(s.job, s.rank)]) if (s.job, s.rank) in events else s for s in out]

    def snapshot(self) -> list[RankState]:
        """Copies of every rank's state, with age, liveness and dp-reduce lag filled in; forgets silent ranks."""
        return self._snapshot(histograms=False)[0]

    def metrics_snapshot(self) -> tuple[list[RankState], dict[str, StepHistogram]]:
        """snapshot() and step_histograms() of one moment, for a scrape. NOTE: taken apart, a record that came
        between the two was in the node's histogram and not in its rank's totals (a fresh make test read rank 0's
        compute count at 24 steps of the histogram's 25)."""
        return self._snapshot(histograms=True)

    def _snapshot(self, histograms: bool) -> tuple[list[RankState], dict[str, StepHistogram]]:
        now = self._clock()
        with self._lock:
            self._forget_silent(now)
            states = [replace(s, events=Counter(s.events), mesh=dict(s.mesh), totals=replace(s.totals))
                      for s in self._ranks.values()]
            held = self._histogram_copies() if histograms else {}
        for state in states:
            state.age_seconds = now - state.last_seen
            same = state.started is not None and self._start_time(state.pid) == state.started
            state.proc_state = self._process_state(state.pid) if same else None
            state.alive = procfs.state_is_alive(state.proc_state)
        _fill_reduce_lag(states)
        return sorted(states, key=lambda s: (s.job, s.rank)), held

    def step_histograms(self) -> dict[str, StepHistogram]:
        """Copies of each job's step-duration histogram on this node (jobs with a rank still tracked)."""
        with self._lock:
            return self._histogram_copies()

    def _histogram_copies(self) -> dict[str, StepHistogram]:
        return {job: replace(h, buckets=list(h.buckets), phase_seconds=dict(h.phase_seconds))
                for job, h in sorted(self._histograms.items())}

    def _forget_silent(self, now: float) -> None:
        """Drop ranks not heard from for forget_after_s (caller holds the lock), and the histograms of jobs left
        with none: a finished job's series go, as its ranks' do."""
        for key, state in list(self._ranks.items()):
            if now - state.last_seen > self._forget_after_s:
                del self._ranks[key]
                self.forgotten += 1
        for job in set(self._histograms) - {job for job, _ in self._ranks}:
            del self._histograms[job]

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranks)


def _adopt_identity(state: RankState, step: StepBody) -> None:
    """Take identity from the step record itself, so a sidecar that missed the hello still knows the rank."""
    if step.local_rank is not None:
        state.local_rank = step.local_rank
    if step.node is not None:
        state.node = step.node
    if step.world_size is not None:
        state.world_size = step.world_size
    if step.mesh is not None:
        state.mesh = dict(step.mesh)


def _fill_reduce_lag(states: Iterable[RankState]) -> None:
    """How much later each rank entered its step's dp reduce than the first rank of the node at that step.

    CLOCK_MONOTONIC is shared by the processes of one host, so within a node the entry times are
    comparable: a rank that is always late is what keeps the others waiting in the reduce.
    """
    first: dict[tuple[str, int], int] = {}
    for s in states:
        if s.last_step is not None and s.last_step.dp_reduce_enter_ns is not None:
            key = (s.job, s.last_step.step)
            first[key] = min(first.get(key, s.last_step.dp_reduce_enter_ns), s.last_step.dp_reduce_enter_ns)
    for s in states:
        if s.last_step is not None and s.last_step.dp_reduce_enter_ns is not None:
            s.reduce_lag_seconds = (s.last_step.dp_reduce_enter_ns - first[(s.job, s.last_step.step)]) / 1e9


def _nonfinite(step: StepBody) -> bool:
    return any(v is not None and not math.isfinite(v) for v in (step.loss, step.grad_norm))
