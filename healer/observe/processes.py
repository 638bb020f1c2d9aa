"""The launcher's view of the job's processes, as the detectors read it: how each rank exited (code, signal,
the tail of its log), the kernel state of the ranks still running (a SIGSTOPped rank is 'T'), which processes
belong to the current attempt, and whether the healer is stopping it.

Heartbeats cannot tell a rank that died from one that is silent, nor a stopped rank from one waiting in a
collective: the launcher, which owns the processes, can. It writes here; the crash and hang detectors read.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field, replace

from wire.telemetry import AttemptReport, RankExit

MAX_TAIL_LINES = 50


@dataclass(frozen=True, slots=True)
class ProcessExit:
    """One rank (or agent) that ended."""

    job: str
    attempt: int
    """Which start of the job this was (0 first, +1 per restart): exits of an old attempt are history."""
    node: str
    rank: int | None
    """Global rank; None when only the node's agent is known to have ended (its ranks' fates unknown)."""
    pid: int
    at: float
    """Unix seconds when the launcher saw it end."""
    exit_code: int | None
    """The exit status, or None when a signal ended it."""
    signal: int | None = None
    """The signal number that ended it, if any."""
    log_tail: tuple[str, ...] = ()
    """The last lines of its log (at most MAX_TAIL_LINES)."""
    expected: bool = False
    """True when the launcher itself stopped it (a graceful stop, a restart): never a crash."""
    vanished: bool = False
    """The rank disappeared while its agent still ran and its status could not be read (the agent reaped it
    first): a failure unless the rank had said it was finishing."""
    seen_at: float | None = None
    """Healer seconds when the healer first heard of it (None: as `at`). What the detectors time their waits by:
    `at` is the agent host's clock, which may be ahead of the healer's or behind it."""

    @property
    def waited_from(self) -> float:
        return self.at if self.seen_at is None else self.seen_at

    @property
    def failed(self) -> bool:
        return not self.expected and (self.vanished or self.signal is not None or (self.exit_code or 0) != 0)


@dataclass(frozen=True, slots=True)
class ProcessState:
    """A running rank as /proc shows it."""

    job: str
    attempt: int
    node: str
    rank: int
    pid: int
    state: str
    """The kernel's one-letter state: R running, S sleeping, D disk wait, T stopped, Z zombie."""
    cpu_seconds: float
    """User + system CPU time so far."""
    sampled_at: float
    phase: str | None = None
    """The phase the rank says it is in now (wire/phase_now.py), when it keeps a phase file and is in one."""
    phase_step: int | None = None
    phase_entered: float | None = None
    """Healer time at which it entered `phase` (when its agent's report came, less how long it had been in it)."""


