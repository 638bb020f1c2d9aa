"""An attempt of a job as its coordinator runs it on the hosts' node agents, and the one lifecycle it goes through.

    running ----> stopping ----> ended
       |  \\________________________^
       '------> superseded        (a warm restart took its place: its ranks train on in the next attempt)

Its hosts end their parts one by one (`host_ended`, `host_lost`); once every host's part has ended the attempt has
ended, whether it finished, failed or was stopped. Every change of state goes through `advance`, which refuses a
transition the table does not have (IllegalAttemptTransition): an attempt that ended never runs again, and one that
was superseded never ends a second time. The journal (wire/journal.py) records each start and end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ground.lifecycle import check_transition
from healer.launchers.warm_control import Generation


class AttemptState(str, enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    """The healer ordered it stopped; some hosts' parts have not ended yet."""
    ENDED = "ended"
    SUPERSEDED = "superseded"


TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.RUNNING: frozenset({AttemptState.STOPPING, AttemptState.ENDED, AttemptState.SUPERSEDED}),
    AttemptState.STOPPING: frozenset({AttemptState.ENDED}),
    AttemptState.ENDED: frozenset(),
    AttemptState.SUPERSEDED: frozenset(),
}


class IllegalAttemptTransition(RuntimeError):
    """An attempt was asked to move between two states the table does not connect."""


@dataclass(slots=True)
class AgentRank:
    rank: int
    local_rank: int
    node: str
    pid: int
    started: float | None
    """The process's start time on its host (None: only known by its exit)."""


@dataclass(slots=True)
class AgentAttempt:
    number: int
    nodes: tuple[str, ...]
    started_at: float
    dp: int | None
    resume: str | None
    ranks: dict[int, AgentRank] = field(default_factory=dict)
    """pid -> rank, as the agents reported them."""
    ended: set[str] = field(default_factory=set)
    """Hosts whose part of the attempt has ended (their torchrun agent exited, or the host was lost)."""
    exit_codes: dict[str, int] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    """Hosts whose agent could not be reached when the attempt was stopped."""
    warm: Generation | None = None
    """The generation of the job's warm pool this attempt is (None: a torchrun attempt)."""
    standby_hosts: tuple[str, ...] = ()
    """Spares that run standbys of this attempt's generation and train none of its ranks: a stop must reach them too,
    or the next pool cannot form there (an agent runs one attempt at a time)."""
    state: AttemptState = AttemptState.RUNNING
    stopped_by_healer: bool = False
    """It ended after the healer ordered it stopped (its hosts' exit codes say nothing of the job then)."""

    def advance(self, to: AttemptState) -> None:
        check_transition(TRANSITIONS, self.state, to, f"attempt {self.number}", IllegalAttemptTransition)
        self.state = to

    def host_ended(self, node: str, exit_code: int) -> bool:
        """`node`'s part ended with `exit_code`; whether that ended the attempt."""
        if node not in self.nodes or node in self.ended:
            return False
        self.ended.add(node)
        self.exit_codes[node] = exit_code
        return self._maybe_end()

    def hosts_lost(self, nodes: set[str]) -> bool:
        """`nodes` could not be reached to stop their parts: nothing of the attempt can run there with its peers
        gone, so their parts count as ended; whether that ended the attempt."""
        self.lost |= nodes
        self.ended |= nodes
        return self._maybe_end()

    def stop(self) -> None:
        """The healer ordered it stopped (nothing changes for an attempt that is over)."""
        if self.state is AttemptState.RUNNING:
            self.advance(AttemptState.STOPPING)

    def supersede(self) -> None:
        """A warm restart takes its place: its survivors go on in the next attempt."""
        self.advance(AttemptState.SUPERSEDED)
        self.ended = set(self.nodes)

    def _maybe_end(self) -> bool:
        if self.state in (AttemptState.RUNNING, AttemptState.STOPPING) and set(self.nodes) <= self.ended:
            self.stopped_by_healer = self.state is AttemptState.STOPPING
            self.advance(AttemptState.ENDED)
            return True
        return False

    @property
    def stopping(self) -> bool:
        """The healer ordered it stopped (it may have ended since)."""
        return self.state is AttemptState.STOPPING or (self.state is AttemptState.ENDED and self.stopped_by_healer)

    @property
    def superseded(self) -> bool:
        return self.state is AttemptState.SUPERSEDED

    @property
    def done(self) -> bool:
        """Every host's part has ended (or it was superseded)."""
        return self.state in (AttemptState.ENDED, AttemptState.SUPERSEDED)

    @property
    def succeeded(self) -> bool:
        """It finished every step: it ended by itself, on every host with 0, none lost."""
        return (self.state is AttemptState.ENDED and not self.stopped_by_healer and not self.lost
                and all(c == 0 for c in self.exit_codes.values()))
