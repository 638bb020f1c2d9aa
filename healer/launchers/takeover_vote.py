"""Whether a healer that takes a job over adopts the attempt its predecessor left running, from what each of the
attempt's hosts says: adopted when a strict majority of them run it (the others are left to the detectors: a host
that does not report is lost, and is left out by the restart that follows), stopped when fewer than a majority can.
While the hosts not reached yet could still tip it either way, the vote is undecided and they are asked again; once
the asking is over, an undecided vote stops the attempt (nothing is adopted on a guess)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class HostSays(Enum):
    RUNS = "runs"
    """Its agent runs the attempt (not ended, not stopping)."""
    NOT_RUNNING = "not running"
    """Its agent answered: the attempt ended there, is stopping, or is not known there (a new agent)."""
    UNREACHED = "unreached"
    """Its agent did not answer (or there is none)."""


@dataclass(frozen=True, slots=True)
class TakeOverVote:
    adopt: bool | None
    """True: adopt the attempt; False: stop it; None: undecided (ask the unreached hosts again)."""
    running: tuple[str, ...]
    not_running: tuple[str, ...]
    unreached: tuple[str, ...]
    decision_basis: str

    def to_payload(self) -> dict[str, Any]:
        return {"adopt": self.adopt, "running": list(self.running), "not_running": list(self.not_running),
                "unreached": list(self.unreached), "decision_basis": self.decision_basis}


def vote(attempt: int, hosts: tuple[str, ...], says: Mapping[str, HostSays], final: bool) -> TakeOverVote:
    """The vote on `attempt` run on `hosts`, from what each said (a host missing from `says` is unreached).
    `final`: no host will be asked again (an undecided vote stops the attempt)."""
    of = {h: says.get(h, HostSays.UNREACHED) for h in hosts}
    running, not_running, unreached = (tuple(h for h in hosts if of[h] is s) for s in HostSays)
    need = len(hosts) // 2 + 1
    counted = f"{len(running)} of {len(hosts)} host(s) run attempt {attempt} (a majority is {need})"
    if len(running) >= need:
        return TakeOverVote(True, running, not_running, unreached,
                            f"{counted}: adopted" + (f"; not running there: {', '.join(not_running + unreached)}"
                                                     if not_running or unreached else ""))
    if len(running) + len(unreached) < need:
        return TakeOverVote(False, running, not_running, unreached,
                            f"{counted}, and no more can: stopped")
    if final:
        return TakeOverVote(False, running, not_running, unreached,
                            f"{counted}; {', '.join(unreached)} never answered: stopped")
    return TakeOverVote(None, running, not_running, unreached,
                        f"{counted}; {', '.join(unreached)} not reached yet: asking again")