@dataclass(slots=True)
class ProcessView:
    """Thread-safe: the launcher writes from its watcher thread, the detectors read from the healer loop."""

    max_exits: int = 4096
    _exits: deque[ProcessExit] = field(default_factory=deque)
    _states: dict[tuple[str, int], ProcessState] = field(default_factory=dict)
    _attempts: dict[str, int] = field(default_factory=dict)
    _pids: dict[str, frozenset[int]] = field(default_factory=dict)
    _stopping: set[str] = field(default_factory=set)
    _reported: dict[str, dict[str, tuple[tuple[int, int, int, float | None], ...]]] = field(default_factory=dict)
    """job -> node -> (pid, rank, local_rank, started) of every rank its agent reported for the current attempt."""
    _pids_stale: set[str] = field(default_factory=set)
    """Jobs whose pids changed with an agent's report: the union over their nodes is taken when next read."""
    _node_states: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    """(job, node) -> the ranks whose state came from that node: a node's report replaces its own states without
    looking at every rank's (at 16,384 agents reporting each second, a scan per report was quadratic)."""
    _ended: dict[tuple[str, str], int] = field(default_factory=dict)
    """(job, node) -> the exit code of the node's part of the current attempt, once its agent reported it ended."""
    _leftover: dict[tuple[str, str], int] = field(default_factory=dict)
    """(job, node) -> an older attempt the node's agent says still runs there (a host cut off during a restart that
    came back): the launcher stops it."""
    _placed: dict[str, tuple[tuple[str, ...], float]] = field(default_factory=dict)
    """job -> the hosts its current attempt was started on (empty when the launcher did not say), and when."""
    _grouped: set[str] = field(default_factory=set)
    """Jobs that train as replica groups, one per host (train/ft/): one host's standstill is not the job's."""
    _regroups: dict[str, int] = field(default_factory=dict)
    """job -> how often its current attempt was regrouped: a group that fails after a regroup is a fault of its own."""
    _replacing: set[tuple[str, int, int]] = field(default_factory=set)
    """(job, attempt, rank) of ranks the launcher kills to replace them (a warm restart's hung ranks)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def replacing(self, job: str, attempt: int, ranks: tuple[int, ...]) -> None:
        """The launcher kills `ranks` of `attempt` to replace them: their exits are expected, never a crash.
        NOTE: said before the kill: the agent may report the exit while `attempt` is still the job's current one
        (a fresh make test saw a warm restart's own SIGKILL of a hung rank open a crash incident)."""
        with self._lock:
            self._replacing = {k for k in self._replacing if k[0] != job or k[1] >= attempt}
            self._replacing.update((job, attempt, rank) for rank in ranks)

    def record_exit(self, ex: ProcessExit) -> None:
        """Add an exit; one that says how a rank recorded as vanished died replaces that record."""
        with self._lock:
            if not ex.expected and (ex.job, ex.attempt, ex.rank) in self._replacing:
                ex = replace(ex, expected=True)
            if ex.rank is not None and not ex.vanished:
                for i, old in enumerate(self._exits):
                    if old.vanished and (old.job, old.attempt, old.rank) == (ex.job, ex.attempt, ex.rank):
                        del self._exits[i]
                        ex = replace(ex, seen_at=old.seen_at)  # NOTE: heard of first then: the waits go on from it
                        break
            self._exits.append(ex)
            while len(self._exits) > self.max_exits:
                self._exits.popleft()
            if ex.rank is not None:
                self._states.pop((ex.job, ex.rank), None)

    def started(self, job: str, attempt: int, nodes: tuple[str, ...] = (), at: float = 0.0) -> None:
        """The launcher started `attempt` of `job` on `nodes` at `at`: process states of older attempts no longer
        apply."""
        with self._lock:
            self._attempts[job] = attempt
            self._regroups.pop(job, None)
            self._placed[job] = (tuple(nodes), at)
            self._pids[job] = frozenset()
            self._pids_stale.discard(job)
            self._stopping.discard(job)
            self._reported.pop(job, None)
            for key in [k for k in self._ended if k[0] == job]:
                del self._ended[key]
            for rank_key in [k for k, s in self._states.items() if s.job == job and s.attempt != attempt]:
                del self._states[rank_key]
            # The node index of the job, rebuilt from the states that are left (bounded by what the view holds).
            for node_key in [k for k in self._node_states if k[0] == job]:
                del self._node_states[node_key]
            for st in self._states.values():
                if st.job == job:
                    self._node_states.setdefault((job, st.node), set()).add(st.rank)

    def train_in_groups(self, job: str) -> None:
        """`job` trains as replica groups, one per host: the others go on when one host's group is lost."""
        with self._lock:
            self._grouped.add(job)

    def in_groups(self, job: str) -> bool:
        with self._lock:
            return job in self._grouped

    def regrouped(self, job: str, nodes: tuple[str, ...], gone: tuple[str, ...]) -> None:
        """Within the job's current attempt, the replica groups of the hosts `gone` ended or left and are no longer
        its (healer/launchers/coordinator_groups.py): the attempt runs on `nodes` now, and what those hosts' parts
        reported (their states, their end, their ranks' exits) is history, as an older attempt's would be: a group
        started again there is a new part."""
        with self._lock:
            current = self._attempts.get(job)
            self._placed[job] = (tuple(nodes), self._placed.get(job, ((), 0.0))[1])
            for node in gone:
                self._ended.pop((job, node), None)
                self._reported.get(job, {}).pop(node, None)
                for rank in self._node_states.pop((job, node), ()):
                    held = self._states.get((job, rank))
                    if held is not None and held.node == node:
                        del self._states[(job, rank)]
            kept = [e for e in self._exits if not (e.job == job and e.attempt == current and e.node in gone)]
            self._exits = deque(kept)
            self._pids_stale.add(job)
            self._regroups[job] = self._regroups.get(job, 0) + 1

    def regroups(self, job: str) -> int:
        """How often the job's current attempt was regrouped (0: never, or not a job of groups)."""
        with self._lock:
            return self._regroups.get(job, 0)

    def report(self, node: str, r: AttemptReport, now: float) -> None:
        """A node agent's report of its host's part of the job's current attempt (a report of another attempt, late
        or early, is left out): the ranks running there and their states, the exits, whether it ended."""
        with self._lock:
            current = self._attempts.get(r.job)
            if current is not None and r.attempt < current and not r.ended:
                self._leftover[(r.job, node)] = r.attempt
            if current != r.attempt:
                return
            for rank in self._node_states.pop((r.job, node), ()):
                held = self._states.get((r.job, rank))
                if held is not None and held.node == node:
                    del self._states[(r.job, rank)]
            self._node_states[(r.job, node)] = {p.rank for p in r.ranks}
            for p in r.ranks:
                self._states[(r.job, p.rank)] = ProcessState(job=r.job, attempt=r.attempt, node=node, rank=p.rank,
                                                             pid=p.pid, state=p.state, cpu_seconds=p.cpu_seconds,
                                                             sampled_at=now, phase=p.phase, phase_step=p.phase_step,
                                                             phase_entered=None if p.phase_for_s is None
                                                             else now - p.phase_for_s)
            ranks: dict[int, tuple[int, int, int, float | None]] = {
                p.rank: (p.pid, p.rank, p.local_rank, p.started) for p in r.ranks}
            for e in r.exits:
                if e.rank is not None and e.rank not in ranks:
                    ranks[e.rank] = (e.pid, e.rank, 0, None)
            self._reported.setdefault(r.job, {})[node] = tuple(sorted(ranks.values(), key=lambda x: x[1]))
            self._pids_stale.add(r.job)
        for e in r.exits:
            self._record_reported(node, r, e, now)
        # NOTE: after the exits: a reader that sees the host's part ended sees how its ranks ended (the crash
        # detector waits for exactly that).
        if r.ended and r.exit_code is not None:
            with self._lock:
                if self._attempts.get(r.job) == r.attempt:
                    self._ended[(r.job, node)] = r.exit_code

    def _record_reported(self, node: str, r: AttemptReport, e: RankExit, now: float) -> None:
        with self._lock:
            known = next((x for x in self._exits if (x.job, x.attempt, x.rank, x.node) ==
                          (r.job, r.attempt, e.rank, node)), None)
        if known is not None and not (known.vanished and not e.vanished):
            return  # already in the view (every report carries all of the attempt's exits)
        self.record_exit(ProcessExit(job=r.job, attempt=r.attempt, node=node, rank=e.rank, pid=e.pid, at=e.at,
                                     exit_code=e.exit_code, signal=e.signal, log_tail=tuple(e.log_tail),
                                     expected=e.expected, vanished=e.vanished, seen_at=now))

    def reported_ranks(self, job: str) -> list[tuple[str, int, int, int, float | None]]:
        """(node, pid, rank, local_rank, started) of the job's current attempt, as the agents reported them (started:
        the process's start time, None for a rank only known by its exit)."""
        with self._lock:
            return [(node, *x) for node, rs in self._reported.get(job, {}).items() for x in rs]

    def ended_nodes(self, job: str) -> dict[str, int]:
        """The hosts whose part of the job's current attempt ended, with their torchrun's exit code."""
        with self._lock:
            return {node: code for (j, node), code in self._ended.items() if j == job}

    def found(self, job: str, pids: frozenset[int]) -> None:
        """The rank processes of the job's current attempt, as the launcher found them (alive or not)."""
        with self._lock:
            self._pids[job] = pids
            self._pids_stale.discard(job)

    def stopping(self, job: str) -> None:
        """The healer stopped (or is stopping) the job's current attempt: its exits are expected and its silence
        is no fault."""
        with self._lock:
            self._stopping.add(job)

    def is_stopping(self, job: str) -> bool:
        with self._lock:
            return job in self._stopping

    def pids(self, job: str) -> frozenset[int]:
        with self._lock:
            if job in self._pids_stale:
                self._pids_stale.discard(job)
                self._pids[job] = frozenset(x[0] for rs in self._reported.get(job, {}).values() for x in rs)
            return self._pids.get(job, frozenset())

    def update_states(self, states: list[ProcessState]) -> None:
        with self._lock:
            for s in states:
                self._states[(s.job, s.rank)] = s
                self._node_states.setdefault((s.job, s.node), set()).add(s.rank)

    def exits(self) -> list[ProcessExit]:
        with self._lock:
            return list(self._exits)

    def states(self) -> list[ProcessState]:
        with self._lock:
            return list(self._states.values())

    def placement(self, job: str) -> tuple[tuple[str, ...], float]:
        """The hosts of the job's current attempt and when it started (((), 0.0) when the launcher did not say)."""
        with self._lock:
            return self._placed.get(job, ((), 0.0))

    def leftovers(self, job: str) -> dict[str, int]:
        """Hosts whose agent last said an older attempt of `job` still runs there, and which (taken: told once)."""
        with self._lock:
            found = {node: a for (j, node), a in self._leftover.items() if j == job}
            for node in found:
                del self._leftover[(job, node)]
            return found

    def jobs(self) -> list[str]:
        """The jobs a launcher started."""
        with self._lock:
            return sorted(self._attempts)

    def attempt(self, job: str) -> int | None:
        """The job's current attempt, or None when the launcher never started it."""
        with self._lock:
            return self._attempts.get(job)
