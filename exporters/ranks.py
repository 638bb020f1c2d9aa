"""The sidecar's view of the ranks on its node: last record, liveness, drops and events of each.

The receiver thread writes into a RankTable; scrapes and heartbeats read consistent snapshots of
it. The clock and the process probe are injected so that tests can move time and kill processes
without sleeping or forking.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from exporters.schema import Event, Hello, Message, StepRecord
from megaheal import procfs

# Events counted per rank in the metrics; any other kind is kept for the heartbeat only, so that
# a rank cannot grow its series count by inventing event names.
COUNTED_EVENTS = ("checkpoint_saved", "checkpoint_failed", "exception")


@dataclass(slots=True)
class RankState:
    """Everything the sidecar knows about one rank of one job."""

    job: str
    rank: int
    pid: int
    local_rank: int | None = None
    node: str | None = None
    world_size: int | None = None
    mesh: dict[str, int] = field(default_factory=dict)
    first_seen: float = 0.0
    last_seen: float = 0.0
    last_step: StepRecord | None = None
    dropped: int = 0
    events: Counter[str] = field(default_factory=Counter)
    last_event: dict[str, Any] | None = None
    # Filled in by snapshots only:
    age_seconds: float = 0.0
    alive: bool = True
    reduce_lag_seconds: float | None = None


class RankTable:
    """Thread-safe table of ranks keyed by (job, rank); the newest process of a rank replaces the old one.

    A rank is alive while its process is (procfs.alive: a zombie, dead but not yet reaped, is not).
    NOTE: that needs the sidecar in the ranks' PID namespace (same host, or a pod sharing its PID namespace).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        is_alive: Callable[[int], bool] = procfs.alive,
        forget_after_s: float = 600.0,
        max_ranks: int = 256,
    ) -> None:
        if forget_after_s <= 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        if max_ranks < 1:
            raise ValueError(f"max_ranks must be >= 1, got {max_ranks}")
        self._clock, self._is_alive = clock, is_alive
        self._forget_after_s, self._max_ranks = forget_after_s, max_ranks
        self._ranks: dict[tuple[str, int], RankState] = {}
        self._lock = threading.Lock()
        self.rejected = 0  # records refused because the table already holds max_ranks ranks

    def observe(self, message: Message) -> None:
        origin = message.origin
        key = (origin.job, origin.rank)
        now = self._clock()
        with self._lock:
            state = self._ranks.get(key)
            if state is None or state.pid != origin.pid:
                if state is None and len(self._ranks) >= self._max_ranks:
                    self.rejected += 1
                    return
                # A new process for this rank (a restart): start afresh, the old one's numbers are not its own.
                state = RankState(job=origin.job, rank=origin.rank, pid=origin.pid, first_seen=now)
                self._ranks[key] = state
            state.last_seen = now
            state.dropped = max(state.dropped, origin.dropped)
            if isinstance(message, Hello):
                state.local_rank, state.node = message.local_rank, message.node
                state.world_size, state.mesh = message.world_size, dict(message.mesh)
            elif isinstance(message, StepRecord):
                state.last_step = message
                _adopt_identity(state, message.extra)
            elif isinstance(message, Event):
                state.events[message.name] += 1
                state.last_event = {"name": message.name, "time": message.time, "fields": message.fields}

    def snapshot(self) -> list[RankState]:
        """Copies of every rank's state, with age, liveness and dp-reduce lag filled in; forgets long-dead ranks."""
        now = self._clock()
        with self._lock:
            for key, state in list(self._ranks.items()):
                if now - state.last_seen > self._forget_after_s and not self._is_alive(state.pid):
                    del self._ranks[key]
            states = [replace(s, events=Counter(s.events), mesh=dict(s.mesh)) for s in self._ranks.values()]
        for state in states:
            state.age_seconds = now - state.last_seen
            state.alive = self._is_alive(state.pid)
        _fill_reduce_lag(states)
        return sorted(states, key=lambda s: (s.job, s.rank))

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranks)


def _adopt_identity(state: RankState, extra: dict[str, Any]) -> None:
    """Take identity from the step record itself, so a sidecar that missed the hello still knows the rank."""
    if isinstance(extra.get("local_rank"), int):
        state.local_rank = extra["local_rank"]
    if isinstance(extra.get("node"), str):
        state.node = extra["node"]
    if isinstance(extra.get("world_size"), int):
        state.world_size = extra["world_size"]
    mesh = extra.get("mesh")
    if isinstance(mesh, dict) and all(isinstance(v, int) for v in mesh.values()):
        state.mesh = dict(mesh)


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
